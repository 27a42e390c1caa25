"""Shard-local bridge calls: a buffer callback split over the devices holding batch (B) and heads (H).

XLA cannot see inside a buffer callback: left alone it would gather every operand onto each
device. (A custom_partitioning op cannot hold the callback: the per-shard module it lowers
loses its Python callbacks.) So the split is found when the call is traced and the callback
runs inside a shard_map, once per shard, on a config with the shard's batch and head counts.
The split comes from the call's `shard_axes={"batch": ..., "heads": ...}` (mesh axis names; the
mesh is the one set with `jax.set_mesh`), else from q's sharding when it is known at trace time
(a concrete array, or a type with explicit axes), else there is none. It is an argument, not a
context, because JAX's trace caches would not see a context of ours.

Each operand and result names its axes with a role string (B batch, H query heads, G key/value
heads, any other letter an axis that stays whole). Gradients of operands broadcast over a
sharded axis (a (1, H, S, S) bias under batch sharding, a per-head sink) are summed over it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from fusedattn.config import AttentionConfig

__all__ = ["ShardedCall", "Split", "check_declared", "find_split", "shard_local"]

# Added to the dropout seed per shard (times the shard's index), so shards draw different masks.
_SEED_STRIDE = 0x9E3779B9

def _names(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _letters(role: str, ndim: int) -> str:
    return role[-ndim:] if ndim else ""


@dataclasses.dataclass(frozen=True)
class Split:
    """Mesh axes holding the batch and the heads, and the mesh."""

    mesh: object
    batch_axes: tuple[str, ...]
    head_axes: tuple[str, ...]

    @property
    def batches(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def heads(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.head_axes)

    def spec(self, role: str, shape, cfg: AttentionConfig) -> PartitionSpec:
        entries = []
        for letter, size in zip(_letters(role, len(shape)), shape):
            if letter == "B" and size == cfg.batch and self.batch_axes:
                entries.append(self.batch_axes)
            elif letter in "HG" and size == (cfg.heads_q if letter == "H" else cfg.heads_kv) and self.head_axes:
                entries.append(self.head_axes)
            else:
                entries.append(None)
        return PartitionSpec(*entries)

    def summed_axes(self, role: str, shape, cfg: AttentionConfig) -> tuple[str, ...]:
        """Mesh axes a gradient is summed over: the sharded ones its operand does not follow."""
        followed = {axis for entry in self.spec(role, shape, cfg) for axis in _names(entry)}
        return tuple(axis for axis in self.batch_axes + self.head_axes if axis not in followed)


def _known_split(q, role: str):
    """(mesh, batch axes, head axes) from q's sharding when it is known now, else None."""
    try:
        sharding = q.sharding if not isinstance(q, jax.core.Tracer) else jax.typeof(q).sharding
    except Exception:  # a tracer whose type has no sharding
        return None
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or not getattr(mesh, "axis_names", ()):
        return None
    entries = dict(zip(_letters(role, len(q.shape)), tuple(spec) + (None,) * len(q.shape)))
    return mesh, _names(entries.get("B")), _names(entries.get("H"))


def _declared(api: str, shard_axes) -> tuple:
    """(mesh, batch axes, head axes) of a shard_axes argument, with clear errors."""
    if not isinstance(shard_axes, Mapping) or not set(shard_axes) <= {"batch", "heads"}:
        raise ValueError(f"{api}: shard_axes: expected a dict with keys 'batch' and/or 'heads' (mesh axis names), "
                         f"got {shard_axes!r}")
    mesh = jax.sharding.get_abstract_mesh()
    if not getattr(mesh, "axis_names", ()):
        raise ValueError(f"{api}: shard_axes: expected a mesh set with jax.set_mesh(mesh) around the call, got "
                         "none (a `with mesh:` block does not set it)")
    batch_axes, head_axes = _names(shard_axes.get("batch")), _names(shard_axes.get("heads"))
    missing = [a for a in batch_axes + head_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"{api}: shard_axes: expected axes of the mesh {tuple(mesh.axis_names)}, got {missing}")
    return mesh, batch_axes, head_axes


def check_declared(api: str, shard_axes) -> None:
    """ValueError for a shard_axes argument that is not a dict of the current mesh's axes, whichever backend
    runs the call (one in jax.numpy needs no split, but the same call elsewhere would refuse it)."""
    if shard_axes is not None:
        _declared(api, shard_axes)


def find_split(api: str, cfg: AttentionConfig, q, role: str, shard_axes=None) -> Split | None:
    """The split of this call over devices, or None when it runs whole (one device, or replicated)."""
    if shard_axes is not None:
        mesh, batch_axes, head_axes = _declared(api, shard_axes)
    else:
        known = _known_split(q, role)
        if known is None:
            return None
        mesh, batch_axes, head_axes = known
    split = Split(mesh, batch_axes, head_axes)
    if split.batches * split.heads == 1:
        return None
    for label, size, count in (("batch", cfg.batch, split.batches), ("heads_q", cfg.heads_q, split.heads),
                               ("heads_kv", cfg.heads_kv, split.heads)):
        if size % count:
            raise ValueError(f"{api}: {label}={size}: expected a multiple of its {count} shards")
    if split.batches > 1 and cfg.layout.is_ragged:
        raise ValueError(f"{api}: layout={cfg.layout.value}: packed sequences cannot be split over the batch; "
                         "shard over heads only")
    if split.heads > 1 and cfg.alibi_standard:
        raise ValueError(f"{api}: alibi_slopes: the standard slopes cannot be split over head shards; "
                         "shard over the batch only")
    if split.batches > 1 and cfg.return_max_logit:
        raise ValueError(f"{api}: return_max_logit: not supported with batch-sharded inputs yet")
    return split


@dataclasses.dataclass(frozen=True, eq=False)
class ShardedCall:
    """What one bridge call needs to run per shard.

    run(cfg, operands) traces the call for a config and operands of matching shapes;
    roles/out_roles give each operand's and result's axes (right-aligned, "" for a scalar);
    summed marks results to add up over the shards their operand was broadcast across;
    seed is the operand index of the dropout seed, or None; pinned operands (score_mod aux
    arrays, whose graphs know their full shape) may not span a sharded axis. shapes(cfg,
    operands) gives the results' shapes without tracing run (which may build and register a
    cuDNN graph for the whole, unsharded config).
    """

    api: str
    cfg: AttentionConfig
    run: Callable
    roles: tuple[str, ...]
    out_roles: tuple[str, ...]
    summed: tuple[bool, ...]
    shapes: Callable
    seed: int | None = None
    pinned: tuple[int, ...] = ()


def _local_config(cfg: AttentionConfig, split: Split) -> AttentionConfig:
    bias_shape = cfg.bias_shape
    if bias_shape is not None:
        bias_shape = (bias_shape[0] // split.batches if bias_shape[0] == cfg.batch else bias_shape[0],
                      bias_shape[1] // split.heads if bias_shape[1] == cfg.heads_q else bias_shape[1],
                      *bias_shape[2:])
    return cfg.replace(batch=cfg.batch // split.batches, heads_q=cfg.heads_q // split.heads,
                       heads_kv=cfg.heads_kv // split.heads, bias_shape=bias_shape)


def shard_local(call: ShardedCall, split: Split, operands) -> tuple:
    """call.run once per shard of `split`, inside a shard_map."""
    cfg = call.cfg
    in_specs = tuple(split.spec(r, x.shape, cfg) for r, x in zip(call.roles, operands))
    for i in call.pinned:
        if any(entry is not None for entry in in_specs[i]):
            raise ValueError(f"{call.api}: score_mod_tensors: an aux tensor of shape {tuple(operands[i].shape)} "
                             "spans the sharded batch or head axis; give it size 1 there, or shard the other axis")
    results = call.shapes(cfg, tuple(operands))
    out_specs = tuple(split.spec(r, s.shape, cfg) for r, s in zip(call.out_roles, results))
    sums = [split.summed_axes(r, s.shape, cfg) if summed else ()
            for r, s, summed in zip(call.out_roles, results, call.summed)]
    local_cfg, shard_axes_all = _local_config(cfg, split), split.batch_axes + split.head_axes

    def per_shard(*xs):
        xs = list(xs)
        if call.seed is not None:
            shard = jax.lax.axis_index(shard_axes_all).astype(jnp.uint32)
            xs[call.seed] = xs[call.seed] + shard * jnp.uint32(_SEED_STRIDE)
        outs = call.run(local_cfg, tuple(xs))
        return tuple(jax.lax.psum(o, axes) if axes else o for o, axes in zip(outs, sums))

    return tuple(jax.shard_map(per_shard, mesh=split.mesh, in_specs=in_specs, out_specs=out_specs,
                               check_vma=False)(*operands))
