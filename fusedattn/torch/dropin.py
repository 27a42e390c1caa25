"""`scaled_dot_product_attention`: PyTorch's signature and semantics, on fusedattn's backends.

A thin translation into `fusedattn.torch.attention`: (..., L, E) tensors become the bhsd layout,
`is_causal` the top-left causal mask, and `attn_mask` a post-scale bias (a boolean mask as 0 where
True and -inf where False, as PyTorch does). A mask that is really causal, key padding or a sliding
window (fusedattn/mask_patterns.py) runs as that mask instead, which is much faster: it is read once
per mask tensor (and version) to be sure, and never while compiling or capturing a CUDA graph.
Assign it over torch.nn.functional's in a model:

    >>> import torch.nn.functional as F
    >>> import fusedattn.torch
    >>> F.scaled_dot_product_attention = fusedattn.torch.scaled_dot_product_attention
"""

from __future__ import annotations

import math
import numbers
import weakref

import torch

from fusedattn.cache import LRUCache, register
from fusedattn.checks import number_from_array
from fusedattn.mask_patterns import classify
from fusedattn.torch.functional import attention

__all__ = ["scaled_dot_product_attention"]

API = "fusedattn.torch.scaled_dot_product_attention"


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention, run by fusedattn.

    Args:
        query: (..., Hq, L, E). key: (..., Hkv, S, E). value: (..., Hkv, S, Ev). Leading (batch)
            dimensions broadcast against each other, as in PyTorch: a 3-D tensor is (H, L, E), a 2-D one
            (L, E), and one query head meets every key head. E=0 weighs the keys alike (the mask's
            terms aside); Ev=0 gives an empty output.
        attn_mask: boolean (True: take part) or a float tensor added to the scaled scores (cast to
            query's dtype, as nn.MultiheadAttention's float32 padding masks need under autocast),
            broadcastable to (..., Hq, L, S). A row whose every key is masked gives 0.
        dropout_p: dropout on the attention weights (seeded from torch's generator); 1.0 drops them all
            (output and gradients 0), as in PyTorch.
        is_causal: top-left causal mask (query i sees keys j <= i); with attn_mask, both apply (a key
            takes part where the mask lets it and it is not in the future), as PyTorch 2.13's CPU
            kernel computes them (its math kernel raises).
        scale: multiplies q kᵀ; default 1/sqrt(E). A number, or a 0-d tensor (read once per call: a
            host read). Zero or negative scales raise (PyTorch's CPU math gives NaN rows for them under
            is_causal).
        enable_gqa: allow Hkv < Hq with Hq a multiple of Hkv (grouped-query attention).

    Under autocast, float32 query, key and value are cast to autocast's dtype, as PyTorch's SDPA is.

    Returns:
        (..., Hq, L, Ev), in query's dtype (autocast's under autocast).
    """
    scale = number_from_array(scale, f"{API}: scale")  # (a 0-d tensor, as PyTorch takes it)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{API}: {name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"{API}: {name}: expected at least 2 dimensions (..., L, E), got shape {tuple(x.shape)}")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):  # ("False" would be true)
            raise ValueError(f"{API}: {name}: expected a bool, got {flag!r}")
    if torch.is_autocast_enabled(query.device.type):  # SDPA is on autocast's lower-precision list
        low = torch.get_autocast_dtype(query.device.type)
        query, key, value = (x.to(low) if x.dtype == torch.float32 else x for x in (query, key, value))
    # Fewer than 4 dimensions: the missing leading ones are 1, as PyTorch broadcasts them (a 3-D tensor is
    # (H, L, E): its heads group under enable_gqa).
    dims = max(x.dim() for x in (query, key, value))
    q, k, v = (x.reshape((1,) * (4 - x.dim()) + tuple(x.shape)) if x.dim() < 4 else x for x in (query, key, value))
    heads_q, heads_kv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != heads_kv:
        raise ValueError(f"{API}: value: expected {heads_kv} heads like key, got {v.shape[-3]}")
    if heads_q == 1 and heads_kv > 1 and not enable_gqa:  # one query head broadcast to the keys' heads
        q, heads_q = q.expand(*q.shape[:-3], heads_kv, *q.shape[-2:]), heads_kv
    if heads_q != heads_kv and not (heads_kv == 1 or (enable_gqa and heads_q % heads_kv == 0)):
        hint = ("; pass enable_gqa=True for grouped-query attention" if not enable_gqa and heads_q % heads_kv == 0
                else "")
        raise ValueError(f"{API}: key/value: expected {heads_q} heads like query"
                         f"{' or a divisor of it' if enable_gqa else ''}, got {heads_kv}{hint}")
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError:
        raise ValueError(f"{API}: query/key/value: batch dimensions {tuple(q.shape[:-3])}, {tuple(k.shape[:-3])} "
                         f"and {tuple(v.shape[:-3])} do not broadcast") from None
    batch = math.prod(lead)
    q, k, v = (x.expand(*lead, *x.shape[-3:]).reshape(batch, *x.shape[-3:]) for x in (q, k, v))
    mask = None if attn_mask is None else _folded(attn_mask, query, lead, (heads_q, q.shape[-2], k.shape[-2]))
    if batch == 0 or heads_q == 0 or q.shape[-2] == 0 or v.shape[-1] == 0:  # nothing to compute: empty
        if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise ValueError(f"{API}: key/value: expected key of query's head dim E={q.shape[-1]} and value of "
                             f"key's length, got key {tuple(key.shape)}, value {tuple(value.shape)}")
        out = _empty_output(q, k, v)
    else:
        if q.shape[-1] == 0 and k.shape[-1] == 0:  # E=0: every score is 0 (then the mask's), as in PyTorch
            q, k = (torch.nn.functional.pad(x, (0, 1)) for x in (q, k))
            scale = 1.0 if scale is None else scale
        drop_all = isinstance(dropout_p, numbers.Real) and dropout_p == 1  # PyTorch drops every weight
        out = attention(q, k, v, layout="bhsd", dropout_p=0.0 if drop_all else dropout_p, scale=scale,
                        **_mask_options(attn_mask, mask, is_causal, query, batch, q.shape[-2], k.shape[-2]))
        if drop_all:  # zeros, and zero gradients, as PyTorch gives
            out = out * 0
    out = out.reshape(*lead, *out.shape[1:])
    return out.reshape(out.shape[4 - dims:]) if dims < 4 else out


def _mask_options(given, mask, is_causal: bool, query, batch: int, seqlen_q: int, seqlen_kv: int) -> dict:
    """attention's mask options: is_causal's top-left mask, and attn_mask (folded: `mask`) as a native
    mask where it is one, else as a bias; with both, both apply."""
    if mask is None:
        return {"mask": "causal" if is_causal else "none"}
    if not is_causal and seqlen_kv > 0:  # (no keys: nothing to recognize)
        options = _recognized(given, mask, batch, seqlen_q, seqlen_kv, query.device)
        if options is not None:
            return options
    return {"mask": "causal" if is_causal else "none", "bias": _as_bias(mask, query)}


def _empty_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The (batch, Hq, L, Ev) output of a call with no batch, heads or queries: empty, on autograd's graph
    of q, k and v (their gradients come back empty, as SDPA's do)."""
    groups = q.shape[1] // max(k.shape[1], 1)
    if groups == 0:  # no query heads: none of the keys' heads is read
        k, v = k[:, :0], v[:, :0]
    k, v = (x.repeat_interleave(groups, 1) if groups > 1 else x.expand(-1, q.shape[1], -1, -1) for x in (k, v))
    return torch.matmul(torch.matmul(q, k.transpose(-2, -1)), v)


def _folded(mask: torch.Tensor, query: torch.Tensor, lead: tuple, sizes: tuple) -> torch.Tensor:
    """attn_mask checked and viewed as (batch|1, Hq|1, L|1, S|1), its batch dimensions folded into one."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"{API}: attn_mask: expected a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype not in (torch.bool, torch.float32, query.dtype):  # PyTorch's rule
        raise ValueError(f"{API}: attn_mask: expected a bool tensor, a float32 one or one of query's dtype "
                         f"{query.dtype}, got {mask.dtype}")
    full = (*lead, *sizes)
    try:
        fits = torch.broadcast_shapes(mask.shape, full) == full  # (a mask may not widen the output)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{API}: attn_mask: expected a shape broadcastable to the scores' {full}, got "
                         f"{tuple(mask.shape)}")
    mask = mask.reshape((1,) * (len(full) - mask.dim()) + tuple(mask.shape))
    if len(lead) != 1:  # fold the batch dimensions into one, as the tensors were
        mask = mask.expand(*lead, *mask.shape[-3:]).reshape(math.prod(lead), *mask.shape[-3:])
    return mask


def _as_bias(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """A folded attn_mask as an additive bias in query's dtype (a boolean one: 0 where True, -inf elsewhere)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(query.dtype)  # a cast keeps a learnable mask's gradient


# Recognised masks, by tensor: (a weak reference to the mask, attention's options for it). The key holds
# the tensor's id and version, so an in-place change or another tensor at the same id is read again.
_patterns: LRUCache = register("torch.dropin.mask_patterns", LRUCache(16))


def _recognized(given: torch.Tensor, mask: torch.Tensor, batch: int, seqlen_q: int, seqlen_kv: int, device
                ) -> dict | None:
    """attention's options for a mask that is a native mask, or None (run it as a bias). given: the
    caller's attn_mask (what is remembered), mask: it folded (what is read)."""
    if (mask.requires_grad or mask.shape[1] != 1 or mask.shape[3] != seqlen_kv or torch.compiler.is_compiling()
            or (mask.is_cuda and torch.cuda.is_current_stream_capturing())):
        return None
    key = (id(given), given._version, tuple(given.shape), given.stride(), given.dtype, given.device, batch, seqlen_q,
           seqlen_kv)
    held = _patterns.get(key)
    if held is not None and held[0]() is given:
        return held[1]
    options = _read_pattern(mask, batch, seqlen_q, seqlen_kv, device)
    _patterns.put(key, (weakref.ref(given), options))
    return options


def _read_pattern(mask: torch.Tensor, batch: int, seqlen_q: int, seqlen_kv: int, device) -> dict | None:
    """Reduce the mask to (keys taken, first taken, runs) per row on its device, read them once, classify."""
    rows = mask.reshape(mask.shape[0], mask.shape[2], seqlen_kv)
    binary = torch.ones((), dtype=torch.bool, device=mask.device)
    if rows.dtype != torch.bool:  # a float mask is a boolean one only if it holds just 0 and -inf
        binary = ((rows == 0) | (rows == float("-inf"))).all()
        rows = rows == 0
    count = rows.sum(-1)
    first = rows.to(torch.uint8).argmax(-1)  # the first maximum: the first key taken
    runs = (rows[..., 1:] & ~rows[..., :-1]).sum(-1) + rows[..., 0]
    stats = torch.cat([torch.stack([count, first, runs]).flatten(), binary.reshape(1).long()]).cpu().numpy()
    if not stats[-1]:
        return None
    count, first, runs = stats[:-1].reshape(3, *rows.shape[:2])
    pattern = classify(count, first, runs, seqlen_q, seqlen_kv, batch)
    if pattern is None:
        return None
    options = {"mask": pattern.mask, "window": pattern.window}
    if pattern.kv_lengths is not None:  # the lengths travel as offsets; both max lengths given: never read again
        ends = torch.tensor(pattern.kv_lengths, dtype=torch.int32).cumsum(0)
        options.update(
            cu_seqlens_q=torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32).to(device),
            cu_seqlens_kv=torch.cat([ends.new_zeros(1), ends]).to(device),
            max_seqlen_q=seqlen_q, max_seqlen_kv=seqlen_kv)
    return options
