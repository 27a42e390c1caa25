"""torch.nn modules over fusedattn.torch.attention."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from fusedattn.arguments import host_slopes
from fusedattn.backends import backend_names
from fusedattn.config import Layout, Mask, SoftmaxType
from fusedattn.torch.functional import attention

__all__ = ["DotProductAttention"]


def _check_window(module: str, window) -> tuple[int, int] | None:
    """The window as a tuple, or ValueError naming the module's `window` argument."""
    if window is None:
        return None
    pair = tuple(window) if isinstance(window, (tuple, list)) else window
    if (not isinstance(pair, tuple) or len(pair) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in pair)):
        raise ValueError(f"{module}: window: expected (left, right), two integers >= -1 (-1 = unbounded), "
                         f"got {window!r}")
    return pair


def _check_choice(module: str, argument: str, value, choices) -> str:
    """A string option checked against its choices, or ValueError naming the module's argument."""
    return choices.parse(value, f"{module}: {argument}").value


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
        name = type(self).__name__
        softmax = SoftmaxType.parse(softmax_type, f"{name}: softmax_type")
        if num_heads is not None and (not isinstance(num_heads, int) or isinstance(num_heads, bool)
                                      or num_heads < 1):
            raise ValueError(f"{name}: num_heads: expected an int >= 1 (or None), got {num_heads!r}")
        if (isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float))
                or not 0.0 <= dropout_p < 1.0):
            raise ValueError(f"{name}: dropout_p: expected a float in [0, 1), got {dropout_p!r}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale) or scale <= 0):
            raise ValueError(f"{name}: scale: expected a finite float > 0 (or None for 1/sqrt(D)), got {scale!r}")
        if backend is not None and backend not in backend_names():
            raise ValueError(f"{name}: backend: expected None or one of {', '.join(backend_names())}, "
                             f"got {backend!r}")
        self.layout = _check_choice(name, "layout", layout, Layout)
        self.mask = _check_choice(name, "mask", mask, Mask)
        self.window = _check_window(name, window)
        self.softmax_type, self.dropout_p, self.scale = softmax.value, float(dropout_p), scale
        self.deterministic, self.backend = bool(deterministic), backend
        if softmax is SoftmaxType.LEARNABLE:
            if num_heads is None:
                raise ValueError(f"{name}: num_heads: expected an int >= 1 for softmax_type='learnable' "
                                 "(the module owns the (Hq,) sink logits), got None")
            self.sink = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype or torch.float32))
        else:
            self.register_parameter("sink", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, *,
                mask: str | None = None, bias: torch.Tensor | None = None, bias_type: str | None = None,
                alibi_slopes=None, cu_seqlens_q: torch.Tensor | None = None,
                cu_seqlens_kv: torch.Tensor | None = None, cu_seqlens_q_padded: torch.Tensor | None = None,
                cu_seqlens_kv_padded: torch.Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_kv: int | None = None, return_lse: bool = False, return_max_logit: bool = False,
                score_mod=None, score_mod_bprop: Callable | None = None, score_mod_tensors: dict | None = None,
                score_mod_bprop_tensors: dict | None = None):
        """Attention of q, k, v in the module's layout; `mask` overrides the module's for this call.

        alibi_slopes may be a tensor, or a list, tuple or NumPy array (such as
        `fusedattn.standard_alibi_slopes(Hq)`), made a float32 tensor on q's device.
        """
        slopes = host_slopes(f"{type(self).__name__}: alibi_slopes", alibi_slopes)
        if slopes is not None:
            alibi_slopes = torch.as_tensor(slopes, device=q.device)
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
