"""torch.nn modules over fusedattn.torch.attention."""

from __future__ import annotations

import torch
from torch import nn

from fusedattn.arguments import host_slopes
from fusedattn.checks import check_backend, check_count, check_probability, check_scale, check_window
from fusedattn.config import Layout, Mask, SoftmaxType
from fusedattn.options import check_keywords, describe_arguments, names
from fusedattn.torch.functional import attention

__all__ = ["DotProductAttention"]

# attention's keywords the module holds (its constructor's); every other one passes through a call.
_HELD = frozenset(("layout", "window", "softmax_type", "sink", "dropout_p", "scale", "deterministic", "backend"))
_CALL_KEYWORDS = names("torch") - _HELD


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
        check_count(num_heads, f"{name}: num_heads", optional=True)
        check_backend(backend, f"{name}: backend")
        self.layout = Layout.parse(layout, f"{name}: layout").value
        self.mask = Mask.parse(mask, f"{name}: mask").value
        self.window = check_window(window, f"{name}: window")
        self.softmax_type, self.scale = softmax.value, check_scale(scale, f"{name}: scale")
        self.dropout_p = check_probability(dropout_p, f"{name}: dropout_p")
        if not isinstance(deterministic, bool):  # ("no" would be true)
            raise ValueError(f"{name}: deterministic: expected a bool, got {deterministic!r}")
        self.deterministic, self.backend = deterministic, backend
        if softmax is SoftmaxType.LEARNABLE:
            if num_heads is None:
                raise ValueError(f"{name}: num_heads: expected an int >= 1 for softmax_type='learnable' "
                                 "(the module owns the (Hq,) sink logits), got None")
            self.sink = nn.Parameter(torch.zeros(num_heads, device=device, dtype=dtype or torch.float32))
        else:
            self.register_parameter("sink", None)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, **options):
        """Attention of q, k, v in the module's layout; `mask` overrides the module's for this call, the
        other keywords are `fusedattn.torch.attention`'s that the module does not hold.

        alibi_slopes may be a tensor, or a list, tuple or NumPy array (such as
        `fusedattn.standard_alibi_slopes(Hq)`), made a float32 tensor on q's device.
        """
        name = type(self).__name__
        held = [key for key in options if key in _HELD]
        if held:
            raise TypeError(f"{name}.forward: {held[0]} is the module's, set when it is constructed; a call may "
                            f"pass {', '.join(sorted(_CALL_KEYWORDS))}")
        check_keywords(f"{name}.forward", options, "torch")
        slopes = host_slopes(f"{name}: alibi_slopes", options.get("alibi_slopes"), getattr(q, "dtype", None))
        if slopes is not None:
            options["alibi_slopes"] = torch.as_tensor(slopes, device=q.device)
        if options.get("mask") is None:  # (only None means the module's: "" is a bad mask, said so by attention)
            options["mask"] = self.mask
        return attention(q, k, v, layout=self.layout, window=self.window, softmax_type=self.softmax_type,
                         sink=self.sink, dropout_p=self.dropout_p if self.training else 0.0, scale=self.scale,
                         deterministic=self.deterministic, backend=self.backend, **options)

    def extra_repr(self) -> str:
        return (f"layout={self.layout!r}, mask={self.mask!r}, window={self.window}, "
                f"softmax_type={self.softmax_type!r}, dropout_p={self.dropout_p}")


describe_arguments(DotProductAttention.forward, "torch", required=("self", "q"), exclude=tuple(_HELD),
                   overrides={"mask": None})  # None: the module's mask
