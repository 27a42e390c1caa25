"""Shared pytest setup: tests marked `gpu` are skipped on machines without a CUDA device, and
on such machines Triton kernels run in Triton's interpreter (set before triton is imported)."""

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:  # not installed, or blocked (tests/gpu/block_torch.py): ask JAX
        return _jax_has_gpu()
    return torch.cuda.is_available()


def _jax_has_gpu() -> bool:
    try:
        import jax
    except ImportError:
        return False
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


# JAX and torch share the GPU in one process (tests/gpu/test_jax.py): XLA allocates as it goes,
# up to half of the memory, instead of taking 75% when it starts; with pytest-xdist's workers on one
# GPU (make gpu-test), each worker's JAX gets its share of that half. Set before anything imports jax.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION",
                      f"{0.5 / max(1, int(os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1'))):.3f}")

if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (neither torch nor JAX sees one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def x64():
    """JAX in float64 for one test (the setting is restored afterwards)."""
    jax = pytest.importorskip("jax")
    with jax.enable_x64(True):
        yield


@pytest.fixture
def triton_interpreter():
    """Skips a test of Triton kernels unless they run in Triton's interpreter (a CPU machine); tests/gpu
    runs the same kernels on the GPU."""
    import torch

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in Triton's interpreter on CPU machines (tests/gpu runs them on the GPU)")


@pytest.fixture
def fresh_selection(monkeypatch):
    """Selection as a fresh process makes it: no backend forced and no log from the environment,
    decisions made before and during the test forgotten."""
    from fusedattn.selection import clear_decisions

    monkeypatch.delenv("FUSEDATTN_BACKEND", raising=False)
    monkeypatch.delenv("FUSEDATTN_LOG", raising=False)
    clear_decisions()
    yield
    clear_decisions()


@pytest.fixture
def ran(monkeypatch):
    """Records (backend name, "forward"/"backward", cfg) for every backend call: which backend ran."""
    from fusedattn.backends import BACKENDS

    calls = []
    for backend in BACKENDS:
        for phase in ("forward", "backward"):
            original = getattr(backend, phase)

            def spy(cfg, *args, _original=original, _name=backend.name, _phase=phase, **kwargs):
                calls.append((_name, _phase, cfg))
                return _original(cfg, *args, **kwargs)

            monkeypatch.setattr(backend, phase, spy)
    _spy_native_calls(monkeypatch, calls)
    return calls


def _spy_native_calls(monkeypatch, calls):
    """Calls the native torch operator runs (cuDNN without backend.forward/backward in Python) count as
    cudnn's: its forward when called, its backward when a gradient reaches the output."""
    try:
        from fusedattn.torch import functional
    except ImportError:
        return
    original = functional._native_call

    def spy(plan, signature, planned, *args, **kwargs):
        cfg = planned[0]
        calls.append(("cudnn", "forward", cfg))
        result = original(plan, signature, planned, *args, **kwargs)
        out = result[0] if isinstance(result, tuple) else result
        if out.requires_grad:
            out.register_hook(lambda grad: calls.append(("cudnn", "backward", cfg)))
        return result

    monkeypatch.setattr(functional, "_native_call", spy)


@pytest.fixture(scope="session")
def native_torch_build(tmp_path_factory):
    """(path, build messages) of the native torch library built into a fresh cache, once per process: one
    library path per process, as torch registers its operator namespace once."""
    from fusedattn.backends.cudnn.native import build

    cache = tmp_path_factory.mktemp("native-cache")
    before = os.environ.get(build.ENV_CACHE)
    os.environ[build.ENV_CACHE] = str(cache)
    try:
        messages: list = []
        path = build.library_path("torch", announce=messages.append)
        assert build.library_path("torch", announce=messages.append) == path and len(messages) == 2  # cached
    finally:
        if before is None:
            os.environ.pop(build.ENV_CACHE)
        else:
            os.environ[build.ENV_CACHE] = before
    return path, tuple(messages)
