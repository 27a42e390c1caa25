"""cuDNN frontend graphs. Declares its capabilities now; the graphs come in a later release."""

from fusedattn.backends.base import Backend


class CudnnBackend(Backend):
    name = "cudnn"
    frameworks = ("torch", "jax")
    devices = ("cuda",)
    dtypes = ("float16", "bfloat16")
    max_head_dim = 256
    head_dim_multiple = 8
    implemented = False
    packages = (("cudnn", "nvidia-cudnn-frontend"),)


__all__ = ["CudnnBackend"]
