"""PyTorch frontend: `attention(...)`, the SDPA drop-in `scaled_dot_product_attention` and the
`DotProductAttention` module."""

from fusedattn.frontend_common import AttentionResult
from fusedattn.torch.dropin import scaled_dot_product_attention
from fusedattn.torch.flex_dropin import flex_attention
from fusedattn.torch.functional import attention, explain, small_seq_attention
from fusedattn.torch.modules import DotProductAttention

__all__ = ["attention", "explain", "scaled_dot_product_attention", "flex_attention", "small_seq_attention",
           "DotProductAttention", "AttentionResult"]
