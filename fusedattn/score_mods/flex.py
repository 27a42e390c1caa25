"""Flex-style score_mod and mask_mod, written in torch or jax.numpy, as a ScoreMod.

    attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: 30 * torch.tanh(s / 30))
    attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 256)

The function is traced once by the framework's own tracer (trace_torch / trace_jax) into
our expression graph, together with its derivative in the score through the framework's vjp
(one trace: the derivative reads the forward's values), so nobody writes a backward. Both are
made lean (simplify) and lowered to cuDNN callbacks (lower_cudnn); the pieces that read
captured tensors become aux tensors (aux_plan). The
reference backend calls the user's functions themselves on broadcast index arrays: the
ground truth the lowered graph is tested against.

Traces are cached per function while the objects its closure, defaults and globals hold
stay the same ones, so a model calling attention with the same score_mod traces it once;
a new closure (a new cap) traces again, and builds nothing new: numbers are runtime scalars.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import operator
import sys
import types
import weakref
from dataclasses import dataclass

from fusedattn.cache import LRUCache, register
from fusedattn.score_mods.aux_plan import Aux, AuxPlan, aux_signature, index_grid, materialize, plan_aux
from fusedattn.score_mods.core import MASKED, ScoreMod, _differentiated, _wants_gradient, precision_of
from fusedattn.score_mods.expr import BOOL, FLOAT, INDEX_INPUTS, Builder, Expr, ExprError, dependencies
from fusedattn.score_mods.index_bounds import check_indices
from fusedattn.score_mods.lower_cudnn import CONSTANTS, LOWERING_VERSION, aux_name, lowered, scalar_name
from fusedattn.score_mods.mask_forms import MaskForms, mask_forms
from fusedattn.score_mods.simplify import simplified, simplified_with_map
from fusedattn.xp import namespace

__all__ = ["flex_score_mod", "is_flex_score_mod", "Traced", "trace", "trace_mask", "PartialMask", "reads_learners",
           "SCORE_ARGS", "MASK_ARGS", "plain_reads", "unchanged_reads", "snapshot", "same_objects", "flat_reads",
           "same_reads", "reads_key", "identity", "library_function", "fixed_reads", "reads_positions"]

SCORE_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_ARGS = ("b", "h", "q_idx", "kv_idx")
FORWARD, DERIVATIVE = "f.", "g."
_CAPTURED = "c"  # tensors-dict names of captured tensors: c0, c1, ... (replaced by aux when bound)
_CACHE_SIZE = 64


def _positional_count(fn) -> int | None:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in parameters)


def is_flex_score_mod(fn) -> bool:
    """A callable of five positional arguments: score_mod(score, b, h, q_idx, kv_idx)."""
    return callable(fn) and _positional_count(fn) == 5


@dataclass(frozen=True, eq=False)
class Traced:
    forward: Expr
    forward_plan: AuxPlan
    derivative: Expr | None  # None: the derivative in the score is exactly 1
    derivative_plan: AuxPlan | None
    added: tuple | None  # ((node X, sign), ...) when the forward is score +/- X +/- ... with each X free of it


def _modded(where, score_mod, mask_mod):
    """The score through score_mod, then -inf where mask_mod is False; `where` is the framework's."""
    def modded(score, b, h, q_idx, kv_idx):
        value = score if score_mod is None else score_mod(score, b, h, q_idx, kv_idx)
        if mask_mod is not None:
            value = where(mask_mod(b, h, q_idx, kv_idx), value, -math.inf)
        return value

    return modded


def _checked(api: str, name: str, fn):
    """fn, whose result must be an array of the framework: a float score (score_mod) or booleans (mask_mod)
    (else the reference met it as an unclear error of the framework's, or a cast)."""
    if fn is None:
        return None
    wanted = ("bool",) if name == "mask_mod" else ("float", "int")  # (an integer score is cast, as it was)

    def checked(*args):
        try:
            result = fn(*args)
        except IndexError as error:  # an array the callback makes itself (captured ones are checked at bind)
            raise ValueError(f"{api}: {name}: an index is out of range of an array it reads: {error}") from None
        if not hasattr(result, "shape"):
            dtype = f"a Python {type(result).__name__}"
        else:
            dtype = str(result.dtype)
        kind = "bool" if dtype.endswith("bool") else "float" if "float" in dtype else "int" if "int" in dtype else None
        if name == "score_mod" and kind == "bool" and hasattr(result, "shape"):
            raise ValueError(f"{api}: score_mod {getattr(fn, '__name__', type(fn).__name__)}: expected a float "
                             "score, got booleans; a mask goes as mask_mod=(b, h, q_idx, kv_idx) -> bool (True "
                             "keeps the key)")
        if not hasattr(result, "shape") or kind not in wanted:
            expected = ("a boolean array (True keeps the key)" if name == "mask_mod"
                        else "a float array (the modified score)")
            raise ValueError(f"{api}: {name}: expected it to return {expected}, got {dtype}")
        return result

    return checked


def _per_element(framework: str, api: str, name: str, fn):
    """fn applied to one score at a time, as FlexAttention applies it: a callback that does not trace
    (a reduction, sorting) runs so on the reference, where a reduction then sees one score, not the
    whole (B, Hq, Sq, Skv) matrix."""
    if fn is None:
        return None

    def one(*args):
        try:
            result = fn(*args)
        except Exception as error:
            if type(error).__name__ != "TracerArrayConversionError":
                raise
            raise ValueError(f"{api}: {name}: it reads a NumPy array at a traced index (NumPy cannot take JAX's "
                             "traced values); capture a JAX array instead (jnp.asarray(table))") from None
        if tuple(result.shape) != ():
            raise ValueError(f"{api}: {name}: expected one value per score (it is applied to one score at a "
                             f"time, as in FlexAttention), got an array of shape {tuple(result.shape)}")
        return result

    def run(*args):
        if framework == "torch":
            import torch

            shape, vmap = torch.broadcast_shapes(*(x.shape for x in args)), torch.vmap
            args = [x.expand(shape) for x in args]
        else:
            import jax
            import jax.numpy as jnp

            shape, vmap = jnp.broadcast_shapes(*(x.shape for x in args)), jax.vmap
            args = [jnp.broadcast_to(x, shape) for x in args]
        mapped = one
        for _ in shape:
            mapped = vmap(mapped)
        return mapped(*args)

    return run


def _joint_fn(framework: str, fn):
    """fn's score and its derivative applied to dscore, from one function: traced once, the forward's ops
    are recorded once and the derivative reads their values (the backward graph reuses the forward's)."""
    if framework == "torch":
        import torch

        def joint(score, dscore, b, h, q_idx, kv_idx):
            out, pullback = torch.func.vjp(lambda s: fn(s, b, h, q_idx, kv_idx), score)
            return out, pullback(dscore)[0]
    else:
        import jax

        def joint(score, dscore, b, h, q_idx, kv_idx):
            out, pullback = jax.vjp(lambda s: fn(s, b, h, q_idx, kv_idx), score)
            return out, pullback(dscore.astype(out.dtype))[0]  # out is float64 where x64 made it so
    return joint


def _added_term(expr: Expr) -> tuple | None:
    """((node X, sign), ...) when the output is the score plus or minus terms free of it (score + X,
    X - Y + score, (score + X) + Y): the sum its added term is (each X, Y one node)."""
    deps = dependencies(expr)
    terms: list = []
    scores = 0

    def walk(number: int, sign: float) -> bool:
        nonlocal scores
        node = expr.nodes[number]
        if node.op == "input" and node.attr == ("score",):
            scores += 1
            return sign > 0
        if "score" not in deps[number]:
            terms.append((number, sign))
            return True
        if node.op in ("add", "sub"):
            left, right = node.args
            return walk(left, sign) and walk(right, -sign if node.op == "sub" else sign)
        return False

    if expr.nodes[expr.output].op not in ("add", "sub") or not walk(expr.output, 1.0) or scores != 1:
        return None
    return tuple(terms)


def _tracer(framework: str, device):
    """A function (builder, fn, names) -> result nodes: fn traced into builder by its framework."""
    if framework == "torch":
        from fusedattn.score_mods.trace_torch import trace_torch_into

        return lambda builder, fn, names: trace_torch_into(builder, fn, names, device)
    from fusedattn.score_mods.trace_jax import trace_jax_into

    return trace_jax_into


def _traced_alone(trace, fn, names: list[str]) -> tuple[Builder, int]:
    builder = Builder()
    results = trace(builder, fn, names)
    if len(results) != 1:
        raise ExprError(f"expected one result, got {len(results)}")
    return builder, results[0]


def _trace_mask_now(framework: str, mask_mod, device) -> MaskForms:
    builder, output = _traced_alone(_tracer(framework, device), mask_mod, list(MASK_ARGS))
    if builder.kind(output) != BOOL:  # a 0/1 mask: nonzero keeps
        output = builder.op("cast", output, attr=(BOOL,))
    return mask_forms(builder.finish(output))


def _trace_score_mod(trace, framework: str, score_mod, builder: Builder) -> tuple[int, int]:
    """score_mod's score and derivative traced together into builder (their nodes)."""
    try:
        results = trace(builder, _joint_fn(framework, score_mod), ["score", "dscore", *SCORE_ARGS[1:]])
    except ExprError:
        _trace_forward_alone(trace, score_mod)  # the forward's own error first, where it has one
        raise
    if len(results) != 2 or builder.kind(results[0]) != FLOAT:
        _trace_forward_alone(trace, score_mod)
        raise ExprError("expected the score_mod to return one float score")
    return results[0], results[1]


def _trace_forward_alone(trace, score_mod) -> None:
    """Raises what is wrong with score_mod's forward: its trace's error, or a score that is not a float."""
    builder, output = _traced_alone(trace, score_mod, list(SCORE_ARGS))
    if builder.kind(output) != FLOAT:
        raise ExprError(f"expected the score_mod to return a float score, got a {builder.kind(output)}")


def _trace_now(framework: str, score_mod, mask_mod, device, kept) -> Traced:
    """score_mod and the kept conditions of mask_mod (all when kept is None) as one forward and one
    derivative: where(mask, score_mod(score), -inf) and where(mask, d score_mod/d score * dscore, 0).
    Both are built in one Builder, so the derivative can read the forward's values instead of
    recomputing them (measured: recomputing x = s / cap costs softcap's backward 6-10%)."""
    builder = Builder()
    score = builder.input("score", FLOAT)
    dscore = given_dscore = builder.input("dscore", FLOAT)
    if score_mod is not None:
        score, dscore = _trace_score_mod(_tracer(framework, device), framework, score_mod, builder)
    plain_derivative = dscore == given_dscore
    if mask_mod is not None:
        forms = trace_mask(framework, mask_mod, device)
        conditions = [n for i, (n, _) in enumerate(forms.conditions) if kept is None or i in kept]
        if conditions:
            condition = _all(builder, forms.expr, conditions)
            score = builder.op("where", condition, score, builder.scalar(-math.inf))
            dscore = builder.op("where", condition, dscore, builder.scalar(0.0))
            plain_derivative = False
    forward_expr, derivative_expr = _split(builder, score, None if plain_derivative else dscore)
    return Traced(forward_expr, plan_aux(forward_expr), derivative_expr,
                  None if derivative_expr is None else plan_aux(derivative_expr), _added_term(forward_expr))


def _split(builder: Builder, score: int, dscore: int | None) -> tuple[Expr, Expr | None]:
    """The simplified forward, and the simplified derivative reading the forward's values of the score
    (`forward` leaves) where the forward's graph computes them."""
    traced_forward = builder.finish(score)
    forward, kept = simplified_with_map(traced_forward)
    if dscore is None:
        return forward, None
    in_forward = builder.numbering(score)
    of_score = dependencies(traced_forward)
    shared = {number: kept[n] for number, n in in_forward.items()
              if builder.nodes[number].op not in _LEAVES and "score" in of_score[n] and n in kept}
    return forward, simplified(builder.finish(dscore, shared), forward)


_LEAVES = frozenset({"input", "scalar", "load"})


def masks_only(derivative: Expr | None) -> bool:
    """Whether a derivative is dscore where conditions free of the score hold and 0 elsewhere (a mask's):
    it differs from 1 only at masked entries, where the softmax's own gradient is 0 already."""
    if derivative is None:
        return False
    deps = dependencies(derivative)
    number = derivative.output
    while derivative.nodes[number].op == "where":
        condition, chosen, other = derivative.nodes[number].args
        other_node = derivative.nodes[other]
        free = not (deps[condition] - {"captured"} - set(INDEX_INPUTS))
        if not free or other_node.op != "scalar" or derivative.scalars[other_node.attr[0]] != 0:
            return False
        number = chosen
    node = derivative.nodes[number]
    return number != derivative.output and node.op == "input" and node.attr == ("dscore",)


def _all(builder: Builder, expr: Expr, conditions: list[int]) -> int:
    """The `and` of some conditions of expr, copied into builder."""
    copies = [builder.include(expr, n) for n in conditions]
    return functools.reduce(lambda a, b: builder.op("and", a, b), copies)


_PLAIN_VALUES = frozenset((int, float, bool, str, type(None)))  # read as themselves: no items, no reads


def _library_closure(value) -> bool:
    """A closure of this library (a built-in's function, or one joining others: score_mods.compose)."""
    return type(value) is types.FunctionType and value.__closure__ is not None and library_function(value)


def _expands(value, depth: int) -> bool:
    """Whether _value_snapshot looks inside `value` (a helper function's reads, a container's items, a
    library closure's cells, a user's object's attributes) rather than giving it as it is."""
    if type(value) in _PLAIN_VALUES:
        return False
    if isinstance(value, (dict, list, tuple)):
        return len(value) <= 64
    if _library_closure(value):
        return True
    if depth <= 0:
        return False
    if isinstance(value, _CODE):
        return not library_function(value)
    return _user_object(value)


_CODE = (types.FunctionType, types.MethodType)  # a helper function's reads are followed
_NOT_STATE = (type, types.ModuleType, *_CODE, types.BuiltinFunctionType, functools.partial)
_USER_TYPES: dict = {}  # type -> whether its instances are user objects (decided once per type: hot path)


_STANDARD = frozenset(sys.stdlib_module_names) | {"builtins"}
# module or class -> whether it is the user's (decided once each: hot path); weak, so classes made at run time
# are not kept alive by it
_USER_NAMESPACES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _user_namespace(value) -> bool:
    """A module or class of the user's (a config module, a class of constants): the attributes a callback
    names there (`cfg.window`, `Sizes.W`) are read like an object's. A framework's, this library's and the
    standard library's are not (torch.tanh, math.pi read as fixed)."""
    try:
        known = _USER_NAMESPACES.get(value)
    except TypeError:  # a class whose metaclass makes it unhashable or unreferenceable: decided each time
        known = None
    if known is None:
        name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None) or ""
        top = str(name).partition(".")[0]
        known = top not in _LIBRARIES and top not in _STANDARD
        try:
            _USER_NAMESPACES[value] = known
        except TypeError:
            pass
    return known


def _user_object(value) -> bool:
    """An object of the user's (a torch module, a config, a config module or class) whose attributes a
    callback may read as numbers (`self.window`): not a function or array, nor one of a framework's or this
    library's."""
    if isinstance(value, (types.ModuleType, type)):
        return _user_namespace(value)
    cls = type(value)
    known = _USER_TYPES.get(cls)
    if known is None:
        known = _USER_TYPES[cls] = (hasattr(value, "__dict__") and not issubclass(cls, _NOT_STATE)
                                    and not hasattr(value, "shape") and not library_function(cls))
    return known


# Where a torch module keeps what reads as its attributes besides its __dict__ (self.weight, self.block).
_MODULE_STORES = ("_parameters", "_buffers", "_modules")


def _attribute_reads(value, names: tuple, depth: int) -> tuple:
    """The attributes of a user's object named in the reading code (`self.window` puts "window" among its
    co_names), each with what of it the trace depends on: a number by value, an array or object by
    identity, and an object's own attributes in turn. A trace reads an attribute's value, which its
    object's identity does not show."""
    state = vars(value)
    stores = [state, *(state[name] for name in _MODULE_STORES if isinstance(state.get(name), dict))]
    if isinstance(value, type):  # a class's attributes include its bases' (Sizes.WINDOW set on a base)
        stores = [vars(cls) for cls in value.__mro__ if cls is not object]
    found = []
    for name in names:
        for store in stores:
            if name in store:
                found.append((name, _value_snapshot(store[name], depth - 1, names)))
                break
    return tuple(found)


def _value_snapshot(value, depth: int, names: tuple = ()):
    """What of a value the trace depends on: helper functions' own reads, containers' items, a user's
    object's attributes that the reading code names (names: its co_names), and of a library closure its
    code and cells, not the function: one made anew at each call (a built-in's, a composition's) reads
    what the last one read."""
    if not _expands(value, depth):
        return value
    if _library_closure(value):
        return ("library", value.__code__, tuple(_value_snapshot(c.cell_contents, depth) for c in value.__closure__))
    if isinstance(value, dict):
        return ("dict", value, tuple((k, _value_snapshot(v, 0)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("sequence", value, tuple(_value_snapshot(v, 0) for v in value))
    if isinstance(value, _CODE):
        return ("function", value, snapshot(value, depth - 1))
    return ("object", value, _attribute_reads(value, names, depth))


_LIBRARIES = frozenset(("fusedattn", "torch", "jax", "numpy"))
_LIBRARY_MODULES: dict = {}  # module name -> whether it is one of _LIBRARIES' (a repeat call asks again)


def library_function(fn) -> bool:
    """Whether fn is a function of this library or of a framework (score_mods.tanh, torch.where): its reads
    are its own business, never a user's state, so snapshots stop at it (a repeat call compares less)."""
    module = getattr(fn, "__module__", None) or ""
    found = _LIBRARY_MODULES.get(module)
    if found is None:
        found = _LIBRARY_MODULES[module] = module.partition(".")[0] in _LIBRARIES
    return found


_FIXED_READS = "_fusedattn_fixed_reads"  # kept on a function of this library: fixed_reads' answer


def fixed_reads(fn) -> bool:
    """Whether what fn reads can never change: a function of this library whose cells hold numbers,
    strings, tensors (by identity: in-place changes are the bindings' version checks), tuples of those
    and such functions (the built-ins' closures: none rebinds a cell). A user's function inside one (a
    mask_mod joined to a built-in's) can read new objects at any call: not fixed."""
    known = fn.__dict__.get(_FIXED_READS)
    if known is None:
        known = library_function(fn) and all(_fixed_value(c.cell_contents) for c in (fn.__closure__ or ()))
        fn.__dict__[_FIXED_READS] = known
    return known


def _fixed_value(value) -> bool:
    if type(value) in _PLAIN_VALUES or hasattr(value, "shape") or type(value) is types.BuiltinFunctionType:
        return True
    if type(value) is tuple:
        return all(map(_fixed_value, value))
    return type(value) is types.FunctionType and fixed_reads(value)


_DEPTH = 2  # how deep snapshots follow helper functions


def _defaults(fn):
    """A function's defaults, keyword-only ones too (`*, w=w`: both are read at every call)."""
    keyword_only = getattr(fn, "__kwdefaults__", None)
    return fn.__defaults__ if not keyword_only else (fn.__defaults__, tuple(keyword_only.items()))


def snapshot(fn, depth: int = _DEPTH) -> tuple | None:
    """The objects fn reads besides its arguments, compared by identity (helper functions it calls
    and items of dicts and lists it reads, two levels deep; only its closure for a function of this
    library or a framework); None if fn is not a plain function."""
    if type(fn) is types.FunctionType:  # the common case first: a repeat score_mod call reads this
        closure = fn.__closure__
        names = fn.__code__.co_names  # the globals and attributes it names
        cells = () if closure is None else tuple([_value_snapshot(c.cell_contents, depth, names) for c in closure])
        if library_function(fn):  # a built-in's callback: the names it reads are this library's own
            return (cells, _defaults(fn), ())
        read = fn.__globals__.get
        return (cells, _defaults(fn), tuple([_value_snapshot(read(n), depth, names) for n in names]))
    if fn is None:
        return ()
    if isinstance(fn, functools.partial):
        inner = snapshot(fn.func, depth)
        return None if inner is None else (inner, fn.args, tuple(fn.keywords.items()))
    if inspect.ismethod(fn):  # a bound method: the function, and the attributes of its object
        inner = snapshot(fn.__func__, depth)
        state = getattr(fn.__self__, "__dict__", {})
        return None if inner is None else (inner, _value_snapshot(state, 0))
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = tuple(_value_snapshot(c.cell_contents, depth, code.co_names) for c in (fn.__closure__ or ()))
    names = tuple(_value_snapshot(fn.__globals__.get(n), depth, code.co_names) for n in code.co_names)
    return (cells, _defaults(fn), names)


def plain_reads(fn, reads: tuple | None) -> bool:
    """Whether flat_reads(fn) gave `reads` as they lie in fn (its cells' contents, None for its defaults, its
    names' globals) with none looked inside: then unchanged_reads compares them in place."""
    if reads is None or type(fn) is not types.FunctionType or _defaults(fn) is not None:
        return False
    cells = 0 if fn.__closure__ is None else len(fn.__closure__)
    names = 0 if library_function(fn) else len(fn.__code__.co_names)
    return len(reads) == cells + 1 + names and not any(_expands(x, _DEPTH) for x in reads)


def reads_by_identity(fn) -> tuple | None:
    """(its cells' contents, the names it reads, their globals) for a plain function whose reads can be
    compared as they lie, each object by identity and each number by value: none is an object looked
    inside (plain_reads' condition), but for values fixed for good (numbers, arrays by identity, tuples of
    those and this library's functions of fixed reads). None where one must be looked inside."""
    if type(fn) is not types.FunctionType or _defaults(fn) is not None:
        return None
    try:
        cells = tuple([c.cell_contents for c in fn.__closure__ or ()])
    except ValueError:  # an empty cell
        return None
    names = () if library_function(fn) else fn.__code__.co_names
    values = tuple(map(fn.__globals__.get, names))
    if any(_expands(x, _DEPTH) and not _fixed_value(x) for x in (*cells, *values)):
        return None
    return cells, names, values


def unchanged_reads(fn, kept: tuple) -> bool:
    """For a fn whose reads were plain_reads: whether it reads the same objects now (flat_reads and
    same_reads without building either: a repeat score_mod call's check)."""
    closure = fn.__closure__
    cells = 0
    if closure is not None:
        cells = len(closure)
        for cell, was in zip(closure, kept):
            if cell.cell_contents is not was:
                return False
    if len(kept) == cells + 1:
        return True
    read = fn.__globals__.get
    for name, was in zip(fn.__code__.co_names, kept[cells + 1:]):
        if read(name) is not was:
            return False
    return True


def flat_reads(fn) -> tuple | None:
    """snapshot(fn) flattened to its objects, to compare item by item with `is` (None as snapshot's)."""
    if type(fn) is types.FunctionType and fn.__defaults__ is None and fn.__kwdefaults__ is None:
        # The common case (a user's callback over numbers, tensors and modules) without building the
        # snapshot: its flat form is the cells' contents, the defaults (None) and the names' values.
        closure = fn.__closure__
        reads = [] if closure is None else [c.cell_contents for c in closure]
        reads.append(None)
        if not library_function(fn):
            reads.extend(map(fn.__globals__.get, fn.__code__.co_names))
        expands = [_expands(x, _DEPTH) for x in reads]
        if not any(expands):
            return tuple(reads)
        if all([_user_object(x) for x, e in zip(reads, expands) if e]):  # a closure over `self`: its attributes
            return tuple(_with_attributes(reads, expands, fn.__code__.co_names))
    taken = snapshot(fn)
    if taken is None:
        return None
    found: list = []
    _flatten(taken, found)
    return tuple(found)


def _with_attributes(reads: list, expands: list, names: tuple) -> list:
    """reads with each user object flattened as its snapshot is."""
    flat: list = []
    for x, expanded in zip(reads, expands):
        if expanded:
            _flatten(_value_snapshot(x, _DEPTH, names), flat)
        else:
            flat.append(x)
    return flat


def same_reads(kept: tuple, now: tuple) -> bool:
    """Whether flat_reads-style tuples hold the same objects, item by item."""
    return len(now) == len(kept) and all(map(operator.is_, kept, now))


def reads_key(reads: tuple) -> tuple:
    """flat_reads' objects as a hashable key: each object by its identity (whoever keeps the key must keep
    the objects alive), each number, string or None by its type and value, so a number computed anew at
    each call is the same read while its value is (floats by their exact bits: -0.0 is not 0.0)."""
    return (tuple(map(type, reads)),
            tuple([x.hex() if type(x) is float else x if type(x) in _PLAIN_VALUES else id(x) for x in reads]))


def _flatten(item, found: list) -> None:
    for x in item:
        if type(x) is tuple:
            _flatten(x, found)
        else:
            found.append(x)


def identity(fn) -> tuple:
    """Who fn is, for a cache's key (with the objects it reads: the traces here, plans and bindings): a
    plain function by its code, so a closure made anew at each call, as a model's forward writes it,
    finds what was kept for the last one that read the same objects; a bound method (made anew at each
    attribute access) by its function and object; anything else by itself."""
    if type(fn) is types.FunctionType:
        return ("code", id(fn.__code__))
    if inspect.ismethod(fn):
        return (id(fn.__func__), id(fn.__self__))
    return (id(fn),)


def _same_callable(a, b) -> bool:
    """Whether b is a, a function with a's code or a's method of the same object (see identity)."""
    if a is b:
        return True
    if type(a) is types.FunctionType:
        return type(b) is types.FunctionType and a.__code__ is b.__code__
    return inspect.ismethod(a) and inspect.ismethod(b) and a.__func__ is b.__func__ and a.__self__ is b.__self__


def same_objects(a, b) -> bool:
    """Whether two snapshots hold the same objects, item by item."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(same_objects(x, y) for x, y in zip(a, b))
    return a is b


_TRACES: LRUCache = register("score_mods.flex.traces", LRUCache(_CACHE_SIZE))  # key -> (fns, snapshot, result)


def _cached(key: tuple, fns: tuple, build):
    """build() for these functions, cached under key while what they read stays the same objects."""
    taken = tuple(snapshot(fn) for fn in fns)
    cacheable = None not in taken
    if cacheable:
        # The objects read are part of the key (an entry holds them, so their ids stay theirs): closures of
        # one code over other objects (one per layer) each keep their trace.
        read: list = []
        _flatten(taken, read)
        key = (*key, tuple(map(id, read)))
        hit = _TRACES.get(key)
        if hit is not None and all(map(_same_callable, hit[0], fns)) and same_objects(hit[1], taken):
            return hit[2]
    result = build()
    if cacheable:
        _TRACES.put(key, (fns, taken, result))
    return result


def trace(framework: str, score_mod, mask_mod, device=None, kept: frozenset | None = None) -> Traced:
    """The traced forward and derivative of score_mod and mask_mod's kept conditions (numbers of
    trace_mask's conditions; None: all), cached while what the functions read stays.
    device: torch's device for the stand-ins (q's), beside the tensors the functions capture."""
    key = ("score", framework, identity(score_mod), identity(mask_mod), str(device), kept)
    return _cached(key, (score_mod, mask_mod), lambda: _trace_now(framework, score_mod, mask_mod, device, kept))


def reads_positions(framework: str, score_mod, device=None) -> bool:
    """Whether a score_mod's result may depend on b, q_idx or kv_idx (True also where that is not known:
    not a flex callback, or one that does not trace). One that reads only the score and h means the same
    in a document's THD call, whose b is the document and whose positions start at each document."""
    if not is_flex_score_mod(score_mod):
        return True
    try:
        forward = trace(framework, score_mod, None, device).forward
    except ExprError:
        return True
    return bool(dependencies(forward)[forward.output] & {"b", "q_idx", "kv_idx"})


def reads_learners(framework: str, score_mod) -> bool:
    """Whether a score_mod reads arrays being differentiated (True where what it reads is not known): its
    added term then runs as a bias, which a document's THD call cannot take."""
    reads = flat_reads(score_mod)
    if reads is None:
        return True
    if framework == "torch":
        import torch

        if not torch.is_grad_enabled():
            return False
    return any(_wants_gradient(x) for x in reads)


def trace_mask(framework: str, mask_mod, device=None) -> MaskForms:
    """mask_mod traced alone, and which of its conditions are native masks (cached as `trace`)."""
    key = ("mask", framework, identity(mask_mod), str(device))
    return _cached(key, (mask_mod,), lambda: _trace_mask_now(framework, mask_mod, device))


@dataclass(frozen=True, eq=False)
class PartialMask:
    """A mask_mod of which only the `kept` conditions (numbers of trace_mask's) run in the score_mod
    graph: the others run as the backends' own masks (mask_rewrite). Calls the whole mask_mod."""

    mask_mod: object
    kept: frozenset

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mask_mod(b, h, q_idx, kv_idx)


def _by_value(value):
    """A traced number as the float the graph reads; infinities become the finite mask value."""
    number = float(value)
    if math.isinf(number):
        return MASKED if number < 0 else -MASKED
    return number


def _selects_the_score(expr: Expr) -> bool:
    """Whether a select (where) picks the score or a value made from it: a mask. Selects of positions and
    numbers alone (a table written as selects) are values, which may_empty_rows reads as such."""
    deps = dependencies(expr)
    return any(node.op == "where" and "score" in deps[number] for number, node in enumerate(expr.nodes))


def _unfollowed_learners(api: str, framework: str, score_mod, captured: dict) -> tuple:
    """The arrays being differentiated (torch: requiring grad; JAX: a jax.grad tracer) that score_mod reads
    (flat_reads) and differentiates through, and that the trace does not load as captured arrays (captured:
    id -> the trace's): one indexed by numbers alone (t[0]), which the trace takes as a new constant, or any
    of an untraced mod's. No gradient would reach them (JAX: its tracer would leak into the attention's own
    custom_vjp). A mask_mod's values have no gradient; a torch tensor read only through .detach() is no
    learner (one eager call on stand-ins tells)."""
    if score_mod is None:
        return ()
    reads = flat_reads(score_mod) or ()
    if framework == "jax":
        found = {id(x): x for x in reads if _differentiated(x) and id(x) not in captured}
        return tuple(x for key, x in found.items() if key in _jax_used(score_mod)) if found else ()
    found = [x for x in reads if type(x).__module__.startswith("torch")
             and getattr(x, "requires_grad", False) and id(x) not in captured]
    if not found:
        return ()
    import torch

    try:  # which of them the score depends on: one eager call at index 0 (every axis has it)
        with torch.enable_grad():
            index = torch.zeros((), dtype=torch.int64, device=found[0].device)
            score = torch.zeros((), dtype=torch.float32, device=found[0].device)
            value = torch.as_tensor(score_mod(score, index, index, index, index))
            if not value.requires_grad:
                return ()
            reached = torch.autograd.grad(value.float().sum(), found, allow_unused=True)
    except IndexError as error:  # at index 0 on every axis: out of range in any call
        raise ValueError(f"{api}: score_mod: an index is out of range of an array it reads: {error}") from None
    except Exception:  # it cannot run on stand-ins: every such tensor counts
        return tuple({id(x): x for x in found}.values())
    return tuple({id(x): x for x, grad in zip(found, reached) if grad is not None}.values())


def _jax_used(score_mod) -> set | frozenset:
    """ids of the arrays a JAX score_mod's computation uses (its jaxpr's constants), of all it can reach: a
    params dict read for one entry holds others the score never touches. Everything, where it cannot be
    traced on stand-ins."""
    import jax
    import jax.numpy as jnp

    index, score = jnp.zeros((), jnp.int32), jnp.zeros((), jnp.float32)
    try:
        return {id(c) for c in jax.make_jaxpr(lambda *args: score_mod(*args))(score, index, index, index, index).consts}
    except Exception:
        return _EVERYTHING


class _Everything(frozenset):
    def __contains__(self, item) -> bool:
        return True


_EVERYTHING = _Everything()


def flex_score_mod(api: str, framework: str, score_mod=None, mask_mod=None, device=None,
                   mask_derivative_one: bool = False) -> ScoreMod:
    """A ScoreMod for flex-style callbacks; an ExprError's message becomes the cuDNN reason.

    mask_derivative_one: a derivative that only zeroes masked entries (masks_only) is left out (derivative
    1): right for a mask, as the softmax's gradient is 0 where it masks (rows it leaves without keys get
    +inf stats in every backward, see may_empty_rows), and what a mask_mod beside a learning bias needs, as
    cuDNN builds no backward with dBias beside a derivative graph."""
    for name, fn, count in (("score_mod", score_mod, 5), ("mask_mod", mask_mod, 4)):
        if fn is not None and (not callable(fn) or _positional_count(fn) not in (None, count)):
            args = ", ".join(SCORE_ARGS if count == 5 else MASK_ARGS)
            raise ValueError(f"{api}: {name}: expected a callable {name}({args}), got {fn!r:.80}")
    kept, given_mask = None, mask_mod
    if isinstance(mask_mod, PartialMask):
        mask_mod, kept = mask_mod.mask_mod, mask_mod.kept
    label = " and ".join(getattr(fn, "__name__", type(fn).__name__) for fn in (score_mod, mask_mod) if fn is not None)
    checked = _checked(api, "score_mod", score_mod), _checked(api, "mask_mod", mask_mod)

    def eager(ops, score, b, h, q_idx, kv_idx, values):  # the reference: the user's own functions, which
        return _modded(ops.where, *checked)(score, b, h, q_idx, kv_idx)  # traced, are elementwise

    try:
        traced = trace(framework, score_mod, mask_mod, device, kept)
    except ExprError as error:
        each = tuple(_per_element(framework, api, name, fn) for name, fn in zip(("score_mod", "mask_mod"), checked))

        def untraced(ops, score, b, h, q_idx, kv_idx, values):
            return _modded(ops.where, *each)(score, b, h, q_idx, kv_idx)

        return ScoreMod(None, eager=untraced, name=label, issue=f"{api}: {label}: {error}",
                        unfollowed=_unfollowed_learners(api, framework, score_mod, {}))
    derivative = traced.derivative
    if mask_derivative_one and masks_only(derivative):
        derivative = None
    exprs = [(FORWARD, traced.forward, traced.forward_plan)]
    if derivative is not None:
        exprs.append((DERIVATIVE, derivative, traced.derivative_plan))
    tensors = dict(CONSTANTS)
    for prefix, expr, _ in exprs:
        tensors.update({scalar_name(prefix, slot): _by_value(v) for slot, v in enumerate(expr.scalars)})
    # The captured tensors stay in the dict (needs_gradient reads them) until prepare makes the aux.
    captured = {id(a): a for _, expr, _ in exprs for a in expr.captured}
    tensors.update({f"{_CAPTURED}{i}": array for i, array in enumerate(captured.values())})

    originals = list(captured.values())

    def prepare(values: dict, shape: tuple, like):
        # The captured entries are the traced arrays, or others in their place (a compiled graph's inputs).
        swapped = {id(a): values[f"{_CAPTURED}{i}"] for i, a in enumerate(originals)
                   if values.get(f"{_CAPTURED}{i}", a) is not a}
        values = {n: v for n, v in values.items() if not n.startswith(_CAPTURED)}
        for _, expr, _ in exprs:
            check_indices(f"{api}: {label}", expr, shape)
        ops = namespace(like)
        grid = index_grid(ops, like, shape)
        dtype = precision_of(like)  # float64 calls run on the reference, which computes with these
        made: dict = {}  # the derivative often needs the forward's aux again (a mask's condition)
        for prefix, expr, plan in exprs:
            if swapped:
                expr = dataclasses.replace(expr, captured=tuple(swapped.get(id(a), a) for a in expr.captured))
            for number, entry in enumerate(plan.aux):
                same = aux_signature(expr, entry.node)
                if same not in made:
                    made[same] = materialize(expr, entry, ops, grid, dtype)
                values[aux_name(prefix, number)] = made[same]
        return values

    # The added term of the score_mod alone: a mask_mod beside it stays a score_mod (beside_bias) when the term
    # runs as a bias, so a term that learns keeps learning under any mask.
    termed, beside_bias = traced, None
    if traced.added is None and score_mod is not None and mask_mod is not None:
        alone = trace(framework, score_mod, None, device)
        if alone.added is not None:
            termed, beside_bias = alone, flex_score_mod(api, framework, None, given_mask, device,
                                                        mask_derivative_one=True)

    def as_bias(values: dict, shape: tuple, like, memo: dict | None = None):
        # memo: kept by a caller that sums the term again for the same shape and like's device and dtype
        # (a repeat call): the grid, the index arithmetic and the zeros it broadcasts onto are made once.
        memo = {} if memo is None else memo
        ops = namespace(like)
        if "grid" not in memo:  # (a gather out of range would be a device-side assert on a GPU)
            check_indices(f"{api}: {label}", termed.forward, shape)
            memo["grid"], memo["deps"] = index_grid(ops, like, shape), dependencies(termed.forward)
        grid, deps = memo["grid"], memo["deps"]
        dtype = precision_of(like)
        term = None
        for node, sign in termed.added:
            every_axis = Aux(node, tuple(a for a in INDEX_INPUTS if a in deps[node]), dense=True)
            value = materialize(termed.forward, every_axis, ops, grid, dtype, memo.setdefault(node, {}), views=True)
            value = value if sign == 1 else sign * value
            term = value if term is None else term + value
        full = (term.shape[0], term.shape[1], shape[2], shape[3])
        if tuple(term.shape) == full:  # (read only by the kernels: a kept value may be the bias itself)
            return term
        if "zeros" not in memo:
            memo["zeros"] = ops.full(full, 0.0, like, dtype)
        return term + memo["zeros"]

    forward = lowered(traced.forward, traced.forward_plan, FORWARD, derivative=False)
    bprop = None if derivative is None else lowered(derivative, traced.derivative_plan, DERIVATIVE, derivative=True)
    return ScoreMod(forward, bprop, tensors, eager=eager, prepare=prepare,
                    as_bias=as_bias if termed.added is not None else None, beside_bias=beside_bias, name=label,
                    unfollowed=_unfollowed_learners(api, framework, score_mod, captured),
                    structure=(LOWERING_VERSION, traced.forward.key, None if derivative is None else derivative.key),
                    masks=_selects_the_score(traced.forward))

