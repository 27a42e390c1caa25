"""PyTorch frontend: `attention(...)` and the `DotProductAttention` module."""

from fusedattn.frontend_common import AttentionResult
from fusedattn.torch.functional import attention, small_seq_attention
from fusedattn.torch.modules import DotProductAttention

__all__ = ["attention", "small_seq_attention", "DotProductAttention", "AttentionResult"]
