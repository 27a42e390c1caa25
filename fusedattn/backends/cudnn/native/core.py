"""The launch core as Python sees it: loaded once per process, shared by the torch operator and the
JAX custom call (both find its functions by the path this module loaded).

A plan is a serialized graph plus the uid each of the call's slots binds to (UNBOUND for a slot the
graph skips, WORKSPACE for JAX's workspace result); its id is the digest of both, so registering the
same graph from either framework finds one plan. The registry is bounded (PLAN_CAPACITY). A launch
whose pointers (and pass-by-value scalars) came before replays a CUDA graph captured from it instead
of running cuDNN's execute again (replay.h; REPLAY_SWITCH=0 turns that off).
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from pathlib import Path

from fusedattn.backends.cudnn.native import build

__all__ = ["UNBOUND", "WORKSPACE", "NOT_REGISTERED", "PLAN_CAPACITY", "library", "unavailable", "path", "digest",
           "register", "bounds", "replay_counts", "REPLAY_SWITCH", "value_slot", "buffer_slot"]

UNBOUND, WORKSPACE = -1, -2  # core_api.h's kUnbound and kWorkspace
NOT_REGISTERED = -2  # core_api.h's kNotRegistered: fusedattn_core_execute's status for a plan it does not hold
PLAN_CAPACITY = 4096  # plans the core keeps (least recently used go first)
REPLAY_SWITCH = "FUSEDATTN_NATIVE_REPLAY"  # read by the core (replay.h)
VALUE_SLOT, BUFFER_SLOT = 1 << 40, 1 << 44  # core_api.h's kValueSlot and kBufferSlot
REPLAY_ROUTES = ("executed", "captured", "replayed", "failed")  # fusedattn_core_replay_counts's order

_lock = threading.Lock()
_loaded: dict = {}  # "library" (ctypes.CDLL) and "path", once loaded; "reason" once it could not be


def library() -> ctypes.CDLL:
    """The core, built once per machine and loaded once per process with cuDNN set up (raises why not)."""
    with _lock:
        if "library" not in _loaded:
            core_path = build.library_path("core")
            core = ctypes.CDLL(str(core_path))
            core.fusedattn_core_register.restype = ctypes.c_int64
            core.fusedattn_core_register.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                     ctypes.c_int64, ctypes.c_int64]
            core.fusedattn_core_prepare.restype = ctypes.c_int64
            core.fusedattn_core_prepare.argtypes = [ctypes.c_int64, ctypes.c_int32]
            core.fusedattn_core_last_error.restype = ctypes.c_char_p
            core.fusedattn_core_init.argtypes = [ctypes.c_char_p]
            core.fusedattn_core_bounds.restype = ctypes.c_int64
            core.fusedattn_core_bounds.argtypes = [ctypes.c_int64]
            core.fusedattn_core_replay_counts.argtypes = [ctypes.c_void_p]
            core.fusedattn_core_execute.restype = ctypes.c_int
            core.fusedattn_core_execute.argtypes = [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_void_p,
                                                    ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
            if core.fusedattn_core_init(build.loaded_cudnn().encode()) != 0:
                raise RuntimeError(core.fusedattn_core_last_error().decode())
            core.fusedattn_core_bounds(PLAN_CAPACITY)
            _loaded.update(library=core, path=core_path)
        return _loaded["library"]


def unavailable() -> str | None:
    """Why the core cannot be used in this process (None: it can), trying to load (and build) it once."""
    if "library" in _loaded:
        return None
    if "reason" not in _loaded:
        try:
            library()
        except Exception as error:  # no compiler, headers or cuDNN: callers keep their Python launch
            _loaded["reason"] = f"the native launch core is unavailable: {type(error).__name__}: {error}"
    return _loaded.get("reason")


def path() -> Path:
    """The loaded core's file (the operator and the custom call open the same one)."""
    library()
    return _loaded["path"]


def value_slot(uid: int, nbytes: int = 4) -> int:
    """The registered uid of a slot that passes a pass-by-value scalar (a host pointer to `nbytes`
    bytes, which both frameworks keep 4 wide): a replayed launch is keyed by its value. A scalar slot
    left unmarked keeps its plan from replaying (the core cannot tell its pointer from a buffer's)."""
    return uid + VALUE_SLOT * nbytes


def buffer_slot(uid: int) -> int:
    """The registered uid of a slot that passes a device buffer. A plan replays only when each slot it
    reads is a buffer_slot or value_slot, or listed by the serialized graph (which omits a score_mod's
    own tensors)."""
    return uid + BUFFER_SLOT


def digest(blob: bytes, uids: tuple[int, ...]) -> int:
    """A plan's id: 63 bits of the SHA-256 of its bytes and uids (non-negative, as the core requires)."""
    return int.from_bytes(hashlib.sha256(blob + repr(tuple(uids)).encode()).digest()[:8], "little") >> 1


def register(blob: bytes, uids: tuple[int, ...], device: int) -> tuple[int, int] | str:
    """Registers a plan and deserializes it on `device`: (its id, workspace bytes there), or the reason
    cuDNN could not rebuild the graph from its bytes."""
    core = library()
    plan_id = digest(blob, uids)
    data = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
    registered = core.fusedattn_core_register(data, len(blob), (ctypes.c_int64 * len(uids))(*uids), len(uids),
                                              plan_id)
    workspace = core.fusedattn_core_prepare(plan_id, device) if registered == plan_id else -1
    if workspace < 0:
        return core.fusedattn_core_last_error().decode()
    return plan_id, workspace


def bounds(capacity: int = 0) -> int:
    """Sets the registry's bound (when capacity > 0); the number of plans held."""
    return library().fusedattn_core_bounds(capacity)


def replay_counts() -> dict[str, int]:
    """Launches so far by route (REPLAY_ROUTES): through cuDNN's execute, captured into a CUDA graph,
    replayed from one, and captures that failed."""
    counts = (ctypes.c_int64 * len(REPLAY_ROUTES))()
    library().fusedattn_core_replay_counts(counts)
    return dict(zip(REPLAY_ROUTES, counts))
