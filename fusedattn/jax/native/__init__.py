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
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from fusedattn.cache import LRUCache, register

__all__ = ["TARGET", "WORKSPACE", "enabled", "unavailable", "plan_id"]

TARGET = "fusedattn_cudnn_execute"
ENV_SWITCH = "FUSEDATTN_JAX_NATIVE"
ENV_LIBRARY = "FUSEDATTN_NATIVE_LIB"
ENV_CACHE = "FUSEDATTN_CACHE_DIR"
SOURCE = Path(__file__).with_name("cudnn_call.cc")
UNBOUND, WORKSPACE = -1, -2  # cudnn_call.cc's uids for a buffer the graph skips, and for the workspace
LIBRARY_NAME = "libfusedattn_cudnn_call.so"

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


def _loaded_cudnn(maps_file: str = "/proc/self/maps") -> str:
    """The libcudnn this process already uses (the frontend loads it on import), so the library
    and the graphs Python builds share one cuDNN."""
    import cudnn  # noqa: F401  (loads libcudnn)

    try:
        maps = Path(maps_file).read_text().splitlines()
    except OSError:
        maps = []
    for line in maps:
        if line.rstrip().endswith("libcudnn.so.9"):
            return line.split(maxsplit=5)[-1].strip()
    return "libcudnn.so.9"


def _built_library() -> Path:
    """The compiled handler, built once per (source, headers' versions, compiler) and cached."""
    includes = _include_dirs()
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (set CXX)")
    # Hidden symbols and -Bsymbolic: the frontend's inline code must bind to this library's copy,
    # never to another frontend version already in the process (torch bundles one).
    command = [compiler, "-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
               "-Wl,-Bsymbolic", "-Wl,--exclude-libs,ALL", "-static-libstdc++", "-static-libgcc",
               "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING", *(f"-I{d}" for d in includes), str(SOURCE)]
    key = hashlib.sha256(SOURCE.read_bytes() + repr((command, _versions())).encode()).hexdigest()[:16]
    target = _cache_dir() / key / LIBRARY_NAME
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / LIBRARY_NAME
        result = subprocess.run([*command, "-o", str(built), "-ldl"], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent builder's copy is as good
    return target


def _cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]) / "native"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fusedattn" / "native"


def _versions() -> tuple:
    import cudnn
    import jax

    return cudnn.__version__, jax.__version__, sys.platform


def _include_dirs() -> list[str]:
    """Header folders: the cuDNN frontend's (its wheel ships them), cuDNN's, CUDA's (runtime, NVRTC,
    CCCL) and XLA's FFI (jax ships it). Environment overrides first."""
    import cudnn
    import jax

    frontend = _first_with("cudnn_frontend.h", [Path(cudnn.__file__).parent.parent / "include"])
    cudnn_dir = _first_with("cudnn.h", _env_dirs("CUDNN_INCLUDE_DIR") + _package_dirs("cudnn")
                            + [Path("/usr/include"), Path("/usr/local/cuda/include")])
    cuda_roots = [*_env_dirs("CUDA_HOME", "include"), *_env_dirs("CUDA_PATH", "include"),
                  Path("/usr/local/cuda/include"), *_package_dirs("cu13"), *_package_dirs("cuda_runtime"),
                  *_package_dirs("cuda_nvrtc")]
    cuda = _first_with("cuda_runtime_api.h", cuda_roots)
    nvrtc = _first_with("nvrtc.h", [cuda, *cuda_roots])
    dirs = [frontend, cudnn_dir, cuda, nvrtc, Path(jax.ffi.include_dir())]
    return list(dict.fromkeys(str(d) for d in dirs))


def _env_dirs(name: str, sub: str = "") -> list[Path]:
    value = os.environ.get(name)
    return [Path(value) / sub] if value else []


def _package_dirs(name: str) -> list[Path]:
    """include/ folders of NVIDIA's pip packages (nvidia/<name>/include) on sys.path."""
    return [Path(entry) / "nvidia" / name / "include" for entry in sys.path if entry]


def _first_with(header: str, dirs: list[Path]) -> Path:
    for folder in dirs:
        if (folder / header).is_file():
            return folder
    raise FileNotFoundError(f"{header} not found in {', '.join(str(d) for d in dirs[:6]) or 'any folder'}")
