"""Repeat score_mod calls without tracing or binding again.

Binding a score_mod (tracing a flex callback, materializing its aux tensors, checking them) costs
tens of microseconds of Python. A call whose plan is known keeps its bound operands here, with the
plan, under the call's signature and the objects its callbacks read (a flex callback's closure and
globals, a ScoreMod's tensors dict and its callbacks' reads: by identity, numbers by value). A repeat
call whose callbacks read the same objects goes straight to the native operator with the kept aux
tensors and scalars, while the tensors they hold are not changed in place (their version counters).
The signature names a function by its code (signature_part), so a closure or a built-in made anew at
each call, as a model's forward writes it, finds its binding; closures of one code over other objects
(one per layer) each keep their own.
"""

from __future__ import annotations

import inspect
import operator
import types
import weakref
from typing import NamedTuple

import torch

from fusedattn.backends.cudnn.alignment import ALIGNMENT, aligned_copy
from fusedattn.cache import LRUCache, register
from fusedattn.options import SCORE_MOD_NAMES
from fusedattn.score_mods.core import MASKED_BELOW, BoundScoreMod, ScoreMod, needs_gradient
from fusedattn.score_mods.core import may_empty_rows as core_may_empty_rows
from fusedattn.score_mods.flex import (
    PartialMask,
    fixed_reads,
    flat_reads,
    identity,
    library_function,
    plain_reads,
    reads_key,
    same_reads,
    unchanged_reads,
)

__all__ = ["Binding", "recall", "remember", "forget", "may_empty_rows", "signature_part", "fixed_but_dicts"]

CAPACITY = 128  # bindings (each under two keys, see recall) hold the aux tensors they made: a few per model


class Binding(NamedTuple):
    """One call's score_mod operands for the native operator, and what they were made from."""

    given: tuple  # the score_mod keywords' values (kept alive: the signature holds their code's ids)
    reads: tuple  # what each keyword given reads (see _parts), kept alive: the key holds their ids
    checks: tuple  # (value, what of it can change, compared in place) of each keyword given: see recall
    watched: tuple  # (tensor, version, requires_grad) of every tensor the mod holds: a change rebinds
    aux: list
    scalars: list
    empty_rows: bool
    planned: tuple  # (cfg, selection, native plan) these operands were bound for
    term: object = None  # a learning added term (frontend_common.LearningTerm): the call's bias is term(q, bias)


_BINDINGS: LRUCache = register("torch.score_mod.bindings", LRUCache(CAPACITY))


def _given(options: dict) -> tuple:
    return tuple(map(options.get, SCORE_MOD_NAMES))


def _callable_reads(fn) -> tuple | None:
    """What a callback reads (flex.flat_reads): a plain function or a bound method is named by its code
    (flex.identity) in the signature, so its reads are what tells two of them apart; None for another
    callable (its state cannot be known: such calls bind every time)."""
    if fn is None:
        return ()
    if type(fn) is types.FunctionType or inspect.ismethod(fn):
        return flat_reads(fn)
    return None


def _parts(value) -> tuple | None:
    """The objects a score_mod keyword's value depends on, as flat tuples (one per callback or dict), to
    key a binding by (flex.reads_key); None when that cannot be known."""
    if isinstance(value, ScoreMod):  # a built-in made anew at each call has other objects, the same parts
        fixed = value.__dict__.get(_FIXED)
        if fixed is None:
            fixed = _fixed_parts(value)
        return None if fixed is False else (*fixed, *_dict_parts(value))
    if isinstance(value, dict):
        return ((*value.keys(), *value.values()),)
    if isinstance(value, PartialMask):
        inner = flat_reads(value.mask_mod)
        return None if inner is None else ((value.kept, *inner),)
    reads = _callable_reads(value)
    return None if reads is None else (reads,)


def _dict_parts(mod: ScoreMod) -> tuple:
    """A ScoreMod's dicts as two flat parts: the part of its reads that can change between calls."""
    return (*mod.tensors.keys(), *mod.tensors.values()), (*mod.bprop_tensors.keys(), *mod.bprop_tensors.values())


_FIXED, _WHO = "_binding_fixed_parts", "_binding_signature_part"  # kept on a ScoreMod (frozen: they cannot change)


def _fixed_parts(mod: ScoreMod) -> tuple | bool:
    """The parts of a ScoreMod's reads besides its dicts (see _parts): its callbacks' reads and its own
    fields, or False where a callback's cannot be known. Kept on the mod where its callbacks are this
    library's (their closures never rebind); a user's function can read other globals at any call."""
    if mod.parts:  # a composition: what its mods' callbacks read, not the mods (made anew at each call)
        inner = [m.__dict__.get(_FIXED) or _fixed_parts(m) for m in mod.parts]
        if False in inner:
            return False
        fixed = (*[part for parts in inner for part in parts], (mod.masks, mod.structure, mod.issue, *mod.host))
        if all(_FIXED in m.__dict__ for m in mod.parts):
            object.__setattr__(mod, _FIXED, fixed)
        return fixed
    callbacks = (mod.forward, mod.bprop, mod.prepare, *mod.flex)
    reads = tuple(map(_callable_reads, callbacks))
    if None in reads:
        return False
    fixed = (*reads, (mod.masks, mod.structure, mod.issue, *mod.host))
    if all(fn is None or (type(fn) is types.FunctionType and library_function(fn)) for fn in callbacks):
        object.__setattr__(mod, _FIXED, fixed)
    return fixed


def fixed_but_dicts(mod: ScoreMod) -> bool:
    """Whether all a ScoreMod reads besides its dicts is fixed (its callbacks are this library's)."""
    if _FIXED not in mod.__dict__:
        _fixed_parts(mod)
    return _FIXED in mod.__dict__


def signature_part(value) -> tuple:
    """Who a score_mod keyword's value is, for the plan cache's signature: a function by its code and a
    ScoreMod by its callbacks' (flex.identity), so callbacks and built-ins made anew at each call, as a
    model's forward writes them, find the plan of the last call; which objects they read keys the
    binding. Anything else by itself."""
    if isinstance(value, ScoreMod):
        who = value.__dict__.get(_WHO)
        if who is None:
            who = (("compose", *map(signature_part, value.parts)) if value.parts else
                   ("flex", *map(identity, value.flex)) if value.flex else
                   ("mod", identity(value.forward), identity(value.bprop), identity(value.prepare)))
            object.__setattr__(value, _WHO, who)
        return who
    return identity(value)


def _watched(mod: ScoreMod) -> tuple:
    values = [*mod.tensors.values(), *mod.bprop_tensors.values()]
    return tuple((x, x._version, x.requires_grad) for x in values if isinstance(x, torch.Tensor))


_PART = object()  # between the parts of what the keywords read (their lengths differ from call to call)


def _reads_of(given: tuple) -> tuple | None:
    """What the score_mod keywords' values read (see _parts), flat with a marker before each part."""
    reads: list = []
    for value in given:
        if value is not None:
            parts = _parts(value)
            if parts is None:
                return None
            for part in parts:
                reads.append(_PART)
                reads.extend(part)
        reads.append(_PART)
    return tuple(reads)


def _key(signature, reads: tuple) -> tuple:
    return (signature, reads_key(reads))


def _changeable(value) -> tuple | None:
    """What of a keyword's value can change between calls, flat: a ScoreMod of this library's callbacks
    only its dicts (the rest is fixed: _fixed_parts), anything else all it reads."""
    if isinstance(value, ScoreMod) and value.__dict__.get(_FIXED) is not None:
        tensors, bprop_tensors = _dict_parts(value)
        return tensors + bprop_tensors
    if type(value) is types.FunctionType:  # a flex callback: the common case
        if fixed_reads(value):  # a built-in's function: what it reads is fixed when it is made
            return ()
        return flat_reads(value)
    parts = _parts(value)
    return None if parts is None else tuple([x for part in parts for x in part])


def _check(value) -> tuple:
    """(value, what of it can change, whether that is plain_reads: compared in place by recall)."""
    read = _changeable(value)
    return value, read, type(value) is types.FunctionType and not fixed_reads(value) and plain_reads(value, read)


def recall(signature, given: tuple) -> Binding | None:
    """The binding kept for this signature and callbacks that read these objects, while the tensors they
    hold keep their versions. given: the call's score_mod keywords' values in SCORE_MOD_NAMES' order."""
    # No lock on the hot path: remember() puts a binding again. The callbacks a binding was made with
    # find it first, checking only what of them can change; those made anew, by all they read.
    kept = _BINDINGS.peek((signature, *map(id, given)))
    if kept is not None:
        for value, read, plain in kept.checks:
            if plain:
                if not unchanged_reads(value, read):
                    kept = None
                    break
                continue
            now = _changeable(value)
            if now is None or not same_reads(read, now):
                kept = None
                break
    if kept is None:
        reads = _reads_of(given)
        kept = None if reads is None else _BINDINGS.peek(_key(signature, reads))
        if kept is None:
            return None
        if not all(map(operator.is_, kept.given, given)):
            kept = _adopted(signature, given, kept)
    for x, version, learned in kept.watched:  # changed in place, or made to learn (or not) since
        if x._version != version or x.requires_grad is not learned:
            return None
    if kept.term is not None and not kept.term.learns():  # frozen since: its term binds as a score_mod
        return None
    return kept


# Callbacks that found a binding other objects made (equal ones: a built-in made in each layer, or anew at
# each call), by the call's identity key: those seen a second time live on, and get a binding of their own,
# which a warm entry can name (warm_entries); those made anew at each call never come twice. Held weakly
# where they can be (a dict cannot), bounded: the first seen go first.
_SEEN_ONCE: dict = {}
_SEEN_CAPACITY = 512
_BINDINGS.when_cleared(_SEEN_ONCE.clear)


def _adopted(signature, given: tuple, kept: Binding) -> Binding:
    key = (signature, *map(id, given))
    seen = _SEEN_ONCE.pop(key, None)
    if seen is not None and all(held() is value for held, value in zip(seen, given)):
        own = kept._replace(given=given, checks=tuple(_check(value) for value in given if value is not None))
        _BINDINGS.put(key, own)  # (it keeps `given` alive)
        return own
    if len(_SEEN_ONCE) >= _SEEN_CAPACITY:
        del _SEEN_ONCE[next(iter(_SEEN_ONCE))]
    _SEEN_ONCE[key] = tuple(map(_held, given))
    return kept


def _held(value):
    """A callable giving value back while it lives: a weak reference where value takes one."""
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


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


def remember(signature, options: dict, bound: BoundScoreMod | None, operands, planned: tuple,
             term=None) -> Binding:
    """This call's bound operands (operands: the plan's torch_plans.Operands; planned: the call's (cfg,
    selection, native plan)), kept for the next call with this signature whose callbacks read the same
    objects, unless the bound mod's tensors learn or the callbacks' reads cannot be known. term: a learning
    added term that runs as the plan's bias (bound: the mask beside it, or None): kept too, as each call
    sums it anew from its tensors' current values (their in-place updates are what training does)."""
    aux, scalars = operands.values(bound.values) if bound is not None else ([], [])
    aux = [x if x.data_ptr() % ALIGNMENT == 0 else aligned_copy(x) for x in aux]
    given = _given(options)
    reads = _reads_of(given)
    checks = tuple(_check(value) for value in given if value is not None)
    binding = Binding(given, reads, checks, () if bound is None else _watched(bound.mod), aux, scalars,
                      bound is not None and may_empty_rows(planned[0], bound), planned, term)
    learns = bound is not None and planned[0].is_training and needs_gradient(bound.mod)
    if signature is not None and reads is not None and not learns:
        _BINDINGS.put(_key(signature, reads), binding)
        _BINDINGS.put((signature, *map(id, given)), binding)  # (the binding keeps `given` alive)
    return binding


def forget() -> None:
    """Drop every binding: the native registry let a plan go, and bindings name plans by their ids."""
    _BINDINGS.clear()
