"""Lowering a traced score_mod (expr.Expr) to cuDNN's score_mod graph ops.

Every value is computed in float32 (`compute_data_type=FLOAT`): query and key positions
come from gen_index, integers stay exact below 2^24, and integer division and remainders
are floor/trunc of a float quotient. Booleans are cuDNN BOOLEAN tensors from comparisons;
where a float is needed they become 1/0 through a select. Runtime scalars, the aux
tensors of aux_plan and the constants 0, 1 and -1 come from the callbacks' shared tensors
dict, under names this module gives (see `scalar_name`, `aux_name`).
"""

from __future__ import annotations

from collections.abc import Callable

from fusedattn.score_mods.aux_plan import AuxPlan
from fusedattn.score_mods.expr import BOOL, COMPARE, FORWARD_VALUE, Expr
from fusedattn.score_mods.graph_ops import col_index, data_type, row_index

__all__ = ["lowered", "scalar_name", "aux_name", "forward_value_name", "CONSTANTS", "SAVED_SCORE",
           "LOWERING_VERSION"]

LOWERING_VERSION = 2  # part of a flex mod's key: a graph built by another lowering is never reused
CONSTANTS = {"k.zero": 0.0, "k.one": 1.0, "k.minus_one": -1.0}
SAVED_SCORE = "f.score"  # the forward's score, kept for the derivative's graph
_UNARY = {"neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "tanh": "tanh", "sigmoid": "sigmoid", "sin": "sin", "cos": "cos", "floor": "floor", "ceil": "ceil",
          "erf": "erf", "reciprocal": "reciprocal"}
_AB = {"add": "add", "sub": "sub", "mul": "mul", "div": "div"}
_INPUTS01 = {"max": "max", "min": "min", "pow": "pow"}
_MIRRORED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}  # a < b is b > a
_COMPARE = {"lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge", "eq": "cmp_eq", "ne": "cmp_neq"}


def scalar_name(prefix: str, slot: int) -> str:
    return f"{prefix}s{slot}"


def forward_value_name(node: int) -> str:
    """Where the forward's callback keeps a node's value for the derivative's `forward` leaves."""
    return f"f.node{node}"


def aux_name(prefix: str, number: int) -> str:
    return f"{prefix}a{number}"


class _Lowering:
    """Graph ops in our vocabulary. cuDNN 9.19 declines a score_mod graph (measured on an H100:
    "The matmul should either be an entrance node...", "Fused Attention graph was not given to
    the engine") where an op's first operand is not on the chain from the score: a pass-by-value
    scalar, an aux tensor, or a value made from those only, and gives wrong gradients for some
    that build (measured: JAX's 30 * dscore). So ops are rewritten to keep the chain first
    (operands swapped, s - x as -x + s, s / x as (1 / x) * s, selects flipped); only what cannot
    be rewritten (two aux tensors compared) is added to zeros made from the key index (`lead`)."""

    def __init__(self, graph, tensors: dict, start, score):
        self.g, self.t, self.start, self.score = graph, tensors, start, score
        self.float_type = data_type(graph, "FLOAT")
        self.on_chain: set[int] = {id(start)}
        self._zeros = None

    def chain(self, value):
        """Mark a value as made from the score (or dLoss/d(output))."""
        self.on_chain.add(id(value))
        return value

    def lead(self, value):
        if id(value) in self.on_chain:
            return value
        if self._zeros is None:  # from the key index, not the score: 0 * a masked (-inf) score is NaN
            index = self.chain(col_index(self.g, self.score))
            self._zeros = self.chain(self.g.mul(a=index, b=self.t["k.zero"], compute_data_type=self.float_type))
        return self.chain(self.g.add(a=self._zeros, b=value, compute_data_type=self.float_type))

    def _done(self, value, boolean: bool = False):
        if boolean:
            value.set_data_type(data_type(self.g, "BOOLEAN"))
        return self.chain(value)

    def on(self, value) -> bool:
        return id(value) in self.on_chain

    def unary(self, op: str, x):
        return self._done(getattr(self.g, op)(input=self.lead(x), compute_data_type=self.float_type))

    def ab(self, op: str, a, b):
        if not self.on(a) and self.on(b):  # keep the chain first: rewrite rather than add zeros
            if op in ("add", "mul"):
                a, b = b, a
            elif op == "sub":  # s - x = (-x) + s
                return self.ab("add", self.unary("neg", b), a)
            elif op == "div":  # s / x = (1 / x) * s
                return self.ab("mul", self.unary("reciprocal", b), a)
        return self._done(getattr(self.g, op)(a=self.lead(a), b=b, compute_data_type=self.float_type))

    def tanh_grad(self, g, x):
        """g * (1 - tanh(x)^2) as cuDNN's tanh_backward (one op), g on the chain."""
        if not self.on(g):
            t = self.unary("tanh", x)
            return self.ab("mul", g, self.ab("sub", self.t["k.one"], self.ab("mul", t, t)))
        return self._done(self.g.tanh_backward(loss=g, input=x, compute_data_type=self.float_type))

    def inputs01(self, op: str, a, b):
        if not self.on(a) and self.on(b) and op in ("max", "min"):
            a, b = b, a
        return self._done(getattr(self.g, op)(input0=self.lead(a), input1=b, compute_data_type=self.float_type))

    def compare(self, op: str, a, b):
        if not self.on(a) and self.on(b):
            a, b, op = b, a, _MIRRORED[op]
        return self._done(getattr(self.g, _COMPARE[op])(input=self.lead(a), comparison=b,
                                                        compute_data_type=self.float_type), boolean=True)

    def select(self, condition, if_true, if_false):
        if not self.on(condition):  # a boolean scalar or aux: compared on the chain instead
            condition = self.compare("ne", condition, self.t["k.zero"])
        if not self.on(if_true) and self.on(if_false):
            condition, if_true, if_false = self.logical("not", condition), if_false, if_true
        return self._done(self.g.binary_select(input0=self.lead(if_true), input1=if_false, mask=condition))

    def as_float(self, value, kind: str):
        return self.select(value, self.t["k.one"], self.t["k.zero"]) if kind == BOOL else value

    def as_bool(self, value, kind: str):
        return value if kind == BOOL else self.compare("ne", value, self.t["k.zero"])

    def trunc(self, x):
        return self.select(self.compare("lt", x, self.t["k.zero"]), self.unary("ceil", x), self.unary("floor", x))

    def logical(self, op: str, a, b=None):
        g = self.g
        if op == "not":
            return self._done(g.logical_not(input=self.lead(a), compute_data_type=self.float_type), boolean=True)
        if op == "xor":
            return self.compare("ne", self.as_float(a, BOOL), self.as_float(b, BOOL))
        method = g.logical_and if op == "and" else g.logical_or
        if not self.on(a) and self.on(b):
            a, b = b, a
        return self._done(method(a=self.lead(a), b=b, compute_data_type=self.float_type), boolean=True)


def _node_value(low: _Lowering, expr: Expr, number: int, values: dict, prefix: str, inputs):
    node = expr.nodes[number]
    kinds = [expr.nodes[a].kind for a in node.args]
    args = [values[a] for a in node.args]
    op = node.op
    if op == "input":
        return inputs(node.attr[0])
    if op == FORWARD_VALUE:  # computed by the forward's callback in this same (backward) graph
        return low.chain(low.t[forward_value_name(node.attr[0])])
    if op == "scalar":
        return low.t[scalar_name(prefix, node.attr[0])]
    if op == "cast":
        target = node.attr[0]
        if target == BOOL:
            return low.as_bool(args[0], kinds[0])
        value = low.as_float(args[0], kinds[0])
        return low.trunc(value) if target == "int" and kinds[0] == "float" else value
    if op == "where":
        condition = low.as_bool(args[0], kinds[0])
        if node.kind == BOOL:
            return low.as_bool(low.select(condition, low.as_float(args[1], kinds[1]),
                                          low.as_float(args[2], kinds[2])), "float")
        return low.select(condition, low.as_float(args[1], kinds[1]), low.as_float(args[2], kinds[2]))
    if op in ("and", "or", "xor", "not"):
        return low.logical(op, *(low.as_bool(a, k) for a, k in zip(args, kinds)))
    args = [low.as_float(a, k) for a, k in zip(args, kinds)]
    if op in COMPARE:
        return low.compare(op, *args)
    if op in _UNARY:
        return low.unary(_UNARY[op], args[0])
    if op == "trunc":
        return low.trunc(args[0])
    if op == "sign":
        x, t = args[0], low.t
        return low.select(low.compare("gt", x, t["k.zero"]), t["k.one"],
                          low.select(low.compare("lt", x, t["k.zero"]), t["k.minus_one"], t["k.zero"]))
    if op in _AB:
        return low.ab(_AB[op], *args)
    if op in _INPUTS01:
        return low.inputs01(_INPUTS01[op], *args)
    if op == "tanh_grad":
        return low.tanh_grad(*args)
    a, b = args
    quotient = low.ab("div", a, b)
    if op == "floordiv":
        return low.unary("floor", quotient)
    if op == "truncdiv":
        return low.trunc(quotient)
    if op in ("mod", "rem"):
        whole = low.unary("floor", quotient) if op == "mod" else low.trunc(quotient)
        return low.ab("sub", a, low.ab("mul", b, whole))
    raise ValueError(f"score_mod lowering: op {op!r} has no cuDNN form")


def lowered(expr: Expr, plan: AuxPlan, prefix: str, derivative: bool) -> Callable:
    """A cuDNN callback (graph, start, tensors) -> tensor computing `expr`.

    start is the score (forward) or dLoss/d(output) (derivative: the score then comes from
    the forward's callback, which keeps it under SAVED_SCORE and every node's value under
    forward_value_name, which the derivative's `forward` leaves read; both callbacks share tensors).
    """
    aux_of = {entry.node: number for number, entry in enumerate(plan.aux)}

    def callback(graph, start, tensors):
        if not derivative:
            tensors[SAVED_SCORE] = start
        score = tensors[SAVED_SCORE]
        low = _Lowering(graph, tensors, start, score)
        low.chain(score)

        def inputs(name: str):
            if name in ("q_idx", "kv_idx"):
                return low.chain((row_index if name == "q_idx" else col_index)(graph, score))
            return start if name == "dscore" else score

        values: dict = {}
        for number in sorted(set(plan.graph_nodes) | set(aux_of)):  # dependency order
            if number in aux_of:
                aux = tensors[aux_name(prefix, aux_of[number])]
                values[number] = low.as_bool(aux, "float") if expr.nodes[number].kind == BOOL else aux
            else:
                values[number] = _node_value(low, expr, number, values, prefix, inputs)
            if not derivative:
                tensors[forward_value_name(number)] = values[number]
        result = low.as_float(values[expr.output], expr.nodes[expr.output].kind)
        return low.lead(result)  # a result free of the score (a number, an aux tensor) still has its shape

    return callback
