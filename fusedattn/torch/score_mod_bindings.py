"""Repeat score_mod calls without tracing or binding again.

Binding a score_mod (tracing a flex callback, materializing its aux tensors, checking them) costs
tens of microseconds of Python. A call whose plan is already known keeps its bound operands here,
under the call's signature, for as long as the callbacks read the same objects (a flex callback's
closure and globals, a ScoreMod's tensors dict, compared by identity as the trace cache compares
them) and the tensors they capture are not changed in place (their version counters). Then a
repeat call goes straight to the native operator with the kept aux tensors and scalars.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch

from fusedattn.backends.cudnn.alignment import ALIGNMENT, aligned_copy
from fusedattn.cache import LRUCache, register
from fusedattn.options import SCORE_MOD_NAMES
from fusedattn.score_mods.core import MASKED_BELOW, BoundScoreMod, ScoreMod, needs_gradient
from fusedattn.score_mods.core import may_empty_rows as core_may_empty_rows
from fusedattn.score_mods.flex import PartialMask, flat_reads, same_reads

__all__ = ["Binding", "recall", "remember", "may_empty_rows"]

CAPACITY = 64  # bindings hold the aux tensors they made: a few per model is what a step needs


class Binding(NamedTuple):
    """One call's score_mod operands for the native operator, and what they were made from."""

    given: tuple  # the score_mod keywords' values (kept alive: the signature holds their ids)
    checks: tuple  # (value, what it reads, flat, by identity: see _reads) of each keyword given
    watched: tuple  # (tensor, version) of every tensor the mod holds: in-place changes rebind
    aux: list
    scalars: list
    empty_rows: bool


_BINDINGS: LRUCache = register("torch.score_mod.bindings", LRUCache(CAPACITY))


def _given(options: dict) -> tuple:
    return tuple(map(options.get, SCORE_MOD_NAMES))


def _reads(value) -> tuple | None:
    """The objects a score_mod keyword's value depends on, flat, to compare by identity; None when that
    cannot be known (a callable that is not a plain function: such calls bind every time)."""
    if isinstance(value, ScoreMod):
        return (value, *value.tensors.keys(), *value.tensors.values(), *value.bprop_tensors.keys(),
                *value.bprop_tensors.values())
    if isinstance(value, dict):
        return (*value.keys(), *value.values())
    if isinstance(value, PartialMask):
        inner = flat_reads(value.mask_mod)
        return None if inner is None else (value.kept, *inner)
    return flat_reads(value)


def _watched(mod: ScoreMod) -> tuple:
    values = [*mod.tensors.values(), *mod.bprop_tensors.values()]
    return tuple((x, x._version) for x in values if isinstance(x, torch.Tensor))


def recall(signature, given: tuple) -> Binding | None:
    """The binding kept for this signature, if the callbacks and their tensors are unchanged. given: the
    call's score_mod keywords' values in SCORE_MOD_NAMES' order."""
    kept = _BINDINGS.peek(signature)  # no lock on the hot path: remember() puts a binding again when made
    if kept is None or not all(map(operator.is_, kept.given, given)):  # (equal lengths: SCORE_MOD_NAMES')
        return None
    for value, read in kept.checks:
        if not same_reads(read, _reads(value)):
            return None
    for x, version in kept.watched:
        if x._version != version:
            return None
    return kept


def may_empty_rows(cfg, bound: BoundScoreMod) -> bool:
    """Whether the operator must give rows that lost every key output 0 and LSE -inf (one more kernel a
    call, backends/cudnn/empty_rows_kernel.py): score_mods.core.may_empty_rows, reading
    each float aux tensor once when bound (never on a warm call; while a CUDA graph is captured, where it
    cannot be read, the answer is yes)."""
    def arrays_may_mask(arrays) -> bool:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return True
        return any(bool((~(x.abs() < -MASKED_BELOW)).any()) for x in arrays)

    return core_may_empty_rows(cfg, bound, lambda x: x.is_floating_point(), arrays_may_mask)


def remember(signature, options: dict, cfg, bound: BoundScoreMod, operands) -> Binding:
    """This call's bound operands (operands: the plan's torch_plans.Operands), kept for the next call
    with this signature unless a mod's tensors learn or its callbacks' reads cannot be compared."""
    aux, scalars = operands.values(bound.values)
    aux = [x if x.data_ptr() % ALIGNMENT == 0 else aligned_copy(x) for x in aux]
    given = _given(options)
    checks = tuple((value, _reads(value)) for value in given if value is not None)
    binding = Binding(given, checks, _watched(bound.mod), aux, scalars, may_empty_rows(cfg, bound))
    readable = all(read is not None for _, read in checks)
    if signature is not None and readable and not needs_gradient(bound.mod):
        _BINDINGS.put(signature, binding)
    return binding
