"""JAX frontend: `attention(...)`, differentiable with jax.grad, usable under jit and vmap."""

from fusedattn.frontend_common import AttentionResult
from fusedattn.jax.dropin import dot_product_attention
from fusedattn.jax.functional import attention, small_seq_attention

__all__ = ["attention", "small_seq_attention", "dot_product_attention", "AttentionResult", "DotProductAttention",
           "MultiHeadAttention", "TransformerLayer"]

_MODULES = ("DotProductAttention", "MultiHeadAttention", "TransformerLayer")


def __getattr__(name: str):
    # The Flax modules import flax: only when asked for.
    if name in _MODULES:
        from fusedattn.jax import modules

        return getattr(modules, name)
    raise AttributeError(f"module 'fusedattn.jax' has no attribute {name!r}")
