"""JAX frontend: `attention(...)`, differentiable with jax.grad, usable under jit and vmap."""

from fusedattn.frontend_common import AttentionResult
from fusedattn.jax.functional import attention

__all__ = ["attention", "AttentionResult"]
