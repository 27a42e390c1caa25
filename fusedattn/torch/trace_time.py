"""A compiled call's validation, configuration and selection, from its tensors' description alone.

While Dynamo traces a call, the tensors are fake: the planning functions Dynamo runs for real
(assume_constant_result) get each tensor's shape, strides, dtype, device and requires_grad, and
configure the call on meta stand-ins exactly as an eager call is configured.
"""

from __future__ import annotations

import torch

from fusedattn.arguments import RAGGED_LAYOUTS, TensorMeta
from fusedattn.frontend_common import TENSOR_ARGUMENTS, PreparedCall, prepare_call
from fusedattn.score_mods.builtins import traced_constant
from fusedattn.xp.torch_ops import OPS

__all__ = ["describe", "configure", "refusal", "raise_refusal"]

API = "fusedattn.torch.attention"


def describe(tensors: tuple) -> tuple:
    """Each of a call's tensors (TENSOR_ARGUMENTS' order) as (shape, strides, dtype, device,
    requires_grad), or None: what the planning functions take instead of the tensors."""
    return tuple(None if x is None else (constants(tuple(x.shape)), constants(tuple(x.stride())), x.dtype,
                                         x.device, x.requires_grad) for x in tensors)


_NUMBERS = (int, float, torch.SymInt, torch.SymFloat)


def constants(value):
    """value, its numbers (in tuples and lists too) plain constants while tracing: a size or a number
    argument that changed between compiled calls (or any, with dynamic=True) is symbolic there, and the
    planning functions Dynamo runs at trace time take constants only (torch 2.11 raised "SymNodeVariable()
    is not a constant"). Dynamo guards on each value, so a new one recompiles."""
    if isinstance(value, (tuple, list)):
        return type(value)(map(constants, value))
    return traced_constant(value) if isinstance(value, _NUMBERS) else value


OFFSETS_READ_BREAK = (
    f"{API}: a THD call without max_seqlen_q and max_seqlen_kv reads its offsets' values on the host, so it "
    "runs eagerly inside a compiled model (one graph break); pass both max lengths (ints) to keep it in the graph")


def reads_offsets(options: dict, offsets_given: bool) -> bool:
    """Whether a call must read its offsets' values: a THD call's longest sequences come from them where a
    max length is not given (a padded call's are its tensors' S)."""
    if not offsets_given or (options.get("max_seqlen_q") is not None and options.get("max_seqlen_kv") is not None):
        return False
    return str(options.get("layout") or "bshd") in RAGGED_LAYOUTS  # (torch 2.11 cannot iterate an enum)


def configure(described: tuple, options: dict, backend, grad_enabled: bool, score_mod=None) -> PreparedCall:
    """prepare_call on meta stand-ins of the described tensors (offsets are never read: THD and padded
    calls need both max lengths)."""
    from fusedattn.torch.functional import _strides

    stand_ins, metas = {}, {}
    for name, entry in zip(TENSOR_ARGUMENTS, described):
        if entry is None:
            stand_ins[name] = None
            continue
        shape, _, dtype, device, requires_grad = entry
        stand_ins[name] = torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad)
        metas[name] = TensorMeta(tuple(shape), OPS.dtype_name(stand_ins[name]), str(device), device.type)
    if reads_offsets(options, any(stand_ins[n] is not None for n in TENSOR_ARGUMENTS[6:])):
        raise ValueError(f"{API}: max_seqlen_q/max_seqlen_kv: expected ints under torch.compile for layout "
                         f"{options.get('layout')!r} (the offsets' values cannot be read while tracing), got None")
    differentiable = [stand_ins[n] for n in TENSOR_ARGUMENTS[:6] if stand_ins[n] is not None]
    return prepare_call(
        API, "torch", stand_ins, describe=lambda x, name: metas.get(name), host_copy=lambda x: None,
        is_training=grad_enabled and any(x.requires_grad for x in differentiable),
        bias_requires_grad=bool(stand_ins["bias"] is not None and stand_ins["bias"].requires_grad),
        backend=backend, score_mod=score_mod,
        strides=_strides(*(None if x is None else x[1] for x in described[:3])), **options,
    )


_REFUSED = "fusedattn: refused while tracing"
refused_errors = (NotImplementedError, TypeError, ValueError)  # an argument error raised as one (subclass: base)


def refusal(error: Exception) -> tuple:
    """An argument error met by a planning function, as a constant for Dynamo to bake: an exception
    raised inside an assume_constant_result function reaches the user as InternalTorchDynamoError
    (which reads as a Dynamo bug and is no ValueError). raise_refusal raises it again in traced code."""
    kind = next(k for k in refused_errors if isinstance(error, k))
    return _REFUSED, kind.__name__, str(error)


def raise_refusal(planned):
    """planned, or the error a planning function met (refusal) raised as its own type: a ValueError
    stays one (under fullgraph=True, Dynamo's own error names it and its message)."""
    if isinstance(planned, tuple) and planned[0] == _REFUSED:  # (plain branches: what Dynamo traces)
        if planned[1] == "NotImplementedError":
            raise NotImplementedError(planned[2])
        if planned[1] == "TypeError":
            raise TypeError(planned[2])
        raise ValueError(planned[2])
    return planned
