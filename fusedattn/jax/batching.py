"""vmap of a pass call: the vmapped axis folded into the batch, so one launch runs every item.

A pass call (a native custom call, a jax-triton kernel or a torch callback) runs one config. Under
vmap, the rule here merges the vmapped axis with the batch axis of every operand that has one
(q, k, v, and in the backward out, dO and the LSE), runs the config with batch N * B, and splits
the results again. Sequence lengths of a padded call are concatenated. Operands without a batch
axis (a (1, H, Sq, Skv) bias, sinks, ALiBi slopes, score_mod arrays) are shared by every item, so
they may not be vmapped themselves, and their gradients, summed over the batch, would mix the
items: such calls, THD (one token axis), dropout (per-item bits) and max_logit (a max over the
batch) run item by item instead (lax.map: one launch each), correct but not folded.

Sequence lengths are checked per item first: a custom call that checks its offsets itself
(cudnn_call.checks_offsets) would see one valid folded batch where an item's offsets break the rules
(not starting at 0, say), so an item with broken offsets runs on none and its results are NaN, as the
frontend's own check makes them.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from fusedattn.config import AttentionConfig

__all__ = ["batchable"]

_SEQUENCE_LENGTHS = ("cu_seqlens_q", "cu_seqlens_kv")
_SHARED_ROLES = ("BHQK", "BH", "H", "", "N")  # pass_calls.roles of operands that broadcast over the batch


class _Fold(NamedTuple):
    cfg: AttentionConfig
    operands: tuple
    items: int  # N, the vmapped axis
    batch: int  # B, the config's


def batchable(cfg: AttentionConfig, run, operands, names, operand_roles, out_roles, summed) -> tuple:
    """run(cfg, operands), with a vmap rule that folds the vmapped axis into the batch where it can.

    names: each operand's array name (or "" for others); roles: its axes, right-aligned (pass_calls);
    summed: per result, whether it is a gradient reduced over the batch (bias, sink, slopes)."""
    @custom_vmap
    def call(*xs):
        return run(cfg, xs)

    @call.def_vmap
    def rule(axis_size, in_batched, *xs):
        broken, xs = _items_with_broken_offsets(cfg, axis_size, in_batched, xs, names)
        fold = _fold(cfg, axis_size, in_batched, xs, names, operand_roles, summed)
        if fold is None:
            results = _item_by_item(call, in_batched, xs)
        else:
            results = batchable(fold.cfg, run, fold.operands, names, operand_roles, out_roles, summed)
            results = tuple(_split(x, role, fold) for x, role in zip(results, out_roles))
        return tuple(_poisoned(x, broken) for x in results), (True,) * len(out_roles)

    return call(*operands)


def _items_with_broken_offsets(cfg, items: int, in_batched, xs, names) -> tuple:
    """((N,) booleans: whose sequence lengths break the rules, or None; the operands with those lengths
    made all-zero). Padded layouts only: THD runs item by item, each call checking its own offsets."""
    from fusedattn.layout import offsets_violated

    if cfg.layout.is_ragged or not any(name in _SEQUENCE_LENGTHS for name in names):
        return None, xs
    broken = jnp.zeros((items,), bool)
    for x, batched, name in zip(xs, in_batched, names):
        if name in _SEQUENCE_LENGTHS:
            limit = cfg.seqlen_q if name == "cu_seqlens_q" else cfg.seqlen_kv
            check = jax.vmap(offsets_violated, (0, None, None)) if batched else offsets_violated
            broken = broken | check(x, limit, None)
    def safe(x, batched):  # a shared operand serves every item: all-zero when any item is broken
        where = broken.reshape(-1, *(1,) * (x.ndim - 1)) if batched else broken.any()
        return jnp.where(where, jnp.zeros((), x.dtype), x)

    return broken, tuple(safe(x, batched) if name in _SEQUENCE_LENGTHS else x
                         for x, batched, name in zip(xs, in_batched, names))


def _poisoned(x, broken):
    """A per-item result (items first), NaN for the items whose offsets are broken."""
    if broken is None or not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return jnp.where(broken.reshape(-1, *(1,) * (x.ndim - 1)), jnp.full((), jnp.nan, x.dtype), x)


def _batch_axis(ndim: int, role: str) -> int | None:
    """The batch axis of a per-item operand (q, k, v, out, dO, LSE: a layout's role, naming every
    axis), else None (shared operands: bias and score_mod arrays "BHQK", slopes "BH", sinks, seeds)."""
    return role.index("B") if role not in _SHARED_ROLES and len(role) == ndim else None


def _fold(cfg, items, in_batched, xs, names, roles, summed) -> _Fold | None:
    if cfg.layout.is_ragged or cfg.dropout_p > 0.0 or cfg.return_max_logit or any(summed):
        return None
    folded = []
    for x, batched, name, role in zip(xs, in_batched, names, roles):
        axis = _batch_axis(x.ndim - batched, role)
        if axis is not None:
            folded.append(_merge(x if batched else jnp.broadcast_to(x, (items, *x.shape)), axis))
        elif name in _SEQUENCE_LENGTHS:
            folded.append(_concatenated(x, items, batched))
        elif batched or _shares_batch(x, role):
            return None
        else:
            folded.append(x)
    return _Fold(cfg.replace(batch=items * cfg.batch), tuple(folded), items, cfg.batch)


def _shares_batch(x, role: str) -> bool:
    """Whether a shared operand has a batch extent above 1 (per-item rows the fold would misalign)."""
    if "B" not in role or x.ndim < len(role) - role.index("B"):
        return False
    return x.shape[x.ndim - (len(role) - role.index("B"))] != 1


def _merge(x, axis: int):
    """(N, ...) with the batch at `axis` of the rest -> the rest with a batch of N * B there."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])


def _concatenated(cu_seqlens, items: int, batched: bool):
    """(B + 1,) cumulative lengths, per item or shared, as the (N * B + 1,) ones of the folded batch."""
    lengths = cu_seqlens[..., 1:] - cu_seqlens[..., :-1]
    if not batched:
        lengths = jnp.broadcast_to(lengths, (items, *lengths.shape))
    total = jnp.cumsum(lengths.reshape(-1), dtype=cu_seqlens.dtype)
    return jnp.concatenate([jnp.zeros((1,), cu_seqlens.dtype), total])


def _split(x, role: str, fold: _Fold):
    """A result of the folded call as (N, ...) per item. The one result without a batch axis is the
    empty max_logit placeholder (a call that returns max_logit is never folded)."""
    if "B" not in role:
        return jnp.broadcast_to(x, (fold.items, *x.shape))
    axis = role.index("B")
    x = x.reshape(*x.shape[:axis], fold.items, fold.batch, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _item_by_item(call, in_batched, xs) -> tuple:
    """The call once per vmapped item (lax.map), the shared operands closed over."""
    mapped = tuple(x for x, batched in zip(xs, in_batched) if batched)

    def one(item):
        item = iter(item)
        return call(*(next(item) if batched else x for x, batched in zip(xs, in_batched)))

    return tuple(jax.lax.map(one, mapped))
