"""Built-in score_mods: graph callbacks with their derivatives and eager twins.

Every number a built-in takes travels as a runtime scalar, so changing it (a new cap, a
new window) reuses the built graph. Masks write `MASKED`; a row left with no visible key
gives output 0 and LSE -inf.
"""

from __future__ import annotations

import weakref

from fusedattn.score_mods.core import MASKED, ScoreMod
from fusedattn.score_mods.graph_ops import both, col_index, compare, data_type, index_plus, keep_where, row_index

__all__ = ["softcap", "clamp", "causal", "sliding_window", "alibi", "relative_position_bias", "additive_bias",
           "document_mask", "compose"]


def _number(api: str, name: str, value, *, integer: bool = False, positive: bool = False):
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (positive and not value > 0):
        want = "an int" if integer else "a positive number" if positive else "a number"
        raise ValueError(f"score_mods.{api}: {name}: expected {want}, got {value!r}")
    return value


# ----------------------------------------------------------------------------- softcap

def _softcap_forward(graph, score, tensors):
    x = graph.div(a=score, b=tensors["cap"])
    tensors["softcap_input"] = x  # for the derivative
    return graph.mul(a=graph.tanh(input=x), b=tensors["cap"])


def _softcap_bprop(graph, dscore, tensors):
    # d/ds cap * tanh(s / cap) = 1 - tanh(s / cap)^2
    return graph.tanh_backward(loss=dscore, input=tensors["softcap_input"])


def softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap): bounds scores to (-cap, cap) smoothly (Gemma 2, Grok)."""
    cap = float(_number("softcap", "cap", cap, positive=True))
    return ScoreMod(_softcap_forward, _softcap_bprop, {"cap": cap}, masks=False,
                    eager=lambda ops, s, b, h, qi, ki, t: t["cap"] * ops.module.tanh(s / t["cap"]),
                    name=f"softcap({cap:g})")


# ----------------------------------------------------------------------------- clamp

def _clamp_forward(graph, score, tensors):
    tensors["clamp_input"] = score  # for the derivative
    return graph.max(input0=graph.min(input0=score, input1=tensors["high"]), input1=tensors["low"])


def _clamp_bprop(graph, dscore, tensors):
    score = tensors["clamp_input"]
    inside = both(graph, compare(graph, "gt", score, tensors["low"]), compare(graph, "lt", score, tensors["high"]))
    return keep_where(graph, dscore, inside, tensors["zero"])


def clamp(low: float, high: float) -> ScoreMod:
    """Scores clipped to [low, high] (no tanh); the gradient is 0 where a score was clipped."""
    low = float(_number("clamp", "low", low))
    high = float(_number("clamp", "high", high))
    if not low < high:
        raise ValueError(f"score_mods.clamp: low, high: expected low < high, got {low!r}, {high!r}")

    def eager(ops, s, b, h, qi, ki, t):
        return ops.clip(s, t["low"], t["high"])

    return ScoreMod(_clamp_forward, _clamp_bprop, {"low": low, "high": high, "zero": 0.0}, eager=eager, masks=False,
                    name=f"clamp({low:g}, {high:g})")


# ----------------------------------------------------------------------------- masks

def _causal_forward(graph, score, tensors):
    keep = compare(graph, "le", col_index(graph, score), row_index(graph, score))
    return keep_where(graph, score, keep, tensors["masked"])


def causal() -> ScoreMod:
    """Keys after the query are masked (top-left diagonal, per sequence for packed layouts).

    The same as mask='causal', written as a score_mod; combine it with others by compose().
    """
    return ScoreMod(_causal_forward, None, {"masked": MASKED},
                    eager=lambda ops, s, b, h, qi, ki, t: ops.where(ki <= qi, s, MASKED), name="causal()")


def _window_forward(left: bool, right: bool):
    def forward(graph, score, tensors):
        row, col = row_index(graph, score), col_index(graph, score)
        keep = None
        if left:  # key >= query - left
            keep = compare(graph, "le", row, index_plus(graph, col, tensors["left"]))
        if right:  # key <= query + right
            keep = both(graph, keep, compare(graph, "le", col, index_plus(graph, row, tensors["right"])))
        return keep_where(graph, score, keep, tensors["masked"])

    return forward


def sliding_window(left: int, right: int = 0) -> ScoreMod:
    """Each query sees `left` keys before it and `right` after it (-1 = unbounded), top-left aligned."""
    left = _number("sliding_window", "left", left, integer=True)
    right = _number("sliding_window", "right", right, integer=True)
    if left < -1 or right < -1 or (left == -1 and right == -1):
        raise ValueError(f"score_mods.sliding_window: left, right: expected ints >= 0 (or -1 = unbounded, not "
                         f"both), got {left}, {right}")
    tensors = {"masked": MASKED}
    if left >= 0:
        tensors["left"] = left
    if right >= 0:
        tensors["right"] = right

    def eager(ops, s, b, h, qi, ki, t):
        keep = None
        if "left" in t:
            keep = qi <= ki + t["left"]
        if "right" in t:
            near = ki <= qi + t["right"]
            keep = near if keep is None else ops.logical_and(keep, near)
        return ops.where(keep, s, MASKED)

    return ScoreMod(_window_forward(left >= 0, right >= 0), None, tensors, eager=eager,
                    name=f"sliding_window({left}, {right})")


def _document_forward(graph, score, tensors):
    # Spread both sides' ids over the score's shape (scale a tensor of ones, made from the key
    # index so it does not read the score), then compare the two full-shape tensors.
    col = col_index(graph, score)
    ones = graph.cmp_le(input=col, comparison=col, compute_data_type=data_type(graph, "FLOAT"))
    ones.set_data_type(data_type(graph, "INT32"))
    spread = []
    for name in ("query_ids", "key_ids"):
        ids = graph.scale(input=ones, scale=tensors[name], compute_data_type=data_type(graph, "FLOAT"))
        ids.set_data_type(data_type(graph, "INT32"))
        spread.append(ids)
    return keep_where(graph, score, compare(graph, "eq", *spread), tensors["masked"])


def document_mask(segment_ids, kv_segment_ids=None) -> ScoreMod:
    """Queries see only keys of their own document: segment_ids (B, Sq) (and kv_segment_ids
    (B, Skv), default the same) give each token's document number (integers)."""
    kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
    for name, ids in (("segment_ids", segment_ids), ("kv_segment_ids", kv_segment_ids)):
        if len(getattr(ids, "shape", ())) != 2:
            raise ValueError(f"score_mods.document_mask: {name}: expected a (B, S) integer tensor, got "
                             f"{getattr(ids, 'shape', type(ids).__name__)}")

    def prepare(tensors, full, like):
        seqlen_q, seqlen_kv = full[2], full[3]
        q_ids, kv_ids = tensors.pop("segment_ids"), tensors.pop("kv_segment_ids")
        if q_ids.shape[1] != seqlen_q or kv_ids.shape[1] != seqlen_kv:
            raise ValueError(f"score_mods.document_mask: segment_ids: expected (B, Sq={seqlen_q}) and (B, "
                             f"Skv={seqlen_kv}), got {tuple(q_ids.shape)} and {tuple(kv_ids.shape)}")
        from fusedattn.xp import namespace

        ops = namespace(q_ids)
        as_int = lambda ids, shape: ops.reshape(ops.astype(ids, "int32"), shape)  # noqa: E731
        return {**tensors, "query_ids": as_int(q_ids, (q_ids.shape[0], 1, seqlen_q, 1)),
                "key_ids": as_int(kv_ids, (kv_ids.shape[0], 1, 1, seqlen_kv))}

    return ScoreMod(_document_forward, None,
                    {"segment_ids": segment_ids, "kv_segment_ids": kv_segment_ids, "masked": MASKED},
                    prepare=prepare, name="document_mask()",
                    eager=lambda ops, s, b, h, qi, ki, t: ops.where(t["query_ids"] == t["key_ids"], s, MASKED))


# ----------------------------------------------------------------------------- additive terms

def _alibi_forward(graph, score, tensors):
    distance = graph.abs(input=graph.sub(a=row_index(graph, score), b=col_index(graph, score)))
    return graph.sub(a=score, b=graph.mul(a=distance, b=tensors["slopes"]))


def alibi(slopes) -> ScoreMod:
    """score - slope[h] * |q_idx - kv_idx| with per-head slopes (Hq,) or (B, Hq), any values: a tensor,
    or a list/tuple/NumPy array such as fusedattn.standard_alibi_slopes(Hq) (made an array of q's
    framework and device when the call binds it)."""
    from fusedattn.arguments import host_slopes

    host = host_slopes("score_mods.alibi: slopes", slopes)
    slopes = host if host is not None else slopes
    shape = tuple(getattr(slopes, "shape", ()))
    if len(shape) not in (1, 2):
        raise ValueError(f"score_mods.alibi: slopes: expected a (Hq,) or (B, Hq) float tensor, got {shape or slopes!r}")

    def prepare(tensors, full, like):
        from fusedattn.xp import namespace

        values = tensors["slopes"]
        ops = namespace(values)
        shaped = ops.reshape(ops.astype(values, "float32"), (-1 if len(shape) == 2 else 1, shape[-1], 1, 1))
        return {**tensors, "slopes": shaped}

    def eager(ops, s, b, h, qi, ki, t):
        return s - t["slopes"] * ops.astype(ops.abs(qi - ki), ops.dtype_name(s))

    return ScoreMod(_alibi_forward, None, {"slopes": slopes}, eager=eager, prepare=prepare, masks=False, name="alibi()",
                    host=("slopes",))


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
                    as_bias=lambda tensors, full, like: tensors["bias"])


def _expand_table(values, reach: int, heads: int, seqlen_q: int, seqlen_kv: int):
    """table[h, clip(kv - q, -reach, reach) + reach] as a (1, H, Sq, Skv) array (differentiable)."""
    from fusedattn.xp import namespace

    ops = namespace(values)
    distance = (ops.reshape(ops.arange(seqlen_kv, like=values, dtype="int64"), (1, seqlen_kv))
                - ops.reshape(ops.arange(seqlen_q, like=values, dtype="int64"), (seqlen_q, 1)))
    index = ops.clip(distance, -reach, reach) + reach
    return ops.reshape(ops.take(values, ops.reshape(index, (-1,)), axis=1), (1, heads, seqlen_q, seqlen_kv))


# id(torch table) -> (its version and the lengths, its expansion), dropped when the table dies; kept by
# the table, not the ScoreMod, so one made anew at each call reads nothing new (torch/score_mod_bindings.py
# keys its binding by what the callbacks read).
_EXPANDED: dict = {}


def relative_position_bias(table) -> ScoreMod:
    """score + table[h, clip(kv_idx - q_idx, -M, M) + M] for a (Hq, 2M + 1) table.

    cuDNN graphs cannot gather, so each call expands the table to a (1, Hq, Sq, Skv)
    bias in the table's dtype (kept while the table and the lengths stay the same). A table
    that needs a gradient is learnable: the call then passes the expanded table as `bias=`
    (which has a gradient), and the table gets it through the expansion.
    """
    shape = tuple(getattr(table, "shape", ()))
    if len(shape) != 2 or shape[1] % 2 != 1:
        raise ValueError(f"score_mods.relative_position_bias: table: expected a (Hq, 2M + 1) tensor, got "
                         f"{shape or type(table).__name__}")
    reach = shape[1] // 2

    def prepare(tensors, full, like):
        seqlen_q, seqlen_kv = full[2], full[3]
        values = tensors.pop("table")
        version = (seqlen_q, seqlen_kv, getattr(values, "_version", None), getattr(values, "requires_grad", None))
        if version[2] is None:  # no version to key by (not a torch tensor): expanded at each bind
            return {**tensors, "bias": _expand_table(values, reach, shape[0], seqlen_q, seqlen_kv)}
        kept = _EXPANDED.get(id(values))
        if kept is None:
            weakref.finalize(values, _EXPANDED.pop, id(values), None)
        if kept is None or kept[0] != version:
            kept = _EXPANDED[id(values)] = (version, _expand_table(values, reach, shape[0], seqlen_q, seqlen_kv))
        return {**tensors, "bias": kept[1]}

    def as_bias(tensors, full, like):  # fresh each call: it carries the gradient's graph
        return _expand_table(tensors["table"], reach, shape[0], full[2], full[3])

    return ScoreMod(_add_bias_forward, None, {"table": table}, eager=_add_bias_eager, prepare=prepare, masks=False,
                    as_bias=as_bias, name="relative_position_bias()")


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


def compose(*mods: ScoreMod) -> ScoreMod:
    """Apply mods in order (the first sees the raw score); derivatives chain in reverse."""
    if not mods or not all(isinstance(m, ScoreMod) for m in mods):
        raise ValueError(f"score_mods.compose: expected ScoreMod arguments, got {mods!r}")
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
