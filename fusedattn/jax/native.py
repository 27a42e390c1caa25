"""cuDNN graphs as native XLA custom calls: the JAX bridge's fastest path.

A buffer callback costs a Python call, the GIL and a context object on every launch (about
10 us, as much as an S=1024 attention kernel). The custom call (backends/cudnn/native/jax_call.cc)
hands XLA's buffers to the launch core the torch operator uses too, so a launch is a map of
pointers and one cuDNN execute. Each call carries its graph's bytes, uids and digest as attributes:
the core's bounded registry may evict a plan, and a program (or one compiled in another process)
then registers its own bytes again. The libraries are compiled from source on first use (a C++17
compiler and the headers the installed packages ship) and cached; when that is not possible
`unavailable()` says why and the bridge keeps its callbacks. FUSEDATTN_JAX_NATIVE=0 turns the path
off.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import NamedTuple

import numpy as np

from fusedattn.backends.cudnn.native import build, core
from fusedattn.cache import LRUCache, register

__all__ = ["TARGET", "ENV_SWITCH", "NativePlan", "enabled", "unavailable", "plan_id"]

TARGET = "fusedattn_cudnn_execute"
ENV_SWITCH = "FUSEDATTN_JAX_NATIVE"

_lock = threading.Lock()
_state: dict = {}  # "library" (ctypes.CDLL) or "reason" (str), once decided
# (cfg, direction, buffers) -> NativePlan, or None (cuDNN could not rebuild the graph from its bytes)
_plans: LRUCache = register("jax.native.plans", LRUCache(core.PLAN_CAPACITY // 2))


class NativePlan(NamedTuple):
    """What a custom call needs: its workspace result's bytes and its attributes."""
    workspace: int
    attributes: dict  # plan (the digest), blob (uint8 array), uids (int64 array)


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


def plan_id(runner, direction: str, device: int, buffers: int) -> NativePlan | None:
    """The custom call for `runner`'s pass on `device`, registered with the core (and deserialized
    there) once. The call passes `buffers` operands and results, then a uint8 workspace result of
    the plan's bytes (at least 1). None when the native path is unavailable or cuDNN cannot rebuild
    this graph from its bytes."""
    if unavailable() is not None:
        return None

    def make() -> NativePlan | None:
        blob, uids = runner.serialized(direction, device)
        uids = tuple(uids) + (core.UNBOUND,) * (buffers - len(uids)) + (core.WORKSPACE,)
        registered = core.register(blob, uids, device)
        if isinstance(registered, str):
            _warn(f"cuDNN could not rebuild the {direction} graph from its bytes ({registered}); this call "
                  "keeps the Python callback")
            return None
        digest, workspace = registered
        return NativePlan(workspace, {"plan": np.int64(digest), "blob": np.frombuffer(blob, np.uint8),
                                      "uids": np.asarray(uids, np.int64)})

    return _plans.get_or_build((runner.cfg, direction, buffers), make)


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
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.fusedattn_cudnn_execute), platform="CUDA")
    return library
