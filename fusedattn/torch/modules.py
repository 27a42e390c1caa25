"""torch.nn modules over fusedattn.torch.attention."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fusedattn.config import SoftmaxType
from fusedattn.torch.functional import attention

__all__ = ["DotProductAttention"]


class DotProductAttention(nn.Module):
    """Attention over given q, k, v, with the call's fixed choices held by the module.

    Args:
        num_heads: Hq; needed only for softmax_type='learnable' (the module owns the
            (Hq,) sink logits as a parameter, initialised to zero).
        layout, mask, window, softmax_type, scale, deterministic, backend: as in
            `fusedattn.torch.attention`.
        dropout_p: attention dropout, applied only in training mode; each call draws a
            fresh seed from torch's generator, so torch.manual_seed reproduces a run.

    Example:
        >>> attn = DotProductAttention(layout="bshd", mask="causal")
        >>> out = attn(q, k, v)
    """

    def __init__(self, num_heads: int | None = None, *, layout: str = "bshd", mask: str = "none",
                 window: tuple[int, int] | None = None, softmax_type: str = "vanilla",
                 dropout_p: float = 0.0, scale: float | None = None, deterministic: bool = False,
                 backend: str | None = None, device=None, dtype=None) -> None:
        super().__init__()
        softmax = SoftmaxType.parse(softmax_type, "DotProductAttention: softmax_type")
        if not 0.0 <= dropout_p < 1.0:
            raise ValueError(f"DotProductAttention: dropout_p: expected a float in [0, 1), got {dropout_p!r}")
        self.layout, self.mask, self.window = layout, mask, window
        self.softmax_type, self.dropout_p, self.scale = softmax.value, dropout_p, scale
        self.deterministic, self.backend = deterministic, backend
        if softmax is SoftmaxType.LEARNABLE:
            if not isinstance(num_heads, int) or num_heads < 1:
                raise ValueError("DotProductAttention: num_heads: expected an int >= 1 for "
                                 f"softmax_type='learnable', got {num_heads!r}")
            self.sink = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype or torch.float32))
        else:
            self.register_parameter("sink", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                mask: str | None = None, bias: torch.Tensor | None = None, bias_type: str | None = None,
                alibi_slopes: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                cu_seqlens_kv: torch.Tensor | None = None, cu_seqlens_q_padded: torch.Tensor | None = None,
                cu_seqlens_kv_padded: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_kv: int | None = None, return_lse: bool = False, return_max_logit: bool = False,
                score_mod=None, score_mod_bprop: Callable | None = None, score_mod_tensors: dict | None = None,
                score_mod_bprop_tensors: dict | None = None):
        """Attention of q, k, v in the module's layout; `mask` overrides the module's for this call."""
        return attention(
            q, k, v, layout=self.layout, mask=mask or self.mask, window=self.window, bias=bias,
            bias_type=bias_type, alibi_slopes=alibi_slopes, softmax_type=self.softmax_type, sink=self.sink,
            dropout_p=self.dropout_p if self.training else 0.0, scale=self.scale,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            deterministic=self.deterministic, return_lse=return_lse, return_max_logit=return_max_logit,
            backend=self.backend, score_mod=score_mod, score_mod_bprop=score_mod_bprop,
            score_mod_tensors=score_mod_tensors, score_mod_bprop_tensors=score_mod_bprop_tensors,
        )

    def extra_repr(self) -> str:
        return (f"layout={self.layout!r}, mask={self.mask!r}, window={self.window}, "
                f"softmax_type={self.softmax_type!r}, dropout_p={self.dropout_p}")
