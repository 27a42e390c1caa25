"""NaN results for a JAX call whose traced offsets break the rules, at no cost to a good call.

frontend_common.check_unread_offsets gives a 0-d factor (1, or NaN for broken offsets) and safe offsets.
Multiplying q, k, v and the outputs by it, as the torch frontend does for its non-cuDNN backends, costs
a pass over each of them on every call: four full passes in a forward and as many in a backward, more
than the attention kernel at S=1024 and some 15% at S=4096. Here the factor touches only what XLA fuses
with work it does anyway:
  outputs: out * factor, fused with the row fix-ups after the kernel (the cotangent passes unchanged);
  inputs: unchanged in the forward, their gradients times the factor (fused with the backward's fix-ups).
Every output and every gradient of a broken call is still NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fusedattn.backends.base import ARRAY_NAMES, DIFFERENTIABLE
from fusedattn.frontend_common import UnreadOffsetsCheck
from fusedattn.frontend_common import guard_inputs as guard_with

__all__ = ["guard_inputs", "poisoned"]


def _scaled(x, factor):
    return x * factor.astype(x.dtype)


@jax.custom_vjp
def _value_times(x, factor):
    return _scaled(x, factor)


_value_times.defvjp(lambda x, factor: (_scaled(x, factor), factor),
                    lambda factor, g: (g, jnp.zeros_like(factor)))


# A custom_jvp, not a custom_vjp: under vmap with x shared and the offsets (so the factor) per item, a
# custom_vjp's backward ran once per item on the cotangent already summed over the items, and the
# shared x's gradient came out N times too large. The jvp's tangent is per item; its transpose sums once.
@jax.custom_jvp
def _gradient_times(x, factor):
    return x


@_gradient_times.defjvp
def _gradient_times_jvp(primals, tangents):
    x, factor = primals
    return x, _scaled(tangents[0], factor)


def _is_float(x) -> bool:
    return x is not None and jnp.issubdtype(x.dtype, jnp.floating)


def poisoned(check: UnreadOffsetsCheck | None, x):
    """An output times the check's factor (x bit for bit, or NaN); its cotangent passes unchanged."""
    return x if check is None or not _is_float(x) else _value_times(x, check.factor)


def _gradient_poisoned(check: UnreadOffsetsCheck, x):
    return _gradient_times(x, check.factor) if _is_float(x) else x


def guard_inputs(cfg, passed: tuple, arrays: tuple, check: UnreadOffsetsCheck | None) -> tuple:
    """frontend_common.guard_inputs (offsets made safe, q/k/v unpacked from `passed`) with the gradients
    of q, k, v and of every other differentiable array times the check's factor: their cotangents reach
    them unpoisoned, since `poisoned` leaves the outputs' cotangents alone."""
    if check is None:
        return arrays
    arrays = guard_with(cfg, passed, arrays, check, poison=_gradient_poisoned)
    return tuple(_gradient_poisoned(check, x) if i >= 3 and name in DIFFERENTIABLE else x
                 for i, (name, x) in enumerate(zip(ARRAY_NAMES, arrays)))
