"""`flex_attention`: FlexAttention's signature and meanings, on fusedattn's backends.

A thin translation into `fusedattn.torch.attention` with layout "bhsd": the score_mod is the
user's own function (traced and fused, its derivative derived: see fusedattn/score_mods/flex.py),
and a BlockMask contributes its mask_mod (its block sparsity is FlexAttention's way to skip
work; cuDNN's own masks skip it here), and its block table too where that table says more than
the mask_mod (torch/block_masks.py). Swap it in for a model that calls FlexAttention:

    >>> from fusedattn.torch import flex_attention
    >>> out = flex_attention(q, k, v, score_mod=my_score_mod, block_mask=my_block_mask)
"""

from __future__ import annotations

import torch

from fusedattn.checks import number_from_array
from fusedattn.torch.block_masks import mask_of_block_mask
from fusedattn.torch.functional import attention

__all__ = ["flex_attention"]

API = "fusedattn.torch.flex_attention"


def flex_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, score_mod=None, block_mask=None,
                   scale: float | None = None, enable_gqa: bool = False, return_lse: bool = False,
                   kernel_options: dict | None = None, *, return_aux=None):
    """torch.nn.attention.flex_attention.flex_attention, run by fusedattn.

    Args:
        query: (B, Hq, L, E). key: (B, Hkv, S, E). value: (B, Hkv, S, Ev).
        score_mod: score_mod(score, b, h, q_idx, kv_idx) -> score, in torch, as for FlexAttention; a
            score it leaves at or below -1e8 counts as masked (FlexAttention keeps it a number).
        block_mask: a FlexAttention BlockMask for (L, S), as compiled FlexAttention reads it: its
            mask_mod masks the keys where it is False, and a table that lists other blocks than
            create_block_mask(mask_mod) would (from_kv_blocks, full blocks that mask_mod masks
            partly) is applied as well (checked once per BlockMask, not while torch.compile traces).
            A row with no visible key gives 0 (LSE -inf).
        scale: multiplies q kᵀ; default 1/sqrt(E). A number > 0, or a 0-d tensor (read once per call: a
            host read). FlexAttention also runs 0 and negative scales, which this drop-in refuses by name.
        enable_gqa: allow Hkv < Hq with Hq a multiple of Hkv.
        return_lse: also return the log-sum-exp of the (modified) scores, (B, Hq, L), float32
            (float64 for float64 inputs).
        kernel_options: FlexAttention's tuning hints for its own Triton kernels (block sizes, stages);
            accepted for a drop-in and not used: fusedattn picks its kernels itself.
        return_aux: a FlexAttention AuxRequest; its `lse` is returned in an AuxOutput as FlexAttention
            does. `max_scores` (each row's largest score) is not computed: asking for it raises.

    Returns:
        out (B, Hq, L, Ev), (out, lse) with return_lse, or (out, AuxOutput) with return_aux.
    """
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise ValueError(f"{API}: kernel_options: expected a dict of FlexAttention kernel options or None, got "
                         f"{type(kernel_options).__name__}")
    scale = number_from_array(scale, f"{API}: scale")
    aux = _aux_request(return_aux, return_lse)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{API}: {name}: expected a 4-D tensor (B, H, S, D), got {got}")
    for name, flag in (("enable_gqa", enable_gqa), ("return_lse", return_lse)):
        if not isinstance(flag, bool):  # ("no" would be true)
            raise ValueError(f"{API}: {name}: expected a bool, got {flag!r}")
    heads_q, heads_kv = query.shape[1], key.shape[1]
    if heads_q != heads_kv and not enable_gqa:
        raise ValueError(f"{API}: enable_gqa: expected True when query has {heads_q} heads and key {heads_kv}, "
                         "got False")
    mask_mod = None
    if block_mask is not None:
        mask_mod = getattr(block_mask, "mask_mod", None)
        lengths = tuple(getattr(block_mask, "seq_lengths", ()))
        if mask_mod is None or not callable(mask_mod):
            raise ValueError(f"{API}: block_mask: expected a FlexAttention BlockMask (with a mask_mod), got "
                             f"{type(block_mask).__name__}")
        wanted = (query.shape[2], key.shape[2])
        if lengths != wanted:
            raise ValueError(f"{API}: block_mask: expected one made for (L, S) = {wanted}, got one for {lengths}; "
                             "build it with create_block_mask(mask_mod, B, H, L, S)")
        if getattr(mask_mod, "__name__", "") == "noop_mask":  # FlexAttention's "no mask": nothing to trace
            mask_mod = None
        table = tuple(block_mask.kv_num_blocks.shape[:2])
        if table[0] not in (1, query.shape[0]) or table[1] not in (1, heads_q):
            raise ValueError(f"{API}: block_mask: expected one made for B in (1, {query.shape[0]}) and H in (1, "
                             f"{heads_q}), got B={table[0]}, H={table[1]}")
        if not torch.compiler.is_compiling():  # its table is read on the host: once per BlockMask
            mask_mod = mask_of_block_mask(block_mask, mask_mod, query.shape[0], heads_q, *wanted, query.device)
    result = attention(query, key, value, layout="bhsd", scale=scale, score_mod=score_mod, mask_mod=mask_mod,
                       return_lse=return_lse or aux)
    if aux:
        from torch.nn.attention.flex_attention import AuxOutput

        return result.out, AuxOutput(lse=result.lse, max_scores=None)
    if return_lse:
        return result.out, result.lse
    return result


def _aux_request(request, return_lse: bool) -> bool:
    """Whether a FlexAttention AuxRequest asks for the LSE (the one auxiliary output computed here)."""
    if request is None:
        return False
    if return_lse:
        raise ValueError(f"{API}: return_aux: expected None when return_lse=True (FlexAttention takes one or the "
                         "other), got an AuxRequest")
    if not (hasattr(request, "lse") and hasattr(request, "max_scores")):
        raise ValueError(f"{API}: return_aux: expected a FlexAttention AuxRequest(lse=..., max_scores=...), got "
                         f"{type(request).__name__}")
    if request.max_scores:
        raise ValueError(f"{API}: return_aux: max_scores is not computed by fusedattn (each row's largest score); "
                         "ask for AuxRequest(lse=True), or use FlexAttention itself for max_scores")
    return bool(request.lse)
