"""Compiling the native launch libraries from source, once per machine, and finding them again.

Each library is one C++ file compiled with the system C++ compiler against headers the installed
packages ship. "core" (launch_core.cc) is the launch core: the only code that includes the cuDNN
frontend (its wheel's headers, cuDNN's and CUDA's from NVIDIA's wheels or a CUDA toolkit), built with
hidden symbols and its own libstdc++ so no other frontend copy in the process can bind to it.
"torch" (torch_op.cc) is the operator over it, built against torch's headers alone; "jax" (jax_call.cc)
is the XLA FFI handler over it, built against XLA's FFI headers (jaxlib ships them) alone. Each result
is cached under ~/.cache/fusedattn/native, keyed by the source, the command and the packages'
versions, so a new version of anything rebuilds. FUSEDATTN_CACHE_DIR moves the cache;
FUSEDATTN_NATIVE_LIB_<KIND> (CORE, TORCH, JAX) names a prebuilt one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

__all__ = ["KINDS", "library_path", "built_path", "build", "include_dirs", "cache_dir", "loaded_cudnn"]

HERE = Path(__file__).resolve().parent
# Included by the libraries: part of their cache keys.
HEADERS = (HERE / "bounded.h", HERE / "core_api.h", HERE / "replay.h", HERE / "triton_launch.h",
           HERE / "warm_entries.h")
KINDS = ("core", "torch", "jax")
SOURCES = {"core": HERE / "launch_core.cc", "torch": HERE / "torch_op.cc", "jax": HERE / "jax_call.cc"}
NAMES = {"core": "libfusedattn_core.so", "torch": "libfusedattn_torch.so", "jax": "libfusedattn_cudnn_call.so"}
ENV_CACHE = "FUSEDATTN_CACHE_DIR"


def env_library(kind: str) -> str:
    return f"FUSEDATTN_NATIVE_LIB_{kind.upper()}"


def cache_dir() -> Path:
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]) / "native"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "fusedattn" / "native"


def _command(kind: str) -> list[str]:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (install g++, or set CXX)")
    flags = ["-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden"]
    extra: list[str] = ["-ldl"]
    if kind == "torch":
        import torch

        flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}")
        lib = Path(torch.__file__).parent / "lib"
        extra += [f"-L{lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{lib}"]
        if python_headers() is not None:  # the Python entry (torch_op.cc), where Python's headers exist
            flags.append("-DFUSEDATTN_PYTHON_ENTRY")
            extra.append("-ltorch_python")
    else:
        # Hidden symbols, -Bsymbolic and a static libstdc++: the frontend's inline code must bind to this
        # library's copy, never to another frontend version already in the process (torch bundles one).
        flags += ["-Wl,-Bsymbolic", "-Wl,--exclude-libs,ALL", "-static-libstdc++", "-static-libgcc"]
    if kind == "core":
        flags.append("-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING")
    return [compiler, *flags, *(f"-I{d}" for d in include_dirs(kind)), str(SOURCES[kind]), *extra]


def _frontend():
    """The cuDNN frontend's Python package (its wheel ships the headers the core needs)."""
    try:
        import cudnn
    except ImportError as error:
        raise RuntimeError(f"package nvidia-cudnn-frontend not installed (import cudnn: {error})") from None
    return cudnn


def _versions(kind: str) -> tuple:
    if kind == "torch":
        import torch

        return kind, torch.__version__, sys.platform
    if kind == "jax":
        import jax

        return kind, jax.__version__, sys.platform
    return kind, _frontend().__version__, sys.platform


def built_path(kind: str) -> Path:
    """Where the library for this machine's packages is (or would be) cached."""
    command = _command(kind)
    sources = SOURCES[kind].read_bytes() + b"".join(header.read_bytes() for header in HEADERS)
    digest = hashlib.sha256(sources + repr((command, _versions(kind))).encode()).hexdigest()[:16]
    return cache_dir() / digest / NAMES[kind]


def library_path(kind: str, announce=None) -> Path:
    """The library to load: the environment's prebuilt one, the cached build, or a new build."""
    if os.environ.get(env_library(kind)):
        return Path(os.environ[env_library(kind)])
    target = built_path(kind)
    if not target.exists():
        build(kind, announce)
    return target


def build(kind: str, announce=None) -> tuple[Path, float]:
    """Compile the library now (whatever the cache holds); (path, seconds). `announce(text)` hears
    one line before and one after (default: stderr), so a first call never sits silent."""
    say = announce or (lambda text: print(text, file=sys.stderr, flush=True))
    target = built_path(kind)
    target.parent.mkdir(parents=True, exist_ok=True)
    say(f"fusedattn: compiling the native cuDNN launch library for {kind} (once per machine and version; "
        f"cached in {target.parent})...")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / NAMES[kind]
        result = subprocess.run([*_command(kind), "-o", str(built)], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"compiling {SOURCES[kind].name} failed: {result.stderr.strip()[-2000:]}")
        os.replace(built, target)  # atomic: a concurrent builder's copy is as good
    seconds = time.perf_counter() - start
    say(f"fusedattn: native library for {kind} built in {seconds:.1f} s: {target}")
    return target, seconds


def include_dirs(kind: str) -> list[str]:
    """Header folders. torch: torch's own. jax: XLA's FFI (jaxlib ships it). core: the cuDNN frontend's
    (its wheel ships them), cuDNN's and CUDA's (runtime, NVRTC, CCCL), environment first."""
    if kind == "torch":
        import torch

        root = Path(torch.__file__).parent / "include"
        python = python_headers()
        return [str(root), str(root / "torch" / "csrc" / "api" / "include"), str(HERE),
                *([] if python is None else [python])]
    if kind == "jax":
        import jax

        return [str(Path(jax.ffi.include_dir())), str(HERE)]
    cudnn = _frontend()

    frontend = _first_with("cudnn_frontend.h", [Path(cudnn.__file__).parent.parent / "include"])
    cudnn_dir = _first_with("cudnn.h", _env_dirs("CUDNN_INCLUDE_DIR") + _package_dirs("cudnn")
                            + [Path("/usr/include"), Path("/usr/local/cuda/include")])
    cuda_roots = [*_env_dirs("CUDA_HOME", "include"), *_env_dirs("CUDA_PATH", "include"),
                  Path("/usr/local/cuda/include"), *_package_dirs("cu13"), *_package_dirs("cuda_runtime"),
                  *_package_dirs("cuda_nvrtc"), *_package_dirs("cuda_nvcc"), *_package_dirs("cuda_cccl")]
    cuda = _first_with("cuda_runtime_api.h", cuda_roots)
    dirs = [frontend, cudnn_dir, cuda, _first_with("nvrtc.h", [cuda, *cuda_roots]), HERE]
    for header in ("crt/host_defines.h", "nv/target"):  # what cuda_runtime_api.h includes in turn
        dirs += [d for d in [cuda, *cuda_roots] if (d / header).exists()][:1]
    return list(dict.fromkeys(str(d) for d in dirs))


def python_headers() -> str | None:
    """This interpreter's C headers (Python.h), where installed: the torch library then also builds its
    Python entry. Many installs lack them (a -dev package); the operator works without."""
    folder = sysconfig.get_paths().get("include")
    return folder if folder and (Path(folder) / "Python.h").is_file() else None


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


def loaded_cudnn(maps_file: str = "/proc/self/maps") -> str:
    """The libcudnn this process already uses (the frontend loads it on import), so the library and
    the graphs Python builds share one cuDNN."""
    _frontend()  # loads libcudnn

    try:
        maps = Path(maps_file).read_text().splitlines()
    except OSError:
        maps = []
    for line in maps:
        if line.rstrip().endswith("libcudnn.so.9"):
            return line.split(maxsplit=5)[-1].strip()
    return "libcudnn.so.9"
