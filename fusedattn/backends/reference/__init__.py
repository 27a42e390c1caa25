"""The reference backend: unfused math, every feature, any device. The ground truth."""

from fusedattn.backends.reference.backend import ReferenceBackend

__all__ = ["ReferenceBackend"]
