"""Built-in score_mods, written once in flex form: plain functions of the score and the positions
(score_mods.portable's math), traced, lowered and differentiated as a user's callbacks are, in torch
and JAX alike; their masks run as the backends' own masks (causal, windows, documents as THD).

Every number a built-in takes travels as a runtime scalar, so changing it (a new cap, a
new window) reuses the built graph. A row left with no visible key gives output 0 and LSE -inf.
additive_bias stays a cuDNN-native callback: a tensor added as it is.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types

from fusedattn.options import SCORE_MOD_NAMES
from fusedattn.score_mods.core import MADE_OF, ScoreMod
from fusedattn.score_mods.portable import abs, clip, tanh, where  # noqa: A004 (portable abs)

__all__ = ["softcap", "clamp", "causal", "sliding_window", "alibi", "relative_position_bias", "additive_bias",
           "document_mask", "compose", "compose_native", "flex_keywords"]


def _number(api: str, name: str, value, *, integer: bool = False, positive: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (positive and not value > 0):
        want = "an int" if integer else "a positive number" if positive else "a number"
        raise ValueError(f"score_mods.{api}: {name}: expected {want}, got {value!r}")
    return traced_constant(value)


def traced_constant(value):
    """The number itself; under torch.compile, the number read back from its text. A number argument that
    changed between compiled calls is symbolic there, which the compiled call's planning cannot take; its
    text is a constant (Dynamo guards on the value), so a new number recompiles as it should. (An f-string:
    Dynamo 2.11 keeps repr()'s and str()'s results symbolic in a function it inlines. Eagerly the same
    object: the trace cache knows a built-in's numbers by identity.)"""
    torch = sys.modules.get("torch")
    if torch is None or not torch.compiler.is_compiling() or isinstance(value, bool):
        return value
    if isinstance(value, (int, torch.SymInt)):  # (a symbolic int is no int: it would come back a float)
        return int(f"{int(value)!r}")
    return float(f"{float(value)!r}")


def _defined(name: str, score_mod=None, mask_mod=None, tensors: dict | None = None) -> ScoreMod:
    """A built-in written once in flex form: score_mod(score, b, h, q_idx, kv_idx) and/or
    mask_mod(b, h, q_idx, kv_idx), closures over the numbers and tensors in `tensors` (kept on the mod
    too: what a call's binding watches). Traced, lowered and differentiated as a user's callbacks are,
    in torch and JAX alike; a mask part runs as the backends' own masks where it is one. The mapping is
    read-only: the functions read their own numbers, so a new value is a new built-in."""
    mod = ScoreMod(None, tensors=types.MappingProxyType(dict(tensors or {})), name=name, masks=mask_mod is not None,
                   flex=(score_mod, mask_mod))
    object.__setattr__(mod, MADE_OF, (name, mask_mod is not None, score_mod, mask_mod))  # (the functions say it all)
    return mod


# ----------------------------------------------------------------------------- softcap, clamp

def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap): bounds scores to (-cap, cap) smoothly (Gemma 2, Grok)."""
    cap = float(_number("softcap", "cap", cap, positive=True))

    def softcap_mod(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return _defined(f"softcap({cap:g})", softcap_mod, tensors={"cap": cap})


def clamp(low: float, high: float) -> ScoreMod:
    """Scores clipped to [low, high] (no tanh); the gradient is 0 where a score was clipped."""
    low = float(_number("clamp", "low", low))
    high = float(_number("clamp", "high", high))
    if not low < high:
        raise ValueError(f"score_mods.clamp: low, high: expected low < high, got {low!r}, {high!r}")

    def clamp_mod(score, b, h, q_idx, kv_idx):
        return clip(score, low, high)

    return _defined(f"clamp({low:g}, {high:g})", clamp_mod, tensors={"low": low, "high": high})


# ----------------------------------------------------------------------------- masks

def _causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def causal() -> ScoreMod:
    """Keys after the query are masked (top-left diagonal, per sequence for packed layouts).

    The same as mask='causal' (and run as it); combine it with others by compose().
    """
    return _defined("causal()", mask_mod=_causal_mask)


def sliding_window(left: int, right: int = 0) -> ScoreMod:
    """Each query sees `left` keys before it and `right` after it (-1 = unbounded), top-left aligned."""
    left = _number("sliding_window", "left", left, integer=True)
    right = _number("sliding_window", "right", right, integer=True)
    if left < -1 or right < -1 or (left == -1 and right == -1):
        raise ValueError(f"score_mods.sliding_window: left, right: expected ints >= 0 (or -1 = unbounded, not "
                         f"both), got {left}, {right}")
    tensors = {name: bound for name, bound in (("left", left), ("right", right)) if bound >= 0}

    if left < 0:
        def window_mask(b, h, q_idx, kv_idx):
            return kv_idx - q_idx <= right
    elif right < 0:
        def window_mask(b, h, q_idx, kv_idx):
            return q_idx - kv_idx <= left
    else:
        def window_mask(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= left) & (kv_idx - q_idx <= right)

    return _defined(f"sliding_window({left}, {right})", mask_mod=window_mask, tensors=tensors)


def document_mask(segment_ids, kv_segment_ids=None) -> ScoreMod:
    """Queries see only keys of their own document: segment_ids (B, Sq) (and kv_segment_ids
    (B, Skv), default the same) give each token's document number (integers). With one ids tensor
    sorted along each row, the call runs as THD: each document its own sequence."""
    kv_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    for name, ids in (("segment_ids", segment_ids), ("kv_segment_ids", kv_ids)):
        if len(getattr(ids, "shape", ())) != 2:
            raise ValueError(f"score_mods.document_mask: {name}: expected a (B, S) integer tensor, got "
                             f"{getattr(ids, 'shape', type(ids).__name__)}")
    q_ids = segment_ids

    def document(b, h, q_idx, kv_idx):
        return q_ids[b, q_idx] == kv_ids[b, kv_idx]

    return _defined("document_mask()", mask_mod=document,
                    tensors={"segment_ids": segment_ids, "kv_segment_ids": kv_ids})


# ----------------------------------------------------------------------------- additive terms

def _select(values, index):
    """values[index] for a runtime index, as a chain of selects over numbers."""
    value = values[-1]
    for i in range(len(values) - 2, -1, -1):
        value = where(index == i, values[i], value)
    return value


def _host_slope(table: tuple, batched: bool):
    """slopes[b, h] (or slopes[h]) from host numbers (rows of floats), framework-free: selects over them
    (runtime scalars; the result depends on b and h alone, so it is one small aux tensor)."""
    def host_slope(b, h):
        rows = [_select(row, h) for row in table]
        return _select(rows, b) if batched else rows[0]

    return host_slope


def alibi(slopes) -> ScoreMod:
    """score - slope[h] * |q_idx - kv_idx| with per-head slopes (Hq,) or (B, Hq), any values: a tensor,
    or a list/tuple/NumPy array such as fusedattn.standard_alibi_slopes(Hq)."""
    from fusedattn.arguments import host_slopes, python_slopes

    argument = "score_mods.alibi: slopes"
    if isinstance(slopes, (list, tuple)):  # (plain Python: a list made inside a compiled function stays constant)
        table, batched = python_slopes(argument, slopes)
        table = tuple(tuple(map(traced_constant, row)) for row in table)
    else:
        host = host_slopes(argument, slopes)
        table, batched = (None, False) if host is None else (
            tuple(tuple(map(float, row)) for row in (host if host.ndim == 2 else [host])), host.ndim == 2)
    shape = tuple(getattr(slopes, "shape", ())) if table is None else (len(table), len(table[0]))[1 - batched:]
    if len(shape) not in (1, 2):
        raise ValueError(f"{argument}: expected a (Hq,) or (B, Hq) float tensor, got {shape or slopes!r}")
    if table is not None:
        slope = _host_slope(table, batched)
    elif len(shape) == 1:
        def slope(b, h):
            return slopes[h]
    else:
        def slope(b, h):
            return slopes[b, h]

    def alibi_mod(score, b, h, q_idx, kv_idx):
        return score - slope(b, h) * abs(q_idx - kv_idx)

    return _defined("alibi()", alibi_mod, tensors={"slopes": slopes if table is None else sum(table, ())})


def _add_bias_forward(graph, score, tensors):
    return graph.add(a=score, b=tensors["bias"])


def _add_bias_eager(ops, s, b, h, qi, ki, t):
    return s + t["bias"]


def additive_bias(bias) -> ScoreMod:
    """score + bias, a tensor broadcastable to (B, Hq, Sq, Skv); a bias that needs a gradient
    is passed as `bias=` instead (the same sum, with dBias)."""
    if getattr(bias, "shape", None) is None:
        raise ValueError(f"score_mods.additive_bias: bias: expected a tensor, got {type(bias).__name__}")
    return ScoreMod(_add_bias_forward, None, {"bias": bias}, eager=_add_bias_eager, masks=False, name="additive_bias()",
                    as_bias=lambda tensors, full, like, memo=None: tensors["bias"])


def relative_position_bias(table) -> ScoreMod:
    """score + table[h, clip(kv_idx - q_idx, -M, M) + M] for a (Hq, 2M + 1) table.

    cuDNN graphs cannot gather, so each call expands the table to a (1, Hq, Sq, Skv) bias (kept while
    the table and the lengths stay the same; explain says so, with its size). A table that needs a
    gradient is learnable: the call passes the expanded table as `bias=` (which has a gradient), and
    the table gets it through the expansion.
    """
    shape = tuple(getattr(table, "shape", ()))
    if len(shape) != 2 or shape[1] % 2 != 1:
        raise ValueError(f"score_mods.relative_position_bias: table: expected a (Hq, 2M + 1) tensor, got "
                         f"{shape or type(table).__name__}")
    reach = shape[1] // 2

    def relative_position(score, b, h, q_idx, kv_idx):
        return score + table[h, clip(kv_idx - q_idx, -reach, reach) + reach]

    return _defined("relative_position_bias()", relative_position, tensors={"table": table})


# ----------------------------------------------------------------------------- composition

class _Prefixed(dict):
    """One part's view of the shared tensors dict: its names carry the part's prefix."""

    def __init__(self, shared: dict, prefix: str):
        super().__init__()
        self._shared, self._prefix = shared, prefix

    def __getitem__(self, name):
        return self._shared[self._prefix + name]

    def __setitem__(self, name, value):
        self._shared[self._prefix + name] = value

    def __contains__(self, name):
        return self._prefix + name in self._shared


def _then(first, second):
    def then(score, b, h, q_idx, kv_idx):
        return second(first(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    return then


def _and(first, second):
    def both_masks(b, h, q_idx, kv_idx):
        return first(b, h, q_idx, kv_idx) & second(b, h, q_idx, kv_idx)

    return both_masks


def _joined(functions: list, join):
    present = [fn for fn in functions if fn is not None]
    return None if not present else functools.reduce(join, present)


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply mods in order (the first sees the raw score); derivatives chain in reverse. Masks apply
    after every score modification, wherever they stand in the list (a masked score stays masked)."""
    if not mods or not all(isinstance(m, ScoreMod) for m in mods):
        raise ValueError(f"score_mods.compose: expected ScoreMod arguments, got {mods!r}")
    prefixes = [f"{i}." for i in range(len(mods))]
    tensors = {prefix + name: value for mod, prefix in zip(mods, prefixes)
               for name, value in {**mod.tensors, **mod.bprop_tensors}.items()}
    name = " then ".join(m.name for m in mods)
    if all(m.flex for m in mods):  # written in flex form: one flex score_mod and one mask_mod
        score_mod = _joined([m.flex[0] for m in mods], _then)
        mask_mod = _joined([m.flex[1] for m in mods], _and)
        composed = dataclasses.replace(_defined(name, score_mod, mask_mod, tensors), parts=tuple(mods))
        parts = [m.__dict__.get(MADE_OF) for m in mods]
        if all(part is not None for part in parts):  # built-ins all: made of its parts, in order
            object.__setattr__(composed, MADE_OF, ("compose", *parts))
        return composed
    # With a cuDNN-native part: each flex-form part is traced for the call's framework (resolve).
    return ScoreMod(None, tensors=tensors, name=name, parts=tuple(mods),
                    masks=any(m.masks for m in mods) or (None if any(m.masks is None for m in mods) else False))


def compose_native(*mods: ScoreMod) -> ScoreMod:
    """compose() of mods that all have graph callbacks (resolve gives flex-form parts theirs)."""
    prefixes = [f"{i}." for i in range(len(mods))]

    def forward(graph, score, tensors):
        for mod, prefix in zip(mods, prefixes):
            score = mod.forward(graph, score, _Prefixed(tensors, prefix))
        return score

    def bprop(graph, dscore, tensors):
        for mod, prefix in reversed(list(zip(mods, prefixes))):
            if mod.bprop is not None:
                dscore = mod.bprop(graph, dscore, _Prefixed(tensors, prefix))
        return dscore

    def eager(ops, s, b, h, qi, ki, tensors):
        for mod, prefix in zip(mods, prefixes):
            s = mod.eager(ops, s, b, h, qi, ki, _Prefixed(tensors, prefix))
        return s

    def prepare(tensors, full, like):
        out = {}
        for mod, prefix in zip(mods, prefixes):
            own = {name[len(prefix):]: v for name, v in tensors.items() if name.startswith(prefix)}
            if mod.prepare is not None:
                own = mod.prepare(own, full, like)
            out.update({prefix + name: v for name, v in own.items()})
        return out

    tensors = {prefix + name: value for mod, prefix in zip(mods, prefixes)
               for name, value in {**mod.tensors, **mod.bprop_tensors}.items()}
    has_graph = all(m.forward is not None for m in mods)
    return ScoreMod(forward if has_graph else None,
                    bprop if has_graph and any(m.bprop is not None for m in mods) else None, tensors,
                    eager=eager if all(m.eager is not None for m in mods) else None, prepare=prepare,
                    name=" then ".join(m.name for m in mods),
                    masks=any(m.masks for m in mods) or (None if any(m.masks is None for m in mods) else False),
                    parts=tuple(mods))


def flex_keywords(options: dict) -> dict:
    """The call's keywords with a flex-form built-in given as score_mod replaced by the score_mod and
    mask_mod it is (a mask_mod given beside it joins its mask), so its masks reach mask_rewrite and the
    warm paths see the functions; the same dict when there is none."""
    mod = options.get("score_mod")
    if type(mod) is not ScoreMod or not mod.flex or any(
            options.get(name) is not None for name in SCORE_MOD_NAMES if name not in ("score_mod", "mask_mod")):
        return options  # (extra keywords beside a ScoreMod: as_score_mod names the error)
    score_mod, mask_mod = mod.flex
    given = options.get("mask_mod")
    if given is not None:
        mask_mod = given if mask_mod is None else _and(mask_mod, given)
    options = dict(options)
    options["score_mod"] = score_mod
    options["mask_mod"] = mask_mod
    return {name: value for name, value in options.items() if value is not None or name not in
            ("score_mod", "mask_mod")}
