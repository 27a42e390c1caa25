"""Triton flash kernels. Declares its capabilities now; the kernels come in a later release."""

from fusedattn.backends.base import Backend


class TritonBackend(Backend):
    name = "triton"
    frameworks = ("torch",)
    devices = ("cuda",)
    dtypes = ("float16", "bfloat16")
    max_head_dim = 256
    packages = (("triton", "triton"),)

    def _reasons(self, cfg):
        return ["Triton flash kernels are not implemented in this version of fusedattn"]


__all__ = ["TritonBackend"]
