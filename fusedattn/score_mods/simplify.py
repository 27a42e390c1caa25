"""Fewer and cheaper ops per score for a traced score_mod, the value kept (up to rounding).

What the frameworks' tracers give is correct but not lean: `30 * tanh(score / 30)` divides
every score, and its derivative from autodiff is `tanh_grad(dscore * 30, score / 30) / 30`,
two divisions and a product more than the hand-written derivative `tanh_grad(dscore, x)`.
A float division is several instructions on the GPU, and the cuDNN kernel runs these ops on
every score of every tile. The rewrites here, applied to the nodes that depend on the score
(or dscore) only:

- `x / y`, with y free of the score and of one position at most (a number, `temp[h]`), is
  `x * (1 / y)`: the reciprocal is a number computed once, or an aux tensor (aux_plan).
- Number-only factors move out of products: `(a * k1) * (b * k2)` is `(a * b) * (k1 * k2)`.
- `tanh_grad(g * k, x)` is `tanh_grad(g, x) * k` (it is linear in g), and
  `a * k + b * k` is `(a + b) * k`: an autodiff derivative's scales meet and cancel into one
  number, `k1 * k2` folded on the host.

The structure of the result depends on the structure of the traced function only, never on
its numbers (folded numbers are new runtime scalars): a new cap still builds nothing. Index
arithmetic is left as it is, so masks compare exactly what the user's function compares.
"""

from __future__ import annotations

import math

from fusedattn.score_mods.expr import FLOAT, FORWARD_VALUE, INT, NUMBER_OPS, Builder, Expr, ExprError, dependencies

__all__ = ["simplified", "simplified_with_map"]

_SCORES = frozenset({"score", "dscore"})
_POSITIONS = frozenset({"q_idx", "kv_idx"})
_NUMBERS = (FLOAT, INT)


def _ieee(op: str, *args) -> float:
    """A folded number as float32 arithmetic would give it (x / 0 is an infinity, not an exception)."""
    try:
        return float(NUMBER_OPS[op](*args))
    except ZeroDivisionError:
        numerator = 1.0 if op == "reciprocal" else args[0]
        if numerator == 0 or math.isnan(numerator):
            return math.nan
        return math.copysign(math.inf, numerator) * math.copysign(1.0, args[-1])
    except OverflowError:
        return math.inf


class _Rewriter:
    """Copies an Expr into a Builder, rewriting the score's ops as it goes."""

    def __init__(self, forward: Expr | None) -> None:
        self.b = Builder()
        self.forward = forward  # the forward's Expr, when rewriting its derivative
        self.numbers: dict[int, float] = {}  # node made of numbers only -> its value
        self.free: dict[int, frozenset] = {}  # node free of the score and dscore -> the inputs it reads
        self._folded: dict[tuple, int] = {}

    def copy(self, expr: Expr) -> dict[int, int]:
        """expr's nodes copied and rewritten: its node -> the builder's node of the same value."""
        deps = dependencies(expr)
        new: dict[int, int] = {}
        for number, node in enumerate(expr.nodes):
            args = [new[a] for a in node.args]
            if node.op == "input":
                made = self.b.input(node.attr[0], node.kind)
            elif node.op == FORWARD_VALUE:
                made = self.b.forward(node.attr[0], node.kind)
            elif node.op == "scalar":
                value = expr.scalars[node.attr[0]]
                made = self.b.scalar(value)
                self.numbers[made] = value
            elif node.op == "load":
                made = self.b.load(expr.captured[node.attr[0]], args, node.kind)
            elif deps[number] & _SCORES:
                made = self.op(node.op, args, node.attr)
            else:
                made = self.b.op(node.op, *args, attr=node.attr)
                if node.op in NUMBER_OPS and node.op != "where" and all(a in self.numbers for a in args):
                    self.numbers[made] = _ieee(node.op, *(self.numbers[a] for a in args))
            if not deps[number] & _SCORES:
                self.free[made] = deps[number]
            new[number] = made
        return new

    def fold(self, op: str, *args: int) -> int:
        """A runtime scalar holding op(args) of number-only nodes (one per op and operands)."""
        key = (op, args)
        made = self._folded.get(key)
        if made is None:
            value = _ieee(op, *(float(self.numbers[a]) for a in args))
            if not math.isfinite(value):
                raise ExprError(f"a number computed from the function's numbers ({op} of "
                                f"{', '.join(repr(self.numbers[a]) for a in args)}) is not finite")
            made = self._folded[key] = self.b.scalar(value)
            self.numbers[made] = value
            self.free[made] = frozenset()
        return made

    def _number(self, node: int) -> bool:
        return node in self.numbers and self.b.kind(node) == FLOAT

    def _factor(self, node: int) -> tuple[int | None, int | None]:
        """(rest, number-only factor) of a node: a number is (None, it), a * k is (a, k)."""
        if self._number(node):
            return None, node
        n = self.b.nodes[node]
        if n.op == "mul":
            a, k = n.args
            if self._number(a):
                a, k = k, a
            if self._number(k):
                return a, k
        return node, None

    def mul(self, a: int, b: int) -> int:
        (rest_a, k_a), (rest_b, k_b) = self._factor(a), self._factor(b)
        rests = [r for r in (rest_a, rest_b) if r is not None]
        factors = [k for k in (k_a, k_b) if k is not None]
        if not rests or len(factors) + len(rests) < 3:  # numbers only, or nothing to move
            return self.b.op("mul", a, b)
        rest = rests[0] if len(rests) == 1 else self.b.op("mul", *rests)
        factor = factors[0] if len(factors) == 1 else self.fold("mul", *factors)
        return self.b.op("mul", rest, factor)

    def _reciprocal_free(self, y: int) -> bool:
        """Whether 1 / y is computed off the graph: a number, or an aux tensor of one position at most."""
        return y in self.free and self.b.kind(y) in _NUMBERS and not _POSITIONS <= self.free[y]

    def op(self, name: str, args: list[int], attr: tuple) -> int:
        b = self.b
        if name == "mul":
            return self._tanh_square_derivative(*args) or self.mul(*args)
        if name == "div" and self._reciprocal_free(args[1]) and b.kind(args[0]) in _NUMBERS:
            y = args[1]
            inverse = self.fold("reciprocal", y) if y in self.numbers else b.op("reciprocal", y)
            self.free.setdefault(inverse, self.free[y])
            return self.mul(args[0], inverse)
        if name == "tanh_grad":
            rest, k = self._factor(args[0])
            if rest is not None and k is not None:
                return self.mul(b.op("tanh_grad", rest, args[1]), k)
        if name in ("add", "sub"):
            (rest_a, k_a), (rest_b, k_b) = self._factor(args[0]), self._factor(args[1])
            if k_a is not None and k_a == k_b and rest_a is not None and rest_b is not None:
                return self.mul(self.op(name, [rest_a, rest_b], attr), k_a)
            if name == "add":
                found = self._tanh_derivative(*args)
                if found is not None:
                    return found
        return b.op(name, *args, attr=attr)

    def _tanh_input(self, t: int) -> int | None:
        """x when node t is tanh(x), here or as the forward's value."""
        node = self.b.nodes[t]
        if node.op == "tanh":
            return node.args[0]
        if node.op == FORWARD_VALUE and self.forward is not None:
            made = self.forward.nodes[node.attr[0]]
            if made.op == "tanh":
                return self.b.forward(made.args[0], self.forward.nodes[made.args[0]].kind)
        return None

    def _one_minus(self, node: int, t: int) -> bool:
        n = self.b.nodes[node]
        return n.op == "sub" and n.args[1] == t and self.numbers.get(n.args[0]) == 1

    def _tanh_derivative(self, a: int, b: int) -> int | None:
        """JAX's derivative of tanh, g * (1 - t) + g * (1 - t) * t with t = tanh(x), as tanh_grad(g, x): one
        cuDNN op (torch's tracer gives that form directly). The 1 is JAX's own constant, always exactly 1."""
        nodes = self.b.nodes
        for first, second in ((a, b), (b, a)):
            product, scaled = nodes[first], nodes[second]
            if product.op != "mul" or scaled.op != "mul" or first not in scaled.args:
                continue
            t = scaled.args[1] if scaled.args[0] == first else scaled.args[0]
            for g, one_minus_t in (product.args, product.args[::-1]):
                if self._one_minus(one_minus_t, t) and self.b.kind(g) == FLOAT:
                    x = self._tanh_input(t)
                    if x is not None:
                        return self.b.op("tanh_grad", g, x)
        return None

    def _tanh_square_derivative(self, a: int, b: int) -> int | None:
        """g * (1 - t * t) with t = tanh(x) (newer JAX's one_minus_square) as tanh_grad(g, x)."""
        for g, one_minus in ((a, b), (b, a)):
            node = self.b.nodes[one_minus]
            if node.op != "sub" or self.b.kind(g) != FLOAT:
                continue
            square = self.b.nodes[node.args[1]]
            if square.op == "mul" and square.args[0] == square.args[1] and self._one_minus(one_minus, node.args[1]):
                x = self._tanh_input(square.args[0])
                if x is not None:
                    return self.b.op("tanh_grad", g, x)
        return None


def simplified(expr: Expr, forward: Expr | None = None) -> Expr:
    """expr with the rewrites above; an ExprError when a folded number is not finite (x / 0).
    forward: the forward's Expr when expr is a derivative reading its values."""
    return simplified_with_map(expr, forward)[0]


def simplified_with_map(expr: Expr, forward: Expr | None = None) -> tuple[Expr, dict[int, int]]:
    """simplified(expr, forward), and which of expr's nodes has its value in the result (node -> node; a
    node rewritten away is missing)."""
    rewriter = _Rewriter(forward)
    new = rewriter.copy(expr)
    output = new[expr.output]
    numbering = rewriter.b.numbering(output)
    kept = {number: numbering[made] for number, made in new.items() if made in numbering}
    return rewriter.b.finish(output), kept
