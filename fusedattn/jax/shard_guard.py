"""A sharding check that also works inside jit: an identity op that reads its operand's sharding
when XLA partitions the program, and refuses axes other than batch and heads.

Attention runs shard-local over batch (B) and heads (H). Any other sharded axis (the
sequence, the head dim, the packing of q/k/v) would need context parallelism, which fusedattn
does not have yet; without this check XLA would silently gather the axis.
"""

from __future__ import annotations

from functools import cache, partial

import jax
from jax.experimental.custom_partitioning import custom_partitioning

__all__ = ["guard_shard_axes"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _describe(letter: str) -> str:
    return {"S": "sequence", "T": "token", "D": "head dim"}.get(letter, "packing")


def _check(api: str, name: str, axes: str, spec) -> None:
    for letter, entry in zip(axes, tuple(spec)):
        if entry is not None and letter not in "BH":
            raise ValueError(f"{api}: {name}: expected sharding over batch (B) or heads (H) only, got its "
                             f"{_describe(letter)} axis ({letter} of {axes}) sharded over mesh axis {entry!r}; "
                             "context parallelism (a sharded sequence) is not supported yet: replicate that axis")


@cache  # a handful of (api, name, axes): one op each
def _identity_op(api: str, name: str, axes: str):
    @custom_partitioning
    def identity(x):
        return x

    def infer(mesh, arg_shapes, result_shape):
        return arg_shapes[0].sharding

    def partition(mesh, arg_shapes, result_shape):
        sharding = arg_shapes[0].sharding
        _check(api, name, axes, getattr(sharding, "spec", ()))
        return mesh, (lambda x: x), sharding, (sharding,)

    rule = " ".join(_LETTERS[:len(axes)])
    identity.def_partition(infer_sharding_from_operands=infer, partition=partition, sharding_rule=f"{rule} -> {rule}")
    return identity


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _guarded(api: str, name: str, axes: str, x):
    return _identity_op(api, name, axes)(x)


def _guarded_fwd(api, name, axes, x):
    return _guarded(api, name, axes, x), None


def _guarded_bwd(api, name, axes, _, cotangent):
    return (cotangent,)


_guarded.defvjp(_guarded_fwd, _guarded_bwd)


def _batched(x) -> bool:
    """Whether x is (or, under differentiation, wraps) a vmap tracer."""
    while isinstance(x, jax.core.Tracer):
        if type(x).__name__ == "BatchTracer":
            return True
        x = getattr(x, "primal", None)
    return False


def guard_shard_axes(api: str, tensors: list[tuple[str, str, object]]) -> list:
    """Each (name, axes, array) passed through the check; arrays under vmap pass unchecked
    (XLA's partitioner has no batching rule for the check)."""
    out = []
    for name, axes, x in tensors:
        if x is None or not isinstance(x, jax.core.Tracer) or _batched(x) or len(x.shape) != len(axes):
            out.append(x)
        else:
            out.append(_guarded(api, name, axes, x))
    return out
