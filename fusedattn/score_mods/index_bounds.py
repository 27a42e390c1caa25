"""Captured tensors indexed within their extents, checked before a call reads them.

An index past a captured tensor's end (`doc[b, q_idx]` with doc (B, 6) in a call of Sq=8) makes
torch raise IndexError from deep inside a call, and makes JAX clamp it to the last entry: a silent
wrong answer, on the reference as on the fused graph. So every load's index expressions get a range
from the call's extents (interval arithmetic over the integer ops), checked against the captured
tensor's shape when the call binds. Negative indices count from the end in both frameworks, so the
accepted range of an axis of size n is [-n, n - 1]. An index whose range cannot be known (one read
from another tensor) is not checked.
"""

from __future__ import annotations

import math

from fusedattn.cache import LRUCache, register
from fusedattn.score_mods.expr import BOOL, INDEX_INPUTS, Expr

__all__ = ["check_indices", "index_ranges"]


def _hull(*values) -> tuple:
    return (min(values), max(values))


def _divided(a: tuple, b: tuple, rounding) -> tuple | None:
    if b[0] <= 0 <= b[1]:
        return None  # a divisor that may be 0: no bound
    return _hull(*(rounding(x / y) for x in a for y in b))


def _remainder(a: tuple, b: tuple, floored: bool) -> tuple | None:
    if b[0] <= 0:
        return None
    if 0 <= a[0] and a[1] < b[0]:
        return a  # already below every divisor: unchanged
    if floored:
        return (0, b[1] - 1)
    return (0, min(a[1], b[1] - 1)) if a[0] >= 0 else (-(b[1] - 1), b[1] - 1)


def _abs(a: tuple) -> tuple:
    if a[0] >= 0:
        return a
    if a[1] <= 0:
        return (-a[1], -a[0])
    return (0, max(-a[0], a[1]))


_UNARY = {"neg": lambda a: (-a[1], -a[0]), "abs": _abs, "floor": lambda a: (math.floor(a[0]), math.floor(a[1])),
          "ceil": lambda a: (math.ceil(a[0]), math.ceil(a[1])), "trunc": lambda a: (math.trunc(a[0]), math.trunc(a[1])),
          "sign": lambda a: (-1 if a[0] < 0 else 0 if a[0] == 0 else 1, -1 if a[1] < 0 else 0 if a[1] == 0 else 1),
          "cast": lambda a: (math.trunc(a[0]), math.trunc(a[1]))}
_BINARY = {"add": lambda a, b: (a[0] + b[0], a[1] + b[1]), "sub": lambda a, b: (a[0] - b[1], a[1] - b[0]),
           "mul": lambda a, b: _hull(*(x * y for x in a for y in b)),
           "max": lambda a, b: (max(a[0], b[0]), max(a[1], b[1])),
           "min": lambda a, b: (min(a[0], b[0]), min(a[1], b[1])),
           "floordiv": lambda a, b: _divided(a, b, math.floor), "truncdiv": lambda a, b: _divided(a, b, math.trunc),
           "mod": lambda a, b: _remainder(a, b, floored=True), "rem": lambda a, b: _remainder(a, b, floored=False)}


def _narrowed(expr: Expr, condition: int, ranges: list, holds: bool) -> tuple | None:
    """(node, its range where `condition` is `holds`) for a comparison of a node with a number (JAX's
    negative-index rule is where(x < 0, x + n, x)); None for any other condition."""
    node = expr.nodes[condition]
    if node.op not in ("lt", "le", "gt", "ge") or len(node.args) != 2:
        return None
    op, (x, y) = node.op, node.args
    if expr.nodes[x].op == "scalar":  # c < x is x > c
        op, (x, y) = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[op], (y, x)
    if expr.nodes[y].op != "scalar" or ranges[x] is None or not isinstance(expr.scalars[expr.nodes[y].attr[0]], int):
        return None
    if not holds:
        op = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt"}[op]
    bound, (low, high) = expr.scalars[expr.nodes[y].attr[0]], ranges[x]
    if op == "lt":
        high = min(high, bound - 1)
    elif op == "le":
        high = min(high, bound)
    elif op == "gt":
        low = max(low, bound + 1)
    else:
        low = max(low, bound)
    return x, (low, high)


def index_ranges(expr: Expr, shape: tuple, given: dict | None = None, upto: int | None = None) -> list:
    """Each node's (low, high) over a call of shape (B, Hq, Sq, Skv), or None where it cannot be bounded
    (a float computation, a value read from a tensor, a division by a range holding 0). given: node ->
    range to use instead (a where's branch, where its condition holds); upto: the last node wanted."""
    extents = dict(zip(INDEX_INPUTS, shape))
    ranges: list = []
    for number, node in enumerate(expr.nodes[:None if upto is None else upto + 1]):
        args = [ranges[a] for a in node.args]
        found = None
        if given and number in given:
            found = given[number]
        elif node.op == "input" and node.attr[0] in extents:
            found = (0, extents[node.attr[0]] - 1)
        elif node.op == "scalar":
            value = expr.scalars[node.attr[0]]
            found = (value, value) if math.isfinite(value) else None
        elif node.op == "cast" and expr.nodes[node.args[0]].kind == BOOL:
            found = (0, 1)
        elif node.op == "where":
            found = _where(expr, shape, node, ranges, given)
        elif None not in args:
            if node.op in _UNARY and len(args) == 1:
                found = _UNARY[node.op](args[0])
            elif node.op in _BINARY:
                found = _BINARY[node.op](*args)
        ranges.append(found)
    return ranges


def _where(expr: Expr, shape: tuple, node, ranges: list, given: dict | None) -> tuple | None:
    """A where's range: each branch's where its condition lets it be taken (a branch never taken adds
    nothing), else the hull of both."""
    parts = []
    for branch, holds in ((node.args[1], True), (node.args[2], False)):
        narrowed = _narrowed(expr, node.args[0], ranges, holds)
        if narrowed is None:
            parts.append(ranges[branch])
            continue
        x, (low, high) = narrowed
        if low > high:
            continue  # never taken
        parts.append(index_ranges(expr, shape, {**(given or {}), x: (low, high)}, upto=branch)[branch])
    if None in parts:
        return None
    return _hull(*(v for part in parts for v in part)) if parts else None


def _before_wrapping(expr: Expr, number: int) -> int:
    """The index a JAX trace wrapped as where(x < 0, x + n, x) (its negative-index rule): x, whose own
    range is what must lie in [-n, n - 1] (a wrapped index below 0 would be clamped); else number."""
    node = expr.nodes[number]
    if node.op != "where":
        return number
    condition, wrapped, x = (expr.nodes[a] for a in node.args)
    zero = expr.nodes[condition.args[1]] if condition.op == "lt" else None
    if (zero is not None and condition.args[0] == node.args[2] and zero.op == "scalar"
            and expr.scalars[zero.attr[0]] == 0 and wrapped.op == "add" and wrapped.args[0] == node.args[2]):
        return node.args[2]
    return number


# (id(expr), call shape, captured shapes) -> expr, for the checks that passed (a repeat bind asks again)
_PASSED: LRUCache = register("score_mods.index_bounds.passed", LRUCache(64))


def check_indices(label: str, expr: Expr, shape: tuple) -> None:
    """Raises ValueError naming the tensor, the axis and the reach when an index of expr can leave a
    captured tensor's extent in a call of shape (B, Hq, Sq, Skv)."""
    key = (id(expr), tuple(shape), tuple(tuple(getattr(a, "shape", ())) for a in expr.captured))
    if _PASSED.peek(key) is expr:
        return
    _check(label, expr, shape)
    _PASSED.put(key, expr)


def _check(label: str, expr: Expr, shape: tuple) -> None:
    ranges = None
    for node in expr.nodes:
        if node.op != "load":
            continue
        if ranges is None:
            ranges = index_ranges(expr, shape)
        captured = tuple(getattr(expr.captured[node.attr[0]], "shape", ()))
        for axis, (arg, size) in enumerate(zip(node.args, captured)):
            reach = ranges[_before_wrapping(expr, arg)]
            if reach is not None and (reach[0] < -size or reach[1] > size - 1):
                names = dict(zip(INDEX_INPUTS, ("B", "Hq", "Sq", "Skv")))
                call = ", ".join(f"{names[n]}={e}" for n, e in zip(INDEX_INPUTS, shape))
                raise ValueError(
                    f"{label}: a captured tensor of shape {captured} is indexed on its axis {axis} by values "
                    f"from {reach[0]} to {reach[1]} in this call ({call}); that axis takes indices in "
                    f"[{-size}, {size - 1}]. Give the tensor the call's extent (torch would raise IndexError; "
                    "JAX would clamp the index and give a wrong answer)")
