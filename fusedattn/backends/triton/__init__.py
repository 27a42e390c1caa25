"""Triton flash kernels. Declares its capabilities now; the kernels come in a later release."""

from fusedattn.backends.base import Backend


class TritonBackend(Backend):
    name = "triton"
    frameworks = ("torch",)
    devices = ("cuda",)
    dtypes = ("float16", "bfloat16")
    max_head_dim = 256
    implemented = False
    packages = (("triton", "triton"),)


__all__ = ["TritonBackend"]
