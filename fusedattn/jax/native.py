"""cuDNN graphs as native XLA custom calls: how JAX runs the cuDNN backend, with no Python and no
torch at run time (jax/cudnn_call.py prepares each pass's operands around the call).

The custom call (backends/cudnn/native/jax_call.cc) hands XLA's buffers to the launch core the
torch operator uses too, so a launch is a list of pointers and one cuDNN execute. Each call carries
its graph's bytes, uids and digest as attributes, and its pass-by-value numbers: the core's bounded
registry may evict a plan, and a program (or one compiled in another process) then registers its
own bytes again. The libraries are compiled from source on first use (a C++17 compiler and the
headers the installed packages ship) and cached; when that is not possible `unavailable()` says
why, and cuDNN calls from JAX go through torch (buffer callbacks) where torch is installed.
FUSEDATTN_JAX_NATIVE=0 turns the path off.

The handler registered is declared safe for XLA's command buffers, so XLA may record a program's
kernels and these calls into one CUDA graph and replay it, with no host work per kernel (the padded
and THD passes are several small XLA kernels around the call). FUSEDATTN_JAX_COMMAND_BUFFER=0
registers the same handler without that declaration (read once, when the library loads).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import NamedTuple

import numpy as np

from fusedattn.backends.cudnn.native import build, core
from fusedattn.cache import LRUCache, register

__all__ = ["TARGET", "ENV_SWITCH", "COMMAND_BUFFER_SWITCH", "NativePlan", "NO_STEPS", "enabled", "unavailable",
           "plan", "attributes_of_steps", "rebuild_reason", "serialized"]

TARGET = "fusedattn_cudnn_execute"
ENV_SWITCH = "FUSEDATTN_JAX_NATIVE"
COMMAND_BUFFER_SWITCH = "FUSEDATTN_JAX_COMMAND_BUFFER"

_lock = threading.Lock()
_state: dict = {}  # "library" (ctypes.CDLL) or "reason" (str), once decided
# (cfg, direction, buffer names, scalar names) -> NativePlan, or None (cuDNN could not rebuild the graph from its bytes)
_plans: LRUCache = register("jax.native.plans", LRUCache(core.PLAN_CAPACITY // 2))


class NativePlan(NamedTuple):
    """What a custom call needs: its workspace result's bytes and its attributes."""
    workspace: int
    attributes: dict  # plan (the digest), blob (uint8 array), uids (int64 array); the caller adds scalars


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def unavailable() -> str | None:
    """Why the native path cannot run here (None: it can). Loads the libraries on first call."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    with _lock:
        if not _state:
            try:
                _state["library"] = _load()
            except Exception as error:  # no compiler, headers, cuDNN or GPU jax: keep the callbacks
                _state["reason"] = f"{type(error).__name__}: {error}"
    return _state.get("reason")


def plan(cfg, direction: str, device: int, buffers: tuple[str, ...], scalars: tuple[str, ...] = (),
         derived: tuple[str, ...] = ()) -> NativePlan | None:
    """The custom call for cfg's pass on `device`, registered with the core (and deserialized there)
    once. The call passes its operands and results named `buffers` (graph tensor names; a name the
    graph lacks is left unbound), then a uint8 workspace result of the plan's bytes (at least 1), then
    the pass-by-value `scalars` as the "scalars" attribute, then the `derived` slots (addresses inside
    another buffer: `attributes_of_steps`). None when the native path is unavailable or cuDNN cannot
    rebuild this graph from its bytes."""
    if unavailable() is not None:
        return None

    def make() -> NativePlan | None:
        blob, uid_of = serialized(cfg, direction, device)
        unbound = sorted(set(uid_of) - set(buffers) - set(scalars) - set(derived))
        if unbound:  # a bug of ours: the launch would fail on every call
            raise RuntimeError(f"fusedattn.jax: the {direction} graph binds {unbound}, which the call does not pass")
        uids = (*(core.buffer_slot(uid_of[n]) if n in uid_of else core.UNBOUND for n in buffers), core.WORKSPACE,
                *(core.value_slot(uid_of[n]) if n in uid_of else core.UNBOUND for n in scalars),
                *(core.buffer_slot(uid_of[n]) if n in uid_of else core.UNBOUND for n in derived))
        registered = core.register(blob, uids, device)
        if isinstance(registered, str):
            _warn(f"cuDNN could not rebuild the {direction} graph from its bytes ({registered})")
            return None
        digest, workspace = registered
        return NativePlan(workspace, {"plan": np.int64(digest), "blob": np.frombuffer(blob, np.uint8),
                                      "uids": np.asarray(uids, np.int64)})

    return _plans.get_or_build((cfg, direction, buffers, scalars, derived), make)


NO_STEPS = {"kernels_key": np.int64(0), "kernel_images": np.zeros((0,), np.uint8),
            "kernel_meta": np.zeros((0,), np.int64), "steps": np.zeros((0,), np.int64),
            "derived": np.zeros((0,), np.int64)}


def attributes_of_steps(steps, buffers: tuple[str, ...], derived: tuple[str, ...], device: int) -> dict:
    """The custom call's attributes for a pass's own kernels (jax/sequence_steps.SequenceSteps; None: none,
    NO_STEPS). buffers: the call's operands then results by name, the workspace last; derived: the graph
    slots bound inside the table, in the plan's order. The kernels are loaded on `device` now, so that no
    later launch (perhaps under capture) loads one."""
    if steps is None:
        return NO_STEPS
    from fusedattn.jax.sequence_steps import TABLE

    index = {name: i for i, name in enumerate(buffers)}
    images, meta = bytearray(), []
    for cubin, name, warps, shared in steps.kernels:
        meta += [len(images), len(cubin)]
        images += cubin
        meta += [len(images), len(name.encode())]
        images += name.encode()
        meta += [warps, shared]
    encoded = []
    for launch in steps.launches:
        encoded += [launch.phase, launch.kernel, launch.blocks, len(launch.words)]
        for word in launch.words:
            encoded += [index[word[0]], word[1]] if isinstance(word, tuple) else [-1, int(word)]
    attributes = {"kernels_key": np.int64(steps.key), "kernel_images": np.frombuffer(bytes(images), np.uint8),
                  "kernel_meta": np.asarray(meta, np.int64), "steps": np.asarray(encoded, np.int64),
                  "derived": np.asarray([x for name in derived for x in (index[TABLE], steps.table_slots[name])],
                                        np.int64)}
    _prepare_kernels(steps.key, attributes, device)
    return attributes


# (kernels key, device) -> True once the library holds that kernel set and has loaded it there
_prepared: LRUCache = register("jax.native.prepared_kernels", LRUCache(core.PLAN_CAPACITY))


def _prepare_kernels(key: int, attributes: dict, device: int) -> None:
    def load() -> bool:
        library = _state["library"]
        images, meta = attributes["kernel_images"], attributes["kernel_meta"]
        status = library.fusedattn_jax_prepare_kernels(
            ctypes.c_int64(key), images.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(images.size),
            meta.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(meta.size), ctypes.c_int32(device))
        if status != 0:
            raise RuntimeError(f"fusedattn.jax: the sequence kernels could not be loaded: "
                               f"{library.fusedattn_jax_last_error().decode()}")
        return True

    _prepared.get_or_build((key, device), load)


def rebuild_reason(cfg, device: int) -> str | None:
    """Why cuDNN cannot rebuild one of cfg's graphs (forward, and backward when training) from its
    serialized bytes, which is all a JAX custom call launches from; None when both rebuild (or the native
    path is off, which `unavailable` reports). Asked at selection, once per config and device, so such a
    call runs on the next backend and `explain` shows why, instead of failing when it is traced."""
    if unavailable() is not None:
        return None

    def check() -> str:
        for direction in ("forward", "backward") if cfg.is_training else ("forward",):
            blob, uid_of = serialized(cfg, direction, device)
            registered = core.register(blob, (*map(core.buffer_slot, uid_of.values()), core.WORKSPACE), device)
            if isinstance(registered, str):
                return (f"cuDNN could not rebuild the {direction} graph from its serialized bytes ({registered}); "
                        "a JAX call launches from those bytes alone")
        return ""

    return _rebuilds.get_or_build((cfg, device), check) or None


# (cfg, device) -> "" when both passes rebuild from their bytes, else why not
_rebuilds: LRUCache = register("jax.native.rebuilds", LRUCache(1024))


def serialized(cfg, direction: str, device: int) -> tuple[bytes, dict]:
    """cfg's built graph for the pass as cuDNN's serialized plan, and {graph tensor name: uid}."""
    from fusedattn.backends.cudnn.graph_cache import get_graph

    built = get_graph(cfg, direction, device)
    return bytes(built.graph.serialize(as_bytes=True)), {name: t.get_uid() for name, t in built.tensors.items()}


def _warn(message: str) -> None:
    import warnings

    warnings.warn(f"fusedattn.jax native cuDNN call: {message}", RuntimeWarning, stacklevel=3)


def _load() -> ctypes.CDLL:
    import jax

    core.library()
    library = ctypes.CDLL(str(build.library_path("jax")))
    library.fusedattn_jax_last_error.restype = ctypes.c_char_p
    library.fusedattn_jax_init.argtypes = [ctypes.c_char_p]
    if library.fusedattn_jax_init(str(core.path()).encode()) != 0:
        raise RuntimeError(library.fusedattn_jax_last_error().decode())
    graphable = os.environ.get(COMMAND_BUFFER_SWITCH, "1") != "0"
    handler = library.fusedattn_cudnn_execute_graphable if graphable else library.fusedattn_cudnn_execute
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="CUDA")
    return library
