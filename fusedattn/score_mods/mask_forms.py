"""Which parts of a traced mask_mod are masks the backends have natively.

A mask_mod is a conjunction (`&`) of conditions. Each condition is read for one of three
native forms; the rest stay a select inside the score_mod graph (correct, but every tile is
computed):

    Band      q_idx - kv_idx <= left and kv_idx - q_idx <= right (a causal mask, a sliding
              window; in absolute positions, that is top-left aligned); from comparisons of
              q_idx - kv_idx (in any arrangement) with numbers, and |q_idx - kv_idx| <= w.
    Length    idx < count on one axis, count a number or lengths[b] (+ a number): padding.
    Document  doc[b, q_idx] == doc[b, kv_idx] (or doc[q_idx] == doc[kv_idx]): packed sequences.

Recognition is symbolic and exact: a condition is read as `a*q_idx + c*kv_idx + l*lengths[b] +
constant <op> 0` with integer positions, so `q_idx >= kv_idx`, `kv_idx <= q_idx`, `q_idx - kv_idx
< 257` and `not (kv_idx > q_idx)` are all recognized, and nothing is guessed. Whether a form can
run natively for a call (its shapes, the other options) is mask_rewrite's decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from fusedattn.cache import LRUCache
from fusedattn.score_mods.expr import BOOL, Expr

__all__ = ["Band", "Length", "Document", "MaskForms", "mask_forms"]

_FLIPPED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATED = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}
_ONE = "1"  # the constant term of a linear form
_CHOICES_PER_MASK = 64


@dataclass(frozen=True)
class Band:
    """q_idx - kv_idx <= left and kv_idx - q_idx <= right; None: unbounded."""

    left: int | None
    right: int | None


@dataclass(frozen=True)
class Length:
    """idx < count on `axis` ("q_idx" or "kv_idx"): count = lengths[b] + offset, or offset alone when
    slot is None (lengths: the captured tensor of that slot, (B,) integers)."""

    axis: str
    slot: int | None
    offset: int


@dataclass(frozen=True)
class Document:
    """doc[b, q_idx] == doc[b, kv_idx] (batched) or doc[q_idx] == doc[kv_idx]; doc: captured slot."""

    slot: int
    batched: bool


@dataclass(frozen=True, eq=False)
class MaskForms:
    """A traced mask_mod: its conditions (node numbers) and the native form of each (or None)."""

    expr: Expr
    conditions: tuple  # ((node, Band | Length | Document | None), ...)
    # mask_rewrite's choices per call shape (bounded: a server sees many lengths)
    choices: LRUCache = field(default_factory=lambda: LRUCache(_CHOICES_PER_MASK), repr=False)

    def of(self, kind) -> list:
        return [(node, form) for node, form in self.conditions if isinstance(form, kind)]


def _conditions(expr: Expr, number: int) -> list[int]:
    """The operands of a tree of `and`s."""
    node = expr.nodes[number]
    if node.op == "and":
        return [c for a in node.args for c in _conditions(expr, a)]
    return [number]


def _input_name(expr: Expr, number: int) -> str | None:
    """The input a node is, seeing through JAX's negative-index wrap `where(i < 0, i + n, i)` (the
    inputs are never negative)."""
    node = expr.nodes[number]
    if node.op == "where":
        test, wrapped, plain = (expr.nodes[a] for a in node.args)
        if (test.op == "lt" and test.args[0] == node.args[2] and wrapped.op == "add"
                and wrapped.args[0] == node.args[2] and expr.nodes[test.args[1]].op == "scalar"):
            node = plain
    return node.attr[0] if node.op == "input" else None


def _linear(expr: Expr, number: int) -> dict | None:
    """{term: coefficient} with terms "q_idx", "kv_idx", ("lengths", slot) (a 1-D tensor read at b) and
    the constant "1"; None when the node is not such a sum."""
    node = expr.nodes[number]
    if node.op == "input":
        return {node.attr[0]: 1} if node.attr[0] in ("q_idx", "kv_idx") else None
    if node.op == "scalar":
        value = expr.scalars[node.attr[0]]
        return {_ONE: value} if not isinstance(value, bool) and math.isfinite(value) else None
    if node.op == "load":
        if len(node.args) == 1 and _input_name(expr, node.args[0]) == "b" and node.kind != BOOL:
            return {("lengths", node.attr[0]): 1}
        return None
    if node.op == "cast":  # an int as a float is the same number; a float to an int is not
        inner = expr.nodes[node.args[0]]
        return _linear(expr, node.args[0]) if inner.kind != "float" and node.attr[0] != BOOL else None
    parts = [_linear(expr, a) for a in node.args]
    if any(p is None for p in parts):
        return None
    if node.op == "neg":
        return _scaled(parts[0], -1)
    if node.op in ("add", "sub"):
        return _sum(parts[0], _scaled(parts[1], -1 if node.op == "sub" else 1))
    if node.op == "mul":
        for mine, other in (parts, parts[::-1]):
            if set(mine) <= {_ONE}:
                return _scaled(other, mine.get(_ONE, 0))
    return None


def _scaled(form: dict, factor) -> dict:
    return {term: c * factor for term, c in form.items()}


def _sum(a: dict, b: dict) -> dict:
    total = dict(a)
    for term, c in b.items():
        total[term] = total.get(term, 0) + c
    return {term: c for term, c in total.items() if c != 0}


def _comparison(expr: Expr, number: int) -> tuple[str, int, int] | None:
    """(op, a, b) of a comparison, with `not` folded in."""
    node = expr.nodes[number]
    if node.op == "not":
        inner = _comparison(expr, node.args[0])
        return None if inner is None else (_NEGATED[inner[0]], inner[1], inner[2])
    if node.op in _FLIPPED:
        return node.op, node.args[0], node.args[1]
    return None


def _upper(op: str, bound) -> int | None:
    """The largest integer x with `x op bound` (op lt or le)."""
    return math.floor(bound) if op == "le" else math.ceil(bound) - 1


def _band(op: str, distance: dict) -> Band | None:
    """The band of `(q_idx - kv_idx) + constant op 0`."""
    t = -distance.get(_ONE, 0)  # q_idx - kv_idx op t
    if op in ("le", "lt"):
        return Band(_upper(op, t), None)
    if op in ("ge", "gt"):  # kv_idx - q_idx (op flipped) -t
        return Band(None, _upper(_FLIPPED[op], -t))
    if op == "eq" and float(t).is_integer():
        return Band(int(t), -int(t))
    return None


def _length(op: str, form: dict, axis: str) -> Length | None:
    """The length of `axis + lambda * lengths[b] + constant op 0`, lambda in {0, -1}."""
    if op not in ("lt", "le"):
        return None
    lengths = [term for term in form if isinstance(term, tuple)]
    constant = form.get(_ONE, 0)
    if not lengths:  # axis op -constant: a number of positions
        return Length(axis, None, max(_upper(op, -constant) + 1, 0))
    if len(lengths) != 1 or form[lengths[0]] != -1 or not float(constant).is_integer():
        return None
    return Length(axis, lengths[0][1], int(-constant) + (1 if op == "le" else 0))


def _abs_band(expr: Expr, op: str, a: int, b: int) -> Band | None:
    """|q_idx - kv_idx| op w (or w op' |...|)."""
    for mine, other, rel in ((a, b, op), (b, a, _FLIPPED[op])):
        node = expr.nodes[mine]
        bound = _linear(expr, other)
        if node.op == "abs" and rel in ("lt", "le") and bound is not None and set(bound) <= {_ONE}:
            inside = _linear(expr, node.args[0])
            if inside in ({"q_idx": 1, "kv_idx": -1}, {"q_idx": -1, "kv_idx": 1}):
                width = _upper(rel, bound.get(_ONE, 0))
                return Band(width, width)
    return None


def _document(expr: Expr, a: int, b: int) -> Document | None:
    x, y = expr.nodes[a], expr.nodes[b]
    if x.op != "load" or y.op != "load" or x.attr != y.attr or len(x.args) != len(y.args):
        return None
    names = [tuple(_input_name(expr, i) for i in n.args) for n in (x, y)]
    for first, second in (names, names[::-1]):
        if (first, second) in ((("q_idx",), ("kv_idx",)), (("b", "q_idx"), ("b", "kv_idx"))):
            return Document(x.attr[0], batched=len(first) == 2)
    return None


def _form(expr: Expr, number: int):
    comparison = _comparison(expr, number)
    if comparison is None:
        return None
    op, a, b = comparison
    if op == "eq":
        document = _document(expr, a, b)
        if document is not None:
            return document
    band = _abs_band(expr, op, a, b)
    if band is not None:
        return band
    left, right = _linear(expr, a), _linear(expr, b)
    if left is None or right is None:
        return None
    form = _sum(left, _scaled(right, -1))  # form op 0
    positions = {term: form.get(term, 0) for term in ("q_idx", "kv_idx")}
    if positions == {"q_idx": -1, "kv_idx": 1}:  # as q_idx - kv_idx, the comparison flipped
        form, op = _scaled(form, -1), _FLIPPED[op]
        positions = {"q_idx": 1, "kv_idx": -1}
    if positions == {"q_idx": 1, "kv_idx": -1}:
        return _band(op, form) if set(form) <= {"q_idx", "kv_idx", _ONE} else None
    for axis, other in (("q_idx", "kv_idx"), ("kv_idx", "q_idx")):
        if positions[other] == 0 and positions[axis] in (1, -1):
            if positions[axis] == -1:
                form, op = _scaled(form, -1), _FLIPPED[op]
            return _length(op, form, axis)
    return None


def mask_forms(expr: Expr) -> MaskForms:
    """The conditions of a traced mask_mod and the native form of each."""
    return MaskForms(expr, tuple((n, _form(expr, n)) for n in _conditions(expr, expr.output)))
