"""The backend registry, in selection order: the first backend with no reasons wins."""

from __future__ import annotations

from fusedattn.backends.base import AttentionInputs, AttentionOutputs, Backend
from fusedattn.backends.cudnn import CudnnBackend
from fusedattn.backends.reference import ReferenceBackend
from fusedattn.backends.small_seq import SmallSeqBackend
from fusedattn.backends.triton import TritonBackend

__all__ = ["Backend", "AttentionInputs", "AttentionOutputs", "BACKENDS", "backend_names", "get_backend"]

# small_seq first: for its shapes it beats the general kernels; reference last: it runs anything.
BACKENDS: tuple[Backend, ...] = (SmallSeqBackend(), CudnnBackend(), TritonBackend(), ReferenceBackend())


def backend_names() -> tuple[str, ...]:
    return tuple(b.name for b in BACKENDS)


def get_backend(name: str) -> Backend:
    for backend in BACKENDS:
        if backend.name == name:
            return backend
    raise ValueError(f"backend: expected one of {', '.join(repr(n) for n in backend_names())}, got {name!r}")
