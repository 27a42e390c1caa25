"""fusedattn: fused scaled-dot-product attention for PyTorch and JAX.

`import fusedattn` imports neither torch nor JAX; use `fusedattn.torch` or
`fusedattn.jax` for the attention functions.
"""

from fusedattn.config import AttentionConfig, BiasType, Layout, Mask, SoftmaxType, standard_alibi_slopes
from fusedattn.selection import NoBackendError, Selection, explain, select_backend

__version__ = "0.1.0"

__all__ = [
    "AttentionConfig",
    "BiasType",
    "Layout",
    "Mask",
    "SoftmaxType",
    "NoBackendError",
    "Selection",
    "explain",
    "standard_alibi_slopes",
    "select_backend",
    "__version__",
]
