"""The sharding check of JAX calls: attention runs shard-local over batch (B) and heads (H).

Any other sharded axis (the sequence, the head dim, the packing of q/k/v) would need context
parallelism, which fusedattn does not have yet; without this check XLA would silently gather
the axis. A concrete array is checked from its sharding at once; inside jit, an identity op
reads its operand's sharding when XLA partitions the program.
"""

from __future__ import annotations

from functools import cache, partial

import jax
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning

__all__ = ["batched", "check_shard_axes", "guard_whole"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _describe(letter: str) -> str:
    return {"S": "sequence", "T": "token", "D": "head dim"}.get(letter, "packing")


def _check(api: str, name: str, axes: str, spec) -> None:
    for letter, entry in zip(axes, tuple(spec)):
        if entry is not None and letter not in "BHV":
            raise ValueError(f"{api}: {name}: expected sharding over batch (B) or heads (H) only, got its "
                             f"{_describe(letter)} axis ({letter} of {axes}) sharded over mesh axis {entry!r}; "
                             "context parallelism (a sharded sequence) is not supported yet: replicate that axis")


def _check_whole(api: str, name: str, axes: str, spec, backend: str) -> None:
    for letter, entry in zip(axes, tuple(spec)):
        if entry is not None:
            raise ValueError(f"{api}: {name}: sharded over mesh axis {entry!r} (axis {letter} of {axes}), but the "
                             f"{backend} backend runs as one callback that XLA would gather; declare the split "
                             "with shard_axes={'batch': ..., 'heads': ...} (mesh axis names) and jax.set_mesh(mesh) "
                             "around the call, or give the inputs explicit shardings")


# Bounded by construction, so not an LRUCache in fusedattn.cache's registry: the keys come from fixed
# vocabularies (api and tensor names, layout axes, backend names), a handful of ops in all; evicting
# one would only make JAX see a new op.
@cache
def _identity_op(api: str, name: str, axes: str, whole_for: str = ""):
    """An identity that checks its operand's sharding when XLA partitions the program;
    whole_for names a backend that needs the operand unsharded."""
    @custom_partitioning
    def identity(x):
        return x

    def infer(mesh, arg_shapes, result_shape):
        return arg_shapes[0].sharding

    def partition(mesh, arg_shapes, result_shape):
        sharding = arg_shapes[0].sharding
        spec = getattr(sharding, "spec", ())
        _check(api, name, axes, spec)
        if whole_for:
            _check_whole(api, name, axes, spec, whole_for)
        return mesh, (lambda x: x), sharding, (sharding,)

    rule = " ".join(_LETTERS[:len(axes)])
    identity.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=f"{rule} -> {rule}")
    return identity


@cache
def _batchable_identity_op(api: str, name: str, axes: str, whole_for: str = ""):
    """The identity op, under vmap too: custom_partitioning has no batching rule, and a jitted call
    that vmap batches later (vmap(jit(f))) reaches it with no vmap tracer to see at trace time. The
    vmapped axis, V in the axes an error names, may be sharded like the batch (the pass call folds
    it into the batch)."""
    @custom_vmap
    def identity(x):
        return _identity_op(api, name, axes, whole_for)(x)

    @identity.def_vmap
    def rule(axis_size, in_batched, x):
        return _batchable_identity_op(api, name, "V" + axes, whole_for)(x), True

    return identity


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _guarded(api: str, name: str, axes: str, whole_for: str, x):
    return _batchable_identity_op(api, name, axes, whole_for)(x)


def _guarded_fwd(api, name, axes, whole_for, x):
    return _guarded(api, name, axes, whole_for, x), None


def _guarded_bwd(api, name, axes, whole_for, _, cotangent):
    return (cotangent,)


_guarded.defvjp(_guarded_fwd, _guarded_bwd)


def batched(x) -> bool:
    """Whether x is (or, under differentiation, wraps) a vmap tracer."""
    while isinstance(x, jax.core.Tracer):
        if type(x).__name__ == "BatchTracer":
            return True
        x = getattr(x, "primal", None)
    return False


def _partition_spec(x):
    """The PartitionSpec of x's sharding when it is known now (a concrete array, or a traced one
    whose type carries its sharding), else None."""
    try:
        sharding = x.sharding if not isinstance(x, jax.core.Tracer) else getattr(jax.typeof(x), "sharding", None)
    except Exception:  # tracers without a sharding in their type
        return None
    return getattr(sharding, "spec", None)


def check_shard_axes(api: str, layout: str, q, k, v) -> tuple:
    """(q, k, v) after the check: arrays whose sharding is known are checked now; traced ones
    (outside a visible vmap, which checks nothing itself) pass through the identity op.
    Arrays a packed layout does not take stay as they are, so the argument checks refuse them."""
    from fusedattn.layout import layout_spec

    try:
        tensors = layout_spec(layout).tensors
    except ValueError:
        return q, k, v  # a bad layout: build_config says so
    checked = []
    for (name, axes), x in zip(tensors, (q, k, v)):
        spec = _partition_spec(x) if x is not None else None
        if spec is not None:
            _check(api, name, axes, spec)
        if isinstance(x, jax.core.Tracer) and not batched(x) and len(x.shape) == len(axes):
            x = _guarded(api, name, axes, "", x)
        checked.append(x)
    return tuple(checked) + (q, k, v)[len(checked):]


def guard_whole(api: str, base_layout: str, arrays, backend: str) -> tuple:
    """Unpacked (q, k, v) of a call that runs as one callback with no known split: traced ones
    pass through an identity that refuses any sharding when XLA partitions the program."""
    from fusedattn.layout import layout_spec

    guarded = []
    for (name, axes), x in zip(layout_spec(base_layout).tensors, arrays):
        if isinstance(x, jax.core.Tracer) and len(x.shape) == len(axes):
            x = _guarded(api, name, axes, backend, x)
        guarded.append(x)
    return tuple(guarded)
