"""What a score_mod is, and how one call binds it to its aux tensors.

A `ScoreMod` rewrites the scaled attention scores inside the fused kernel. Its main form
is cuDNN-native: `forward(graph, score, tensors) -> tensor` builds graph ops on the score
(B, Hq, Sq, Skv); an optional `bprop(graph, dscore, tensors)` maps dLoss/d(output of
forward) to dLoss/d(score). The reference backend runs the same callbacks eagerly
(`EagerGraph`), or a built-in's `eager` twin. A mod made by `eager(fn)` has only a
FlexAttention-style `fn(score, b, h, q_idx, kv_idx)` and runs on the reference only.

Binding happens once per call: aux entries are checked and normalised (arrays to 4-D,
scalars to `RuntimeScalar`), and the structural key (what the callbacks build, see
`key.py`) goes into the config. The config keeps a `GraphRecipe`: the callbacks and
the aux descriptions, never the aux values, so caches do not hold user tensors.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from fusedattn.config import UNBOUNDED
from fusedattn.score_mods.key import describe_aux, structural_key

__all__ = ["ScoreMod", "eager", "BoundScoreMod", "GraphRecipe", "RuntimeScalar", "as_score_mod", "bind",
           "needs_gradient", "may_empty_rows", "MASKED", "MASKED_BELOW", "EAGER_ONLY_KEY"]

# The score a mask writes. Finite on purpose: a tile whose every score is masked then
# keeps a finite running max inside the kernel; rows with no visible key are found from
# their LSE (below MASKED_BELOW) and given output 0 and LSE -inf, as the library promises.
MASKED = -1.0e9
MASKED_BELOW = -1.0e8
# Where a built-in ScoreMod keeps what it is made of: (name, masks, score_mod, mask_mod), or ("compose", what
# each part is made of) for a composition of built-ins, so equal built-ins made anew at each call key a warm
# entry alike (torch/warm_entries.py; a copy or pickle leaves it behind).
MADE_OF = "_warm_made_of"
# Config key of a mod with no graph form (reference only); see backends/cudnn/spec.py.
EAGER_ONLY_KEY = ("eager-only score_mod",)


@dataclass(frozen=True, eq=False)
class ScoreMod:
    """A score modification: graph callbacks, their aux tensors, and an eager twin.

    forward(graph, score, tensors) -> tensor: cuDNN-native graph ops on the scaled score.
    bprop(graph, dscore, tensors) -> tensor: the derivative, applied to dLoss/d(output);
        None means derivative 1, right for added terms and masks, wrong for anything
        nonlinear in the score (softcap, scaling by a tensor...).
    tensors / bprop_tensors: {name: array | number}; arrays broadcast to (B, Hq, Sq, Skv).
        The callbacks get one dict holding both; forward may store intermediates in it
        for bprop.
    eager(ops, score, b, h, q_idx, kv_idx, tensors) -> score: a twin in array ops that
        the reference backend uses instead of running the callbacks.
    prepare(tensors, shape, like) -> tensors: per-call derived tensors (for example a
        relative-position table expanded to (1, H, Sq, Skv)); shape is (B, Hq, Sq, Skv) and
        like is q (the framework and device of new arrays).
    as_bias(tensors, shape, like, memo=None) -> array: for a mod that only adds a term, that
        term as a post-scale bias. A call whose tensors need a gradient runs it as `bias=` (which
        has one) instead of a score_mod (whose tensors have none). memo: a dict the caller keeps
        between calls of one shape, device and dtype, where the mod may keep what does not learn.
    """

    forward: Callable | None
    bprop: Callable | None = None
    tensors: Mapping[str, Any] = field(default_factory=dict)
    bprop_tensors: Mapping[str, Any] = field(default_factory=dict)
    eager: Callable | None = None
    prepare: Callable | None = None
    as_bias: Callable | None = None
    name: str = "score_mod"
    host: tuple[str, ...] = ()  # tensors given as NumPy arrays, made arrays of q's framework when bound
    issue: str | None = None  # why a mod without graph callbacks has none (a flex callback we cannot trace)
    # A traced flex mod: what its callbacks build, known without recording them; its bprop comes
    # from the framework's autodiff (None: derivative exactly 1).
    structure: tuple | None = None
    # Whether the mod writes the mask's score through a select (a causal or document mask, a flex
    # where(..., -inf)), so a row can lose every key; False: it only computes with its values (which
    # may still be large, see torch/score_mod_bindings.py); None: not known.
    masks: bool | None = None
    # The mods a composition applies in turn (score_mods.compose): its callbacks read nothing else,
    # so a composition made anew of equal mods is the same mod (torch/score_mod_bindings.py).
    parts: tuple = ()
    # A built-in defined in flex form (builtins.py): (score_mod, mask_mod), flex-style functions (either may
    # be None). The frontends call them as those keywords (flex_keywords), so its masks become native masks.
    flex: tuple = ()
    # Tensors that require grad which the callbacks read but the graph does not load (t[0], traced as a new
    # constant): a call that trains is refused (refuse_unfollowed), since no gradient would reach them.
    unfollowed: tuple = ()
    # What stays a score_mod when as_bias takes the added term (a flex mask_mod beside it); None: nothing.
    beside_bias: ScoreMod | None = None

    def __repr__(self) -> str:
        return f"ScoreMod({self.name})"

    def __getstate__(self) -> dict:
        # Only the fields: what other modules keep on a mod for this process (torch/score_mod_bindings.py's
        # signature part holds ids) stays behind in a copy or a pickle.
        return {f.name: getattr(self, f.name) for f in fields(self)}


def eager(fn: Callable, name: str | None = None) -> ScoreMod:
    """A FlexAttention-style fn(score, b, h, q_idx, kv_idx) -> score, for the reference backend only.

    The index arguments broadcast against score (B, Hq, Sq, Skv); fn uses the framework's
    own ops. Fused backends cannot run Python on their scores and say so in their reasons.
    """
    if not callable(fn):
        raise ValueError(f"score_mods.eager: expected a callable fn(score, b, h, q_idx, kv_idx), got {fn!r}")
    return ScoreMod(forward=None, eager=lambda ops, s, b, h, qi, ki, tensors: fn(s, b, h, qi, ki),
                    name=name or getattr(fn, "__name__", "eager"))


class RuntimeScalar:
    """A number passed by value at run time: changing it never rebuilds a graph."""

    __slots__ = ("value", "dtype")

    def __init__(self, value, dtype: str):
        self.value, self.dtype = value, dtype

    def __repr__(self) -> str:
        return f"RuntimeScalar({self.value!r}, {self.dtype})"


def may_empty_rows(cfg, bound: BoundScoreMod, is_float_array: Callable, arrays_may_mask: Callable) -> bool:
    """Whether a fused call must give the rows a score_mod left without keys output 0 and LSE -inf.

    Yes when the mod selects the mask's score (ScoreMod.masks), is not known to, or computes with a
    number of the mask's magnitude, or with float arrays that arrays_may_mask(list) says may hold one
    (a framework that cannot read them says yes); also when the graph's own window can leave a query
    past the keys (Sq > Skv, or a sequence with more queries than keys). Otherwise the scores are the
    mod's arithmetic on finite values and every row's softmax is what the float64 definition gives."""
    past_keys = cfg.seqlen_q > cfg.seqlen_kv and cfg.window != (UNBOUNDED, UNBOUNDED)
    # (sequences' diagonals are top-left: spec.py declines padding with bottom-right ones)
    past_sequences_keys = cfg.has_sequence_lengths and cfg.window[0] != UNBOUNDED
    if bound.mod.masks is not False or past_keys or past_sequences_keys:
        return True
    arrays = []
    for value in bound.values.values():
        if isinstance(value, RuntimeScalar):
            if not abs(value.value) < -MASKED_BELOW:  # NaN too
                return True
        elif is_float_array(value):
            arrays.append(value)
    return bool(arrays) and arrays_may_mask(arrays)


@dataclass(frozen=True, eq=False)
class GraphRecipe:
    """What a graph build needs of a score_mod: the callbacks and how each aux entry looks."""

    forward: Callable
    bprop: Callable | None
    aux: tuple  # ((name, description), ...) with descriptions from key.describe_aux
    # Without a bprop, why the forward's derivative in the score is not 1 (None: it is). cuDNN
    # would apply derivative 1, so the cudnn backend refuses such a call for training.
    derivative_issue: str | None = None


@dataclass(frozen=True, eq=False)
class BoundScoreMod:
    """A score_mod with this call's aux values, its config key, and its graph recipe."""

    mod: ScoreMod
    values: dict  # name -> 4-D array or RuntimeScalar
    key: tuple
    recipe: GraphRecipe | None  # None for eager-only mods


def as_score_mod(api: str, score_mod, score_mod_bprop=None, score_mod_tensors=None,
                 score_mod_bprop_tensors=None, mask_mod=None, *, framework: str = "torch",
                 device=None) -> ScoreMod | None:
    """The frontends' score_mod keywords as one ScoreMod (or None), with clear errors.

    A score_mod(score, b, h, q_idx, kv_idx) or a mask_mod(b, h, q_idx, kv_idx) in the user's
    framework is traced (score_mods.flex; torch on `device`, q's); a score_mod(graph, score,
    tensors) is cuDNN-native.
    """
    extras = {"score_mod_bprop": score_mod_bprop, "score_mod_tensors": score_mod_tensors,
              "score_mod_bprop_tensors": score_mod_bprop_tensors}
    given = [name for name, value in extras.items() if value is not None]
    from fusedattn.score_mods.flex import flex_score_mod, is_flex_score_mod

    if mask_mod is not None or is_flex_score_mod(score_mod):
        if given:
            raise ValueError(f"{api}: {given[0]}: expected None with a flex-style score_mod(score, b, h, q_idx, "
                             "kv_idx) or mask_mod (they read captured tensors and numbers themselves, and their "
                             f"derivative is derived), got {type(extras[given[0]]).__name__}")
        if score_mod is not None and not is_flex_score_mod(score_mod):
            raise ValueError(f"{api}: score_mod: expected a flex-style score_mod(score, b, h, q_idx, kv_idx) with "
                             f"a mask_mod, got {score_mod!r:.80}; compose a ScoreMod or cuDNN-native callback with "
                             "masks through score_mods.compose instead")
        return flex_score_mod(api, framework, score_mod, mask_mod, device)
    if score_mod is None:
        if given:
            got = type(extras[given[0]]).__name__
            raise ValueError(f"{api}: {given[0]}: expected None without a score_mod, got {got}")
        return None
    if isinstance(score_mod, ScoreMod):
        if given:
            raise ValueError(f"{api}: {given[0]}: expected None with a ScoreMod (it carries its own callbacks and "
                             f"tensors), got {type(extras[given[0]]).__name__}")
        return _resolved(api, score_mod, framework, device)
    if not callable(score_mod):
        raise ValueError(f"{api}: score_mod: expected a callable score_mod(score, b, h, q_idx, kv_idx), a "
                         "cuDNN-native score_mod(graph, score, tensors) or a fusedattn.score_mods.ScoreMod, got "
                         f"{type(score_mod).__name__}")
    if score_mod_bprop is not None and not callable(score_mod_bprop):
        raise ValueError(f"{api}: score_mod_bprop: expected a callable score_mod_bprop(graph, dscore, tensors) or "
                         f"None, got {type(score_mod_bprop).__name__}")
    for name in ("score_mod_tensors", "score_mod_bprop_tensors"):
        value = extras[name]
        if value is not None and (not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value)):
            raise ValueError(f"{api}: {name}: expected a dict of str -> tensor or number, got {value!r:.80}")
    return ScoreMod(forward=score_mod, bprop=score_mod_bprop, tensors=dict(score_mod_tensors or {}),
                    bprop_tensors=dict(score_mod_bprop_tensors or {}),
                    name=getattr(score_mod, "__name__", type(score_mod).__name__))


def _resolved(api: str, mod: ScoreMod, framework: str, device) -> ScoreMod:
    """A ScoreMod with graph callbacks: a flex-form built-in traced for this framework (named as the
    built-in), a composition of such with cuDNN-native mods composed of their traced forms."""
    if mod.flex:
        from fusedattn.score_mods.flex import flex_score_mod

        return replace(flex_score_mod(api, framework, *mod.flex, device), name=mod.name)
    if mod.forward is None and mod.parts:
        from fusedattn.score_mods.builtins import compose_native

        return replace(compose_native(*(_resolved(api, part, framework, device) for part in mod.parts)),
                       parts=mod.parts)
    return mod


_ARRAY_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32", "float64": "float32",
                 "int32": "int32", "int64": "int32", "bool": "int32", "uint8": "int32", "int16": "int32",
                 "int8": "int32"}


def _differentiated(value) -> bool:
    """A JAX array being differentiated (under jax.grad/jvp): its gradient would be asked for."""
    while value is not None and type(value).__module__.startswith("jax"):
        if type(value).__name__ in ("JVPTracer", "LinearizeTracer"):
            return True
        value = getattr(value, "primal", None)
    return False


def _wants_gradient(value) -> bool:
    """A tensor that asks for a gradient: torch requires_grad, or a JAX array being differentiated."""
    return getattr(value, "requires_grad", False) or _differentiated(value)


def needs_gradient(mod: ScoreMod) -> bool:
    """Whether any tensor of `mod` asks for a gradient."""
    return any(_wants_gradient(v) for v in [*mod.tensors.values(), *mod.bprop_tensors.values(), *mod.unfollowed])


def refuse_unfollowed(api: str, mod: ScoreMod) -> None:
    """ValueError for a training call whose callbacks read a tensor that requires grad where no gradient can
    reach it (ScoreMod.unfollowed): it would otherwise train as a constant, silently."""
    for value in mod.unfollowed:
        if _wants_gradient(value):
            raise ValueError(
                f"{api}: score_mod {mod.name}: a captured tensor of shape {tuple(value.shape)} requires grad, but "
                "the callback reads it where no gradient can reach it: with a number on an axis (t[0], P[1, h]), "
                "or through an op on the whole tensor before it is indexed by positions (w.exp()[h], w.mean()), "
                "which the trace takes as a constant; or in a callback that cannot be traced. Index the tensor "
                "itself, every axis by b, h, q_idx or kv_idx (w[h].exp(): an added term then learns as a bias, "
                "any other read on the reference), or detach it (torch: .detach(); JAX: "
                "jax.lax.stop_gradient before the callback captures it)")


def _normalize(label: str, value, full: tuple, device: str | None, training: bool, float64: bool = False):
    """One aux entry as a 4-D array in a dtype cuDNN reads, or a RuntimeScalar. label: who it is, for errors.
    float64: a float64 call's (which only the reference runs): its float64 arrays and numbers keep their
    precision (a number travels as a float64 scalar, as the Python float it is)."""
    real = "float64" if float64 else "float32"
    if isinstance(value, bool) or isinstance(value, numbers.Integral):
        return RuntimeScalar(int(value), "int32")
    if isinstance(value, numbers.Real):
        return RuntimeScalar(float(value), real)
    shape = getattr(value, "shape", None)
    if shape is None:
        raise ValueError(f"{label}: expected a tensor or a number, got {type(value).__name__}")
    from fusedattn.xp import framework_of, namespace

    if framework_of(value) is None:  # a NumPy array or scalar
        import numpy as np

        array = np.asarray(value)
        if array.ndim:
            raise ValueError(f"{label}: expected a framework tensor (torch or JAX) or a number, got a NumPy "
                             f"array of shape {array.shape}; convert it on q's device once")
        return RuntimeScalar(array.item(), "int32" if array.dtype.kind in "biu" else real)
    ops = namespace(value)
    if device is not None and ops.name == "torch" and str(value.device) != device:
        if len(shape) == 0 and value.device.type == "cpu":
            item = value.item()
            return RuntimeScalar(item, "float32" if isinstance(item, float) else "int32")
        raise ValueError(f"{label}: expected a tensor on {device} (q's device), got one on {value.device}; "
                         "move it there once with .to(q.device)")
    if training and _wants_gradient(value):
        raise ValueError(f"{label}: expected a tensor that does not require grad: score_mod tensors get no "
                         "gradient; pass a learnable additive term as bias= (it has a gradient), or detach it "
                         "(torch) / wrap it in jax.lax.stop_gradient (JAX)")
    dtype = ops.dtype_name(value)
    if dtype not in _ARRAY_DTYPES:
        raise ValueError(f"{label}: expected a float, int or bool tensor, got dtype {dtype}")
    if len(shape) > 4 or any(s not in (1, f) for s, f in zip(tuple(shape)[::-1], full[::-1])):
        raise ValueError(f"{label}: expected a shape broadcastable to (B, Hq, Sq, Skv) = {full}, got "
                         f"{tuple(shape)}")
    array = ops.reshape(value, (1,) * (4 - len(shape)) + tuple(shape))
    if _ARRAY_DTYPES[dtype] != dtype and not (float64 and dtype == "float64"):
        array = ops.astype(array, _ARRAY_DTYPES[dtype])
    if array.shape[0] > 1 and array.shape[2] == array.shape[3] == 1 and full[2] * full[3] > 1:
        # One value per batch (and head): cuDNN 9.19 reads a (B, 1, 1, 1) or (B, H, 1, 1) tensor as if
        # every batch had the first one's values (measured: fuzz; (1, H, 1, 1) is read right). Declared
        # (B, ., Sq, 1), a zero-stride view or dense (JAX: B*H*Sq values), it is read right
        # (bench/diag/per_batch_declarations.py); (B, ., 1, Skv) where Sq is 1.
        array = ops.broadcast_to(array, tuple(array.shape[:2]) + ((full[2], 1) if full[2] > 1 else (1, full[3])))
    if array.shape[2] == 1 and array.shape[3] > 1 and full[2] > 1:
        # One value per key, shared by the queries: cuDNN 9.19's backward reads a (., ., 1, Skv)
        # tensor wrongly (measured); the same memory declared (., ., Sq, Skv) with a zero query
        # stride is read right.
        array = ops.broadcast_to(array, tuple(array.shape[:2]) + (full[2], array.shape[3]))
    return array


def precision_of(like) -> str:
    """The dtype a call computes its score_mod arrays in: float64 for a float64 call (only the reference
    runs those), else float32 (what cuDNN reads)."""
    from fusedattn.xp import namespace

    return "float64" if namespace(like).dtype_name(like) == "float64" else "float32"


def bind(api: str, mod: ScoreMod, *, batch: int, heads_q: int, seqlen_q: int, seqlen_kv: int,
         device: str | None, training: bool, like=None) -> BoundScoreMod:
    """This call's aux values (checked), the config key and the graph recipe of `mod`. like: q, whose
    framework and device the mod's host values (score_mods.alibi's slopes given as a list) are made arrays of."""
    tensors = dict(mod.tensors)
    for name, value in mod.bprop_tensors.items():
        if name in tensors and tensors[name] is not value:
            raise ValueError(f"{api}: score_mod_bprop_tensors[{name!r}]: expected a name not used by "
                             "score_mod_tensors (the callbacks share one dict), got a second entry")
        tensors[name] = value
    if like is not None and any(isinstance(tensors.get(name), np.ndarray) for name in mod.host):
        from fusedattn.xp import namespace

        ops = namespace(like)
        tensors = {name: ops.asarray(value, like, str(value.dtype))
                   if name in mod.host and isinstance(value, np.ndarray) else value for name, value in tensors.items()}
    if training:
        refuse_unfollowed(api, mod)
    full = (batch, heads_q, seqlen_q, seqlen_kv)
    if mod.prepare is not None:
        tensors = dict(mod.prepare(tensors, full, like))
    # A traced flex mod's tensors are named by the tracer (captured c0, aux f.a0), not by the user.
    label = (f"{api}: score_mod: a captured tensor (or a value the callback makes of one, {{}})" if mod.structure
             else f"{api}: score_mod_tensors[{{!r}}]")
    float64 = like is not None and precision_of(like) == "float64"
    values = {name: _normalize(label.format(name), value, full, device, training, float64)
              for name, value in tensors.items()}
    if mod.forward is None:
        return BoundScoreMod(mod, values, EAGER_ONLY_KEY + ((mod.issue,) if mod.issue else ()), None)
    aux = tuple(sorted((name, describe_aux(value)) for name, value in values.items()))
    if mod.structure is not None:  # a traced flex mod: its expressions' keys say what it builds
        key = ("flex", mod.structure, aux)
    else:
        key = structural_key(mod.forward, values, mod.bprop, api=api)
    issue = None
    if mod.bprop is None and mod.structure is None:
        from fusedattn.score_mods.derivative import score_derivative_issue

        issue = score_derivative_issue(key, values)
    return BoundScoreMod(mod, values, key, GraphRecipe(mod.forward, mod.bprop, aux, issue))


def apply_eager(ops, bound: BoundScoreMod, score, b_idx, h_idx, q_idx, kv_idx, dtype: str):
    """The reference's score_mod: the built-in's eager twin, or the callbacks run eagerly.

    Scores at or below MASKED_BELOW become -inf, so a row whose every key a score_mod
    masked is empty (output 0, LSE -inf) here as on the fused backends.
    """
    from fusedattn.score_mods.eager_graph import run_eager

    values = {}
    for name, value in bound.values.items():
        if isinstance(value, RuntimeScalar):
            values[name] = value.value
        elif ops.dtype_name(value) in ("float16", "bfloat16", "float32", "float64"):
            values[name] = ops.astype(value, dtype)
        else:
            values[name] = value
    if bound.mod.eager is not None:
        result = bound.mod.eager(ops, score, b_idx, h_idx, q_idx, kv_idx, values)
    else:
        result = run_eager(ops, bound.mod.forward, score, values, dtype)
    if hasattr(result, "dtype") and ops.dtype_name(result) == "bool":  # (a cast would make it 0/1 scores)
        raise ValueError(f"score_mod {bound.mod.name}: expected a float score, got booleans; a mask goes as "
                         "mask_mod=(b, h, q_idx, kv_idx) -> bool (True keeps the key)")
    result = ops.broadcast_to(ops.astype(result, dtype), tuple(score.shape))
    return ops.where(result <= MASKED_BELOW, float("-inf"), result)
