"""JAX frontend: `attention(...)`, differentiable with jax.grad, usable under jit and vmap."""

from fusedattn.frontend_common import AttentionResult
from fusedattn.jax.functional import attention, small_seq_attention

__all__ = ["attention", "small_seq_attention", "AttentionResult"]
