"""cuDNN graphs as native XLA custom calls: the JAX bridge's fastest path.

A buffer callback costs a Python call, the GIL and a context object on every launch (about
10 us, as much as an S=1024 attention kernel). `cudnn_call.cc` is an XLA FFI handler that
runs a graph Python built and serialized, so a launch is a map of pointers and one cuDNN
execute. The library is compiled from source on first use (a C++17 compiler and the cuDNN,
CUDA and cuDNN-frontend headers, all found beside the installed packages) and cached; when
that is not possible `unavailable()` says why and the bridge keeps its callbacks.
FUSEDATTN_JAX_NATIVE=0 turns the path off; FUSEDATTN_NATIVE_LIB names a prebuilt library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
from pathlib import Path

from fusedattn.backends.cudnn.native import build
from fusedattn.cache import LRUCache, register

__all__ = ["TARGET", "WORKSPACE", "enabled", "unavailable", "plan_id"]

TARGET = "fusedattn_cudnn_execute"
ENV_SWITCH = "FUSEDATTN_JAX_NATIVE"
ENV_LIBRARY = "FUSEDATTN_NATIVE_LIB"
ENV_CACHE = build.ENV_CACHE
UNBOUND, WORKSPACE = -1, -2  # cudnn_call.cc's uids for a buffer the graph skips, and for the workspace

_lock = threading.Lock()
_state: dict = {}  # "library" (ctypes.CDLL) or "reason" (str), once decided
# (cfg, direction, buffers) -> (plan id, workspace bytes, digest)
_plans: LRUCache = register("jax.native.plans", LRUCache(4096))


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def unavailable() -> str | None:
    """Why the native path cannot run here (None: it can). Loads the library on first call."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    with _lock:
        if not _state:
            try:
                _state["library"] = _load()
            except Exception as error:  # no compiler, headers, cuDNN or GPU jax: keep the callbacks
                _state["reason"] = f"{type(error).__name__}: {error}"
    return _state.get("reason")


def plan_id(runner, direction: str, device: int, buffers: int) -> tuple[int, int, int] | None:
    """(the library's id, workspace bytes, digest) for `runner`'s pass on `device`, registered (and
    deserialized there) once. The call passes `buffers` operands and results, then a uint8
    workspace result of that many bytes (at least 1), and names the plan by id and digest (the
    handler refuses a program whose digest is not its plan's: one compiled in another process).
    None when the native path is unavailable or cuDNN cannot rebuild this graph from its bytes."""
    if unavailable() is not None:
        return None

    def register() -> tuple[int, int, int] | None:
        blob, uids = runner.serialized(direction, device)
        uids = uids + (UNBOUND,) * (buffers - len(uids)) + (WORKSPACE,)
        digest = int.from_bytes(hashlib.sha256(blob + repr(uids).encode()).digest()[:8], "little", signed=True)
        library = _state["library"]
        data = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        pid = library.fusedattn_register(data, len(blob), (ctypes.c_int64 * len(uids))(*uids), len(uids), digest)
        workspace = library.fusedattn_prepare(pid, device)
        if workspace < 0:
            _warn(f"cuDNN could not rebuild the {direction} graph from its bytes "
                  f"({library.fusedattn_last_error().decode()}); this call keeps the Python callback")
            return None
        return pid, workspace, digest

    return _plans.get_or_build((runner.cfg, direction, buffers), register)


def _warn(message: str) -> None:
    import warnings

    warnings.warn(f"fusedattn.jax native cuDNN call: {message}", RuntimeWarning, stacklevel=3)


def _load() -> ctypes.CDLL:
    import jax

    path = Path(os.environ[ENV_LIBRARY]) if os.environ.get(ENV_LIBRARY) else _built_library()
    library = ctypes.CDLL(str(path))
    library.fusedattn_register.restype = ctypes.c_int64
    library.fusedattn_register.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int64]
    library.fusedattn_prepare.restype = ctypes.c_int64
    library.fusedattn_prepare.argtypes = [ctypes.c_int64, ctypes.c_int32]
    library.fusedattn_last_error.restype = ctypes.c_char_p
    library.fusedattn_init.argtypes = [ctypes.c_char_p]
    if library.fusedattn_init(_loaded_cudnn().encode()) != 0:
        raise RuntimeError(library.fusedattn_last_error().decode())
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.fusedattn_cudnn_execute), platform="CUDA")
    return library


def _built_library() -> Path:
    """The compiled handler (the shared builder: cached per source, command and versions; a line says
    when it compiles)."""
    return build.library_path("jax")


# The header search, the cache folder and the loaded cuDNN are the shared builder's.
_loaded_cudnn = build.loaded_cudnn
_cache_dir = build.cache_dir
_first_with = build._first_with
