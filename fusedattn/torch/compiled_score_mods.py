"""Score_mod calls inside a compiled graph: the native operator, its numbers baked in under guards.

While Dynamo traces a call with a flex-style callback or a ScoreMod, `plan` runs once, for real (an
assume_constant_result function, which Dynamo hands the callbacks themselves: a function or closure
as it is, an object it guards by identity): it validates, configures, selects, traces the callbacks,
builds the graphs and registers the native plan, and gives back the plan id, the numbers the graphs
read (pass-by-value scalars) and whether rows can be emptied. The traced graph then holds one
operator call with those numbers as constants. They stay right because `touch` reads, in the traced
code, what the callbacks read: Dynamo guards on it, so a new cap (a global, a closure cell, a
ScoreMod's number) recompiles, as a changed Python number does in any compiled function.

Not in the graph yet (they run eagerly, one graph break, with GRAPH_BREAK as the reason): mods that
bind aux tensors (captured tensors such as ALiBi's slopes, index tables), mods whose tensors learn,
cuDNN-native callbacks score_mod(graph, score,
tensors), and calls the native operator does not run (sequence lengths, max_logit, ...).
"""

from __future__ import annotations

import dataclasses
import numbers

import torch

from fusedattn.score_mods.core import ScoreMod, as_score_mod, needs_gradient
from fusedattn.score_mods.flex import is_flex_score_mod
from fusedattn.torch import trace_time

__all__ = ["GRAPH_BREAK", "NOT_IN_GRAPH", "in_graph", "passed", "plan", "touch"]

API = "fusedattn.torch.attention"
GRAPH_BREAK = (
    "fusedattn.torch.attention with this score_mod runs eagerly inside a compiled model (one graph break). In "
    "the graph run flex-style callbacks and ScoreMods made outside the compiled function whose values are "
    "numbers; mods that bind aux tensors (captured tensors, index tables) or learn, cuDNN-native callbacks, "
    "and calls the native operator does not run are bound per call in Python. Compile with fullgraph=False; "
    "everything around the call still compiles.")
NOT_IN_GRAPH = (-1, (), False)
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
        return all(isinstance(v, numbers.Number) for v in (*score_mod.tensors.values(),
                                                           *score_mod.bprop_tensors.values()))
    return True


def passed(score_mod):
    """What `plan` is handed for a score_mod: a ScoreMod as its fields (Dynamo hands plain values and
    functions over as they are, but no frozen dataclass), a callback as it is."""
    if isinstance(score_mod, ScoreMod):
        return tuple(getattr(score_mod, name) for name in _FIELDS)
    return score_mod


def touch(score_mod, mask_mod, like: torch.Tensor) -> None:
    """Reads, in the traced code, what the callbacks read: flex callbacks run on 0-d stand-ins (dead code
    the compiler drops), a ScoreMod's numbers are compared with themselves. Dynamo guards on each."""
    index = like.new_zeros((), dtype=torch.int64)
    if isinstance(score_mod, ScoreMod):
        for value in (*score_mod.tensors.values(), *score_mod.bprop_tensors.values()):
            if isinstance(value, numbers.Number):
                torch._check(value == value or value != value)  # a guard on the number, nothing at run time
    elif score_mod is not None:  # a flex callback (plan declined the others)
        score_mod(like.new_zeros((), dtype=torch.float32), index, index, index, index)
    if mask_mod is not None:
        mask_mod(index, index, index, index)


@torch._dynamo.assume_constant_result
def plan(described: tuple, options: tuple, backend, grad_enabled: bool, score_mod, mask_mod, device) -> tuple:
    """(native plan id, scalars, empty_rows) of a compiled score_mod call, or NOT_IN_GRAPH when the call
    must run outside the graph (see the module's docstring). score_mod: as `passed` gives it. Dynamo
    runs this once per distinct call."""
    if isinstance(score_mod, tuple):  # a ScoreMod's fields (passed)
        score_mod = ScoreMod(*score_mod)
    if any(entry is not None for entry in described[6:]):
        return NOT_IN_GRAPH  # the operator does not run a score_mod with sequence lengths
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
    if any(isinstance(v, torch.Tensor) for v in (*mod.tensors.values(), *mod.bprop_tensors.values())):
        return NOT_IN_GRAPH  # captured tensors become aux tensors, bound per call
    cfg, selection, _, bound = trace_time.configure(described, options, backend, grad_enabled, mod)
    native = _native_plan_on(cfg, selection.name, device)
    operands = torch_plans.operands(cfg)
    if native is None or bound is None or operands.aux:
        return NOT_IN_GRAPH
    _, scalars = operands.values(bound.values)
    return native, tuple(scalars), may_empty_rows(cfg, bound)
