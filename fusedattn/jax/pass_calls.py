"""What every JAX pass call shares, whichever way it launches (a native custom call, or a buffer
callback into torch): which operands it has, their axes for sharding, its results' shapes, and
running it whole or once per shard (partition.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.backends.base import ARRAY_NAMES
from fusedattn.config import AttentionConfig
from fusedattn.jax.partition import ShardedCall, Split, shard_local
from fusedattn.layout import layout_spec
from fusedattn.score_mods.core import RuntimeScalar

__all__ = ["API", "present", "aux_arrays", "output_shapes", "unpacked", "roles", "lse_role", "run_split"]

API = "fusedattn.jax.attention"


def present(arrays) -> tuple[list[int], list]:
    """(positions in ARRAY_NAMES, arrays) of the arrays a call passes."""
    index = [i for i, x in enumerate(arrays) if x is not None]
    return index, [arrays[i] for i in index]


def aux_arrays(score_mod) -> tuple[list[str], list]:
    """The score_mod's aux arrays (names, arrays): operands of the call, like q/k/v. Its numbers
    (RuntimeScalar) are not: they travel by value."""
    if score_mod is None:
        return [], []
    names = [name for name, value in score_mod.values.items() if not isinstance(value, RuntimeScalar)]
    return names, [score_mod.values[name] for name in names]


def output_shapes(cfg: AttentionConfig, q) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(out, lse, max_logit) of a call, from the config and the unpacked q."""
    out = jax.ShapeDtypeStruct(tuple(q.shape[:-1]) + (cfg.head_dim_v,), jnp.dtype(cfg.out_dtype))
    lse_shape = (q.shape[0], cfg.heads_q) if cfg.layout.is_ragged else (cfg.batch, cfg.heads_q, cfg.seqlen_q)
    max_logit = (cfg.heads_q,) if cfg.return_max_logit else (0,)
    return (out, jax.ShapeDtypeStruct(lse_shape, jnp.float32), jax.ShapeDtypeStruct(max_logit, jnp.float32))


def unpacked(cfg: AttentionConfig) -> AttentionConfig:
    """The config for separate q, k, v: JAX slices packed layouts into new arrays before the call."""
    return cfg.replace(layout=layout_spec(cfg.layout).base)


def roles(cfg: AttentionConfig, index) -> list[str]:
    """Each operand's axes for sharding (see partition.py), right-aligned."""
    q_axes = layout_spec(cfg.layout).tensors[0][1]
    kv_axes = q_axes.replace("H", "G")
    known = {"q": q_axes, "k": kv_axes, "v": kv_axes, "bias": "BHQK", "alibi_slopes": "BH", "sink": "H",
             "dropout_seed": "", "dropout_offset": ""}
    return [known.get(ARRAY_NAMES[i], "N") for i in index]


def lse_role(cfg: AttentionConfig) -> str:
    return "TH" if cfg.layout.is_ragged else "BHQ"


def run_split(cfg, run, shapes, operands, operand_roles, out_roles, summed, index, aux_count,
              split: Split | None) -> tuple:
    """run(cfg, operands) whole, or once per shard of `split`. shapes(cfg, operands): the results'."""
    if split is None:
        return run(cfg, tuple(operands))
    seed_position = ARRAY_NAMES.index("dropout_seed")
    seed = index.index(seed_position) if seed_position in index else None
    pinned = tuple(range(len(index), len(index) + aux_count))
    call = ShardedCall(API, cfg, run, tuple(operand_roles), tuple(out_roles), tuple(summed), shapes, seed, pinned)
    return shard_local(call, split, operands)
