"""cuDNN frontend graphs. Declares its capabilities now; the graphs come in a later release."""

from fusedattn.backends.base import Backend


class CudnnBackend(Backend):
    name = "cudnn"
    frameworks = ("torch", "jax")
    devices = ("cuda",)
    dtypes = ("float16", "bfloat16")
    max_head_dim = 256
    head_dim_multiple = 8
    packages = (("cudnn", "nvidia-cudnn-frontend"),)

    def _reasons(self, cfg):
        return ["cuDNN graphs are not implemented in this version of fusedattn"]


__all__ = ["CudnnBackend"]
