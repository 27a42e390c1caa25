"""Repeat calls answered in C: the warm entries (backends/cudnn/native/warm_entries.h).

A repeat call's Python (its signature, the plan cache, a score_mod's binding and their checks) costs
more host time than the operator it leads to. Once Python has answered a call from those caches, it
hands the answer (the operator's plan and operands) to the native library under a key made of the
call itself: q, k, v (and a bias or sink: shapes, strides, dtypes, devices, requires_grad), every
other keyword with its type and value (a callback by its code, globals and closure contents, functions
and tuples there by what they are made of too, so a closure made anew at each call over the same objects
keys alike; a built-in ScoreMod, or a compose() of built-ins, by what it is made of, MADE_OF, likewise;
other ScoreMods and dicts by identity), the grad mode and the settings the
signature reads. Guards go with it: what the callbacks read (cells and globals:
objects by identity, numbers by value; this library's functions of fixed reads by identity too), the
dicts a ScoreMod or score_mod_tensors holds, and the tensors a mod holds (version, requires_grad).
The next call with that key whose guards hold runs the operator from C; anything else misses and
takes the Python path.

Only answers the Python path keeps can be handed over, and only those whose reads the guards can
check: a plain call, a mask_mod whose rewrite is kept, a document mask_mod run as THD (BSHD; its ids
guarded by their version), or a score_mod call whose binding was made by the very objects given or
by callbacks keyed alike (not by another identity-keyed ScoreMod: one made anew at each call keys anew),
whose callbacks read plainly (no object looked inside: a closure over `self` stays in Python) and whose
term does not learn.
Calls with other tensor keywords (ALiBi slopes, sequence offsets), a dropout seed or offset given,
packed layouts and rows without keys keep the Python path (dropout with neither draws its seed in C
from torch's default generator, as the Python path does). A returned LSE or max_logit comes back as
a tuple that Python makes the AttentionResult. The entries are dropped whenever the caches behind
them are (plans, bindings, rewrites, decisions; cache.clear_all too).
"""

from __future__ import annotations

import types

from fusedattn.arguments import ENV_THD_BUCKET
from fusedattn.backends.cudnn.native import torch_plans
from fusedattn.cache import registry
from fusedattn.options import DROPOUT_NAMES
from fusedattn.score_mods.core import MADE_OF, ScoreMod
from fusedattn.score_mods.flex import PartialMask, reads_by_identity
from fusedattn.selection import ENV_BACKEND
from fusedattn.torch import score_mod_bindings

__all__ = ["configure", "remember", "clear", "size"]

SETTINGS = (ENV_BACKEND, ENV_THD_BUCKET)  # the environment settings a call's signature reads
IDENTITY_TYPES = (ScoreMod, dict)  # keyword values a key names by identity (a function: by what it is made of)
# Entries kept (all dropped when one more comes): a model has a few dozen distinct calls. An entry holds
# its score_mod's aux tensors, as the bindings do (score_mod_bindings.CAPACITY): bounded alike.
CAPACITY = 2 * score_mod_bindings.CAPACITY
_DROPOUT_STATE = frozenset(DROPOUT_NAMES)  # a call giving a seed or offset keeps the Python path
# Bindings whose reads C cannot check (by id, held): a call of theirs does not try again. Bounded.
_UNGUARDED: dict = {}
_UNGUARDED_CAPACITY = 256


def configure(module) -> bool:
    """Tells the library's warm entries what a key reads (on loading it); False where the library has no
    warm entries of this version (a prebuilt one named by FUSEDATTN_NATIVE_LIB_TORCH): calls keep the
    Python path, the operator still runs them."""
    try:
        module.warm_configure(SETTINGS, IDENTITY_TYPES, CAPACITY, MADE_OF)
    except (AttributeError, TypeError):
        return False
    return True


def remember(q, k, v, keywords: dict, cfg, plan, binding=None, given: tuple = (), documents=None,
             offsets: list | None = None) -> None:
    """Hands a warm call's answer to C where it can check the answer's reads. keywords: the call's own
    (before a flex built-in became its functions); binding: the score_mod binding the call used, and
    given: the score_mod keywords' values it was looked up with (SCORE_MOD_NAMES' order). documents: a
    document mask run as THD (its ids are guarded by their version) with the THD plan's offsets."""
    remember_in_c = torch_plans.warm_remember
    dropout = cfg.dropout_p > 0.0
    if (remember_in_c is None or type(plan) is not int or v is None
            or cfg.has_sequence_lengths != (documents is not None)
            or (dropout and not _DROPOUT_STATE.isdisjoint(keywords))):
        return  # (a seed or offset given: Python reads them each call)
    aux, scalars, empty_rows, watched, read = [], [], False, (), tuple(keywords.values())
    if binding is not None:
        if binding.term is not None or len(given) != len(binding.given) or not all(
                _keyed_alike(bound_by, value, read) for bound_by, value in zip(binding.given, given)):
            return  # a learning term (summed anew each call), or bound by another ScoreMod (found by its code)
        if _UNGUARDED.get(id(binding)) is binding:
            return
        aux, scalars, empty_rows, watched = binding.aux, binding.scalars, binding.empty_rows, binding.watched
        read += binding.given
    functions: list = []
    dicts: list = []
    for value in read:
        if not _guard(value, functions, dicts):
            if binding is not None:
                if len(_UNGUARDED) >= _UNGUARDED_CAPACITY:
                    _UNGUARDED.clear()
                _UNGUARDED[id(binding)] = binding  # (held: its id stays its own) not tried again
            return
    tensors = list(watched)
    if documents is not None:  # the offsets were read from these ids as they are now
        tensors.append((documents.ids, documents.ids._version, documents.ids.requires_grad))
    remember_in_c(q, k, v, keywords, plan, aux, scalars, empty_rows, tuple(functions), tuple(dicts), tuple(tensors),
                  offsets or [], (cfg.return_lse, cfg.return_max_logit, dropout))


def _keyed_alike(bound_by, given, keywords: tuple) -> bool:
    """Whether a binding made with `bound_by` answers a call given `given` under the same key: the same
    object, or two functions (their reads matched when the binding was found) where `given` is a keyword's
    value or a function of a built-in given (a ScoreMod that names what it is made of: MADE_OF), which the
    key reads by code, globals and closure contents. Any other ScoreMod is keyed by identity: one made anew
    at each call must not add an entry each call."""
    if bound_by is given:
        return True
    return (type(bound_by) is types.FunctionType and type(given) is types.FunctionType
            and any(given is value or (type(value) is ScoreMod and MADE_OF in value.__dict__
                                       and any(given is part for part in value.flex)) for value in keywords))


def _guard(value, functions: list, dicts: list) -> bool:
    """Adds the guards of one keyword's value: False where its reads cannot be checked in C."""
    if value is None or type(value) in (int, float, bool, str, tuple) or hasattr(value, "shape"):
        return True  # (a bias or sink: an operand of the call, keyed by its shape and kind)
    if type(value) is types.FunctionType:
        reads = reads_by_identity(value)
        if reads is None:
            return False  # it reads objects looked inside (a closure over `self`): Python checks those
        functions.append((value, *reads))
        return True
    if type(value) is ScoreMod:  # its fields are frozen: what can change is its dicts and what callbacks read
        if not score_mod_bindings.fixed_but_dicts(value):
            callbacks = (value.forward, value.bprop, value.prepare)  # (what the bindings compare)
            if value.parts or not all(fn is None or type(fn) is types.FunctionType for fn in callbacks):
                return False  # a composition, or a callable object: Python checks those
            if not all(_guard(fn, functions, dicts) for fn in callbacks):
                return False
        return all(_guard(part, functions, dicts) for part in (value.tensors, value.bprop_tensors, *value.flex))
    if type(value) is dict:
        dicts.append((value, tuple(value), tuple(value.values())))
        return True
    if type(value) is PartialMask:  # a kept rewrite's: what it reads is its mask_mod's
        return _guard(value.mask_mod, functions, dicts)
    return type(value) is types.MappingProxyType  # a built-in's own copy, read-only: fixed


def clear() -> None:
    """Drops every warm entry (the caches behind them were cleared)."""
    if torch_plans.warm_clear is not None:
        torch_plans.warm_clear()


for _behind in ("selection.calls", "torch.score_mod.bindings", "torch.mask_mod.rewrites"):  # the caches behind
    registry[_behind].when_cleared(clear)


def size() -> int:
    return 0 if torch_plans.warm_size is None else torch_plans.warm_size()
