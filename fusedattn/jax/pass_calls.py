"""What every JAX pass call shares, whichever way it launches (a native custom call, or a buffer
callback into torch): which operands it has, their axes for sharding, its results' shapes, and
running it whole or once per shard (partition.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.backends.base import ARRAY_NAMES, DIFFERENTIABLE
from fusedattn.config import AttentionConfig
from fusedattn.jax.batching import batchable
from fusedattn.jax.partition import ShardedCall, Split, shard_local
from fusedattn.layout import layout_spec
from fusedattn.score_mods.core import RuntimeScalar

__all__ = ["API", "present", "aux_arrays", "output_shapes", "unpacked", "roles", "lse_role", "run_split",
           "forward_call", "backward_call"]

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
    stats = jnp.dtype(cfg.stats_dtype)
    return (out, jax.ShapeDtypeStruct(lse_shape, stats), jax.ShapeDtypeStruct(max_logit, stats))


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
    """run(cfg, operands) whole (under vmap: folded into the batch, batching.py), or once per shard of
    `split`. shapes(cfg, operands): the results'."""
    if split is None:
        names = [ARRAY_NAMES[i] for i in index] + [""] * (len(operands) - len(index))
        return batchable(cfg, run, tuple(operands), names, tuple(operand_roles), tuple(out_roles), tuple(summed))
    seed_position = ARRAY_NAMES.index("dropout_seed")
    seed = index.index(seed_position) if seed_position in index else None
    pinned = tuple(range(len(index), len(index) + aux_count))
    call = ShardedCall(API, cfg, run, tuple(operand_roles), tuple(out_roles), tuple(summed), shapes, seed, pinned)
    return shard_local(call, split, operands)


def _named(index, operands, aux_names) -> tuple[dict, dict]:
    """({array name: operand}, {aux name: operand}) of a pass's operands."""
    named = {ARRAY_NAMES[i]: x for i, x in zip(index, operands)}
    return named, dict(zip(aux_names, operands[len(index):len(index) + len(aux_names)]))


def forward_call(cfg: AttentionConfig, score_mod, arrays, split: Split | None, run_pass) -> tuple:
    """(out, lse, max_logit) of run_pass(cfg, {array name: array}, {aux name: array}), whole or per shard."""
    cfg = unpacked(cfg)
    index, passed = present(arrays)
    aux_names, aux = aux_arrays(score_mod)

    def run(local_cfg, operands):
        return run_pass(local_cfg, *_named(index, operands, aux_names))

    operand_roles = roles(cfg, index)
    return run_split(cfg, run, lambda c, ops: output_shapes(c, ops[0]), passed + aux,
                     operand_roles + ["BHQK"] * len(aux), (operand_roles[0], lse_role(cfg), "H"),
                     (False, False, False), index, len(aux), split)


def backward_call(cfg: AttentionConfig, score_mod, arrays, out, lse, grad_out, grad_lse, split: Split | None,
                  run_pass) -> dict:
    """{name: gradient} for the differentiable arrays the call passed, from
    run_pass(cfg, named, aux, out, lse, grad_out, grad_lse, wanted) -> {name: gradient} (a missing one is
    zero), whole or per shard. grad_out None means zero; grad_lse None means none."""
    cfg = unpacked(cfg)
    index, passed = present(arrays)
    aux_names, aux = aux_arrays(score_mod)
    wanted = tuple(ARRAY_NAMES[i] for i in index if ARRAY_NAMES[i] in DIFFERENTIABLE)
    extra = [out, lse, jnp.zeros_like(out) if grad_out is None else grad_out]
    if grad_lse is not None:
        extra.append(grad_lse)
    positions = [index.index(ARRAY_NAMES.index(name)) for name in wanted]  # each wanted array's operand

    def gradient_shapes(_cfg, operands):  # each gradient has its array's shape and dtype
        return tuple(jax.ShapeDtypeStruct(operands[i].shape, operands[i].dtype) for i in positions)

    def run(local_cfg, operands):
        named, local_aux = _named(index, operands, aux_names)
        local_out, local_lse, local_grad, *local_grad_lse = operands[len(index) + len(aux):]
        grads = run_pass(local_cfg, named, local_aux, local_out, local_lse, local_grad,
                         local_grad_lse[0] if local_grad_lse else None, wanted)
        return tuple(grads.get(name, jnp.zeros_like(named[name])) for name in wanted)

    operand_roles = roles(cfg, index)
    q_role, lse_axes = operand_roles[0], lse_role(cfg)
    out_roles = [operand_roles[i] for i in positions]
    summed = [name not in ("q", "k", "v") for name in wanted]
    grads = run_split(cfg, run, gradient_shapes, passed + aux + extra,
                      operand_roles + ["BHQK"] * len(aux) + [q_role, lse_axes, q_role, lse_axes][:len(extra)],
                      out_roles, summed, index, len(aux), split)
    return dict(zip(wanted, grads))
