"""Score_mod calls inside a compiled graph: the native operator, its numbers baked in under guards.

While Dynamo traces a call with a flex-style callback or a ScoreMod, `plan` runs once, for real (an
assume_constant_result function, which Dynamo hands the callbacks themselves: a function or closure
as it is, an object it guards by identity): it validates, configures, selects, traces the callbacks,
builds the graphs and registers the native plan, and gives back the plan id, the numbers the graphs
read (pass-by-value scalars) and whether rows can be emptied. The traced graph then holds one
operator call with those numbers as constants. They stay right because `touch` reads, in the traced
code, what the callbacks read: Dynamo guards on it, so a new cap (a global, a closure cell, a
ScoreMod's number) recompiles, as a changed Python number does in any compiled function.

Tensors a flex callback reads as globals or from its closure (ALiBi's slopes, an index table) travel as
graph inputs: `plan` also says which global or closure cell holds each, the traced code fetches them
from there (Dynamo makes them inputs of the graph), and the custom op fusedattn::score_mod_aux turns them into
the operator's aux tensors on every run, as an eager call binds them (so new values in the same
tensors, or new tensors of the same shapes, are read; Dynamo guards on their shapes).

Not in the graph yet (they run eagerly, one graph break, with GRAPH_BREAK as the reason): tensors
captured by a callback made inside the compiled code (Dynamo, torch 2.11 to 2.13, cannot hand such a
closure to plan, nor its cells' contents to the traced code; a callback made outside it can be: its
cells are real), ScoreMods holding tensors, mods whose
tensors learn, tensors read through a helper or a container, cuDNN-native callbacks
score_mod(graph, score, tensors), and calls the native operator does not run (max_logit, ...). Sequence
offsets (THD, padding masks) are operands of the graph, read on the device as an eager call's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import types
from typing import NamedTuple

import torch

from fusedattn.cache import LRUCache, register
from fusedattn.score_mods.builtins import traced_constant
from fusedattn.score_mods.core import ScoreMod, as_score_mod, needs_gradient
from fusedattn.score_mods.flex import is_flex_score_mod
from fusedattn.torch import trace_time

__all__ = ["GRAPH_BREAK", "NOT_IN_GRAPH", "in_graph", "passed", "plan", "touch", "fetch", "captured",
           "score_mod_aux"]

API = "fusedattn.torch.attention"
GRAPH_BREAK = (
    "fusedattn.torch.attention with this score_mod runs eagerly inside a compiled model (one graph break). In "
    "the graph run flex-style callbacks (reading numbers, and tensors held in globals or in the closure of a "
    "callback made outside the compiled code) and ScoreMods whose values are numbers; tensors captured by a "
    "callback made inside the compiled code, ScoreMods holding tensors, mods that learn, cuDNN-native "
    "callbacks, and calls the native operator does not run are bound per call in Python. Compile with "
    "fullgraph=False; everything around the call still compiles.")
NOT_IN_GRAPH = (-1, (), False, (), "", (None, None), 0)
NO_NATIVE_OPERATOR = (-2, *NOT_IN_GRAPH[1:])  # as NOT_IN_GRAPH, for that reason (NO_NATIVE_BREAK)
NO_NATIVE_BREAK = (
    "fusedattn.torch.attention with this score_mod runs eagerly inside a compiled model (one graph break): the "
    "native cuDNN operator does not run this call here; it needs a CUDA device, selection picking cudnn and the "
    "native library built (`python -m fusedattn info` and fusedattn.explain say which is missing). Compile with "
    "fullgraph=False; everything around the call still compiles.")
API_AUX = "fusedattn::score_mod_aux"
_FIELDS = tuple(f.name for f in dataclasses.fields(ScoreMod))


def in_graph(given: dict) -> bool:
    """Whether a call's score_mod keywords are of the kinds that may run in a compiled graph: a callback
    (`plan` tells a cuDNN-native one from a flex one) or a ScoreMod of numbers, and a mask_mod; no
    tensors dicts. Runs in the traced code: nothing here inspects a function."""
    get = given.get
    if get("score_mod_bprop") is not None or get("score_mod_tensors") is not None:
        return False
    if get("score_mod_bprop_tensors") is not None:
        return False
    score_mod = get("score_mod")
    if isinstance(score_mod, ScoreMod):  # its values numbers only: tensors and arrays are bound per call
        return all(isinstance(v, numbers.Number) for v in _numbers(score_mod))
    return True


def _numbers(mod: ScoreMod) -> tuple:
    """A ScoreMod's values, a tuple of numbers (host ALiBi slopes) as its items."""
    values = (*mod.tensors.values(), *mod.bprop_tensors.values())
    return tuple(x for value in values for x in (value if isinstance(value, tuple) else (value,)))


def passed(score_mod):
    """What `plan` is handed for a score_mod: a ScoreMod as its fields (Dynamo hands plain values and
    functions over as they are, but no frozen dataclass), a callback as it is."""
    if isinstance(score_mod, ScoreMod):
        return tuple(_passed_field(score_mod, name) for name in _FIELDS)
    return score_mod


def _passed_field(mod: ScoreMod, name: str):
    """A ScoreMod's field as `passed` hands it over: a built-in's read-only tensors mapping as a dict (a
    constant), a composition's parts as their fields."""
    value = getattr(mod, name)
    if name == "tensors":  # (numbers read back as constants: a ScoreMod handed across a graph break is an input
        # of the resumed frame, where Dynamo may have made its numbers symbolic)
        return {key: _constant_numbers(x) for key, x in value.items()}
    if name == "parts":
        return tuple(map(passed, value))
    return value


def _constant_numbers(value):
    if isinstance(value, tuple):
        return tuple(map(_constant_numbers, value))
    return traced_constant(value) if isinstance(value, numbers.Number) else value


def _rebuilt(fields: tuple) -> ScoreMod:
    """The ScoreMod `passed` took apart."""
    values = dict(zip(_FIELDS, fields))
    return ScoreMod(**{**values, "parts": tuple(map(_rebuilt, values["parts"]))})


def touch(score_mod, mask_mod, like: torch.Tensor, reads: tuple = (None, None)) -> None:
    """Reads, in the traced code, what the callbacks read: flex callbacks run on one-element stand-ins (dead
    code the compiler drops; not 0-d, whose use as an index into a captured tensor Dynamo cannot trace), a
    ScoreMod's numbers are compared with themselves. Dynamo guards on each. reads (plan's): for a callback
    whose closure cells hold a captured tensor, the cells and globals to read instead of running it (Dynamo,
    torch 2.11 to 2.13, cannot both inline a callback and fetch from its cells in one trace)."""
    index = like.new_zeros((1,), dtype=torch.int64)
    if isinstance(score_mod, ScoreMod):
        for value in _numbers(score_mod):
            _guard(value)
    elif reads[0] is not None:
        _read(score_mod, None, reads[0])
    elif score_mod is not None:  # a flex callback (plan declined the others)
        score_mod(like.new_zeros((1,), dtype=torch.float32), index, index, index, index)
    if reads[1] is not None:
        _read(None, mask_mod, reads[1])
    elif mask_mod is not None:
        mask_mod(index, index, index, index)


def _guard(value) -> None:
    if isinstance(value, numbers.Number):
        torch._check(value == value or value != value)  # a guard on the number, nothing at run time


def _read(score_mod, mask_mod, sources: tuple) -> None:
    for source in sources:
        _guard(fetch(score_mod, mask_mod, source))


def captured(score_mod, mask_mod, like: torch.Tensor, sources: tuple, reads: tuple) -> list:
    """The traced code's part of a compiled score_mod call (plan gave sources and reads): touches what the
    callbacks read, and fetches their captured tensors, graph inputs of the compiled graph."""
    touch(score_mod, mask_mod, like, reads)
    return [fetch(score_mod, mask_mod, source) for source in sources]


@torch._dynamo.assume_constant_result
def plan(described: tuple, options: tuple, backend, grad_enabled: bool, score_mod, mask_mod, device) -> tuple:
    """(native plan id, scalars, empty_rows, sources, aux key, reads, offsets) of a compiled score_mod call,
    or NOT_IN_GRAPH when the call must run outside the graph (see the module's docstring). sources: where the
    callbacks read their captured tensors (see `fetch`), and the aux key names the binding score_mod_aux
    makes of them ("" without any); reads: see `touch`; offsets: how many sequence offset tensors the
    operator takes (cu_seqlens_q and _kv, then the padded ones: 0, 2 or 4), read on the device as an eager
    call's. score_mod: as `passed` gives it. Dynamo runs this once per distinct call."""
    if isinstance(score_mod, tuple):  # a ScoreMod's fields (passed)
        score_mod = _rebuilt(score_mod)
    try:
        return _plan(described, dict(options), backend, grad_enabled, score_mod, mask_mod, device)
    except Exception:  # the eager call outside the graph raises it again, with its own message
        return NOT_IN_GRAPH


def _plan(described, options, backend, grad_enabled, score_mod, mask_mod, device) -> tuple:
    from fusedattn.backends.cudnn.native import torch_plans
    from fusedattn.torch.functional import _native_plan_on
    from fusedattn.torch.score_mod_bindings import may_empty_rows

    if score_mod is not None and not isinstance(score_mod, ScoreMod) and not is_flex_score_mod(score_mod):
        return NOT_IN_GRAPH  # a cuDNN-native callback: its reads are not the traced code's to touch
    mod = as_score_mod(API, score_mod, mask_mod=mask_mod, framework="torch", device=device)
    if mod is None or needs_gradient(mod):
        return NOT_IN_GRAPH
    captured = {name: x for name, x in (*mod.tensors.items(), *mod.bprop_tensors.items())
                if isinstance(x, torch.Tensor)}
    sources = _sources((score_mod, mask_mod), captured) if captured else ()
    if sources is None:
        return NOT_IN_GRAPH  # a ScoreMod's tensors, or a tensor read through a helper or a container
    cfg, selection, _, bound, _ = trace_time.configure(described, options, backend, grad_enabled, mod)
    native = _native_plan_on(cfg, selection.name, device)
    operands = torch_plans.operands(cfg)
    if native is None:
        return NO_NATIVE_OPERATOR
    if bound is None or bool(operands.aux) != bool(captured):
        return NOT_IN_GRAPH  # (captured tensors that make no aux tensor are not followed: eager binds them)
    aux, scalars = operands.values(bound.values)
    offsets = (4 if cfg.padded_offsets else 2) if cfg.has_sequence_lengths else 0
    if not captured:
        return native, tuple(scalars), may_empty_rows(cfg, bound), (), "", (None, None), offsets
    reads = tuple(_reads_instead_of_call(fn, index, sources) for index, fn in enumerate((score_mod, mask_mod)))
    if False in reads:
        return NOT_IN_GRAPH  # a callback over a captured cell that also reads a helper or an object
    key = _remember_aux(mod, tuple(name for name, _ in sources), cfg, bound.key, aux)
    # The captured values can change between runs without a new trace: rows that may empty are cleared.
    empty_rows = may_empty_rows(cfg, bound) or any(x.is_floating_point() for x in captured.values())
    return native, tuple(scalars), empty_rows, tuple(source for _, source in sources), key, reads, offsets


# ---------------------------------------------------------------- captured tensors as graph inputs

def _sources(callbacks: tuple, captured: dict) -> tuple | None:
    """(name, source) for each captured tensor, where a flex callback reads it: (callback index, "global",
    name) or, for a callback made outside the compiled code, (callback index, "cell", position in its
    closure). None where one is read otherwise (a container, a helper) or a callback is a ScoreMod's fields,
    whose tensors dict the traced code cannot hand over."""
    found = []
    for name, tensor in captured.items():
        source = None
        for index, fn in enumerate(callbacks):
            if not isinstance(fn, types.FunctionType):
                continue
            for global_name in fn.__code__.co_names:
                if fn.__globals__.get(global_name) is tensor:
                    source = (index, "global", global_name)
            for position, cell in enumerate(fn.__closure__ or ()):
                if source is None and _cell_holds(cell, tensor):
                    source = (index, "cell", position)
            if source is not None:
                break
        if source is None:
            return None
        found.append((name, source))
    return tuple(found)


_PLAIN_VALUES = (numbers.Number, torch.Tensor, str, type(None))


def _reads_instead_of_call(fn, index: int, sources: tuple):
    """For `touch`: None where the traced code may run the callback (no captured tensor in its closure);
    else the sources of every cell and global it reads, all plain values (numbers, tensors), or False
    where it reads anything else (a helper function, an object), which only running it would follow."""
    if not any(source[:2] == (index, "cell") for _, source in sources):
        return None
    code = fn.__code__
    if any(isinstance(const, types.CodeType) for const in code.co_consts):
        return False  # a lambda or comprehension of its own, with reads of its own
    found = []
    for position, cell in enumerate(fn.__closure__):
        try:
            value = cell.cell_contents
        except ValueError:
            return False
        if not isinstance(value, _PLAIN_VALUES):
            return False
        found.append((index, "cell", position))
    for name in code.co_names:
        if name not in fn.__globals__ or isinstance(fn.__globals__[name], types.ModuleType):
            continue  # attribute names, builtins and modules (torch.tanh)
        if not isinstance(fn.__globals__[name], _PLAIN_VALUES):
            return False
        found.append((index, "global", name))
    return tuple(found)


def _cell_holds(cell, tensor) -> bool:
    try:
        return cell.cell_contents is tensor
    except ValueError:  # a cell not yet filled
        return False


def fetch(score_mod, mask_mod, source: tuple) -> torch.Tensor:
    """A captured tensor, read in the traced code where `plan` found it (Dynamo makes it a graph input and
    guards on it, so a closure's new tensor of another shape retraces)."""
    fn = (score_mod, mask_mod)[source[0]]
    if source[1] == "cell":
        return fn.__closure__[source[2]].cell_contents
    return fn.__globals__[source[2]]


class _AuxRecipe(NamedTuple):
    mod: ScoreMod  # the traced mod, its captured tensors replaced by each run's
    names: tuple  # the captured tensors' names in mod.tensors, in the order score_mod_aux gets them
    cfg: object  # the call's config: its shapes bind the mod, its operands order the aux tensors
    key: tuple  # the bound mod's structural key: a run binding anything else is refused
    metas: tuple  # (shape, strides, dtype) of each aux tensor, for the fake implementation


_AUX_RECIPES: LRUCache = register("torch.compiled.score_mod_aux", LRUCache(1024))


def _remember_aux(mod: ScoreMod, names: tuple, cfg, key: tuple, aux: list) -> str:
    recipe_key = f"{API_AUX}:{hashlib.sha1(repr((key, names, cfg)).encode()).hexdigest()[:24]}"
    metas = tuple((tuple(x.shape), tuple(x.stride()), x.dtype) for x in aux)
    _AUX_RECIPES.put(recipe_key, _AuxRecipe(mod, names, cfg, key, metas))
    return recipe_key


def _recipe(key: str) -> _AuxRecipe:
    recipe = _AUX_RECIPES.peek(key)
    if recipe is None:
        raise RuntimeError(f"{API_AUX}: the score_mod of compiled graph key {key!r} is no longer registered "
                           "(the 1024 most recent are kept); recompile the model (torch._dynamo.reset())")
    return recipe


@torch.library.custom_op(API_AUX, mutates_args=())
def score_mod_aux(key: str, captured: list[torch.Tensor]) -> list[torch.Tensor]:
    """The operator's aux tensors of a compiled flex score_mod call, bound from this run's captured tensors."""
    from fusedattn.backends.cudnn.alignment import ALIGNMENT, aligned_copy
    from fusedattn.backends.cudnn.native import torch_plans
    from fusedattn.score_mods.core import bind

    recipe = _recipe(key)
    cfg = recipe.cfg
    mod = dataclasses.replace(recipe.mod, tensors={**recipe.mod.tensors, **dict(zip(recipe.names, captured))})
    bound = bind(API, mod, batch=cfg.batch, heads_q=cfg.heads_q, seqlen_q=cfg.seqlen_q, seqlen_kv=cfg.seqlen_kv,
                 device=str(captured[0].device), training=cfg.is_training, like=captured[0])
    if bound.key != recipe.key:
        raise RuntimeError(f"{API}: a compiled score_mod's captured tensors now build another graph than the "
                           "one traced; recompile the model (torch._dynamo.reset())")
    aux, _ = torch_plans.operands(cfg).values(bound.values)
    storages = {x.untyped_storage().data_ptr() for x in captured}
    return [aligned_copy(x) if x.data_ptr() % ALIGNMENT or x.untyped_storage().data_ptr() in storages else x
            for x in aux]  # an op's outputs never alias its inputs


@score_mod_aux.register_fake
def _score_mod_aux_fake(key, captured):
    like = captured[0]
    return [like.new_empty_strided(shape, strides, dtype=dtype) for shape, strides, dtype in _recipe(key).metas]
