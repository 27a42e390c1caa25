"""Our expression graph of a flex-style score_mod: what the framework's tracer saw, in one form.

A traced `score_mod(score, b, h, q_idx, kv_idx)` (or its derivative, or a mask_mod) becomes
an `Expr`: a list of pointwise `Node`s over the five inputs, runtime scalars (every number
the function used: changing one never changes the structure) and loads from captured
tensors (`bias[h]`, `doc[b, q_idx]`). The torch and JAX tracers (trace_torch.py,
trace_jax.py) both build it with `Builder`; the cuDNN lowering, the aux-tensor planner
and the structural key read it. Nothing here imports torch or JAX.

Kinds: every node is "float", "int" or "bool". Integer semantics are explicit in the op
names (floordiv, truncdiv, mod = floored remainder, rem = truncated remainder), because
torch and JAX spell them differently and the lowering computes them in float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["Node", "Expr", "Builder", "ExprError", "INPUTS", "INDEX_INPUTS", "FORWARD_VALUE", "UNARY", "BINARY",
           "COMPARE", "LOGICAL", "evaluate", "evaluate_numbers", "NUMBER_OPS", "ancestors", "dependencies",
           "result_kind"]

INPUTS = ("score", "b", "h", "q_idx", "kv_idx", "dscore")
INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")  # in the order of the score's axes (B, Hq, Sq, Skv)
FLOAT, INT, BOOL = "float", "int", "bool"
FORWARD_VALUE = "forward"  # a derivative's leaf: a value the forward's graph computed (see Node)

UNARY = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "sin", "cos", "floor", "ceil", "trunc",
         "erf", "sign", "reciprocal")
# tanh_grad(g, x) = g * (1 - tanh(x)^2): torch's tanh_backward kept whole, one cuDNN op (tanh_backward)
BINARY = ("add", "sub", "mul", "div", "floordiv", "truncdiv", "mod", "rem", "max", "min", "pow", "tanh_grad")
COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
LOGICAL = ("and", "or", "xor", "not")
_INTEGRAL_UNARY = ("neg", "abs", "sign", "floor", "ceil", "trunc")  # keep an int an int
_INTEGRAL_BINARY = ("add", "sub", "mul", "floordiv", "truncdiv", "mod", "rem", "max", "min")


class ExprError(ValueError):
    """A traced function that our expression graph cannot hold (the message names why)."""


@dataclass(frozen=True)
class Node:
    """One value: op over earlier nodes (args are node numbers), with structural attributes.

    input: attr = (name,);  scalar: attr = (slot,), its value in Expr.scalars;
    load: attr = (captured slot,), args = one index node per axis of the captured tensor;
    cast: attr = (kind,);
    forward (in a derivative only): attr = (node,), the value of that node of the forward's Expr, which
    the forward's graph has computed already (cuDNN runs both callbacks in one backward graph).
    """

    op: str
    args: tuple = ()
    attr: tuple = ()
    kind: str = FLOAT


def result_kind(op: str, kinds: list[str], attr: tuple = ()) -> str:
    """The kind an op gives for operands of these kinds."""
    if op in COMPARE or op in LOGICAL:
        return BOOL
    if op == "cast":
        return attr[0]
    if op == "where":
        return FLOAT if FLOAT in kinds[1:] else INT if INT in kinds[1:] else BOOL
    integral = all(k != FLOAT for k in kinds)
    if op in UNARY:
        return INT if integral and op in _INTEGRAL_UNARY else FLOAT
    if op in BINARY:
        return INT if integral and op in _INTEGRAL_BINARY else FLOAT
    raise ExprError(f"unknown op {op!r}")


@dataclass(frozen=True, eq=False)
class Expr:
    """A traced pointwise function: nodes in dependency order, the output node, and its values."""

    nodes: tuple
    output: int
    scalars: tuple = ()  # value of each scalar slot (Python numbers)
    captured: tuple = ()  # captured tensors, by load slot (the user's own arrays)
    key: tuple = field(default=(), compare=False)

    def node(self, number: int) -> Node:
        return self.nodes[number]

    def uses(self, name: str) -> bool:
        return any(n.op == "input" and n.attr == (name,) for n in self.nodes)

    def is_input(self, name: str) -> bool:
        """Whether the output is that input itself (a derivative of exactly dscore is 1)."""
        out = self.nodes[self.output]
        return out.op == "input" and out.attr == (name,)


def _describe_captured(array) -> tuple:
    dtype = str(getattr(array, "dtype", type(array).__name__)).removeprefix("torch.")
    return (tuple(getattr(array, "shape", ())), dtype)


class Builder:
    """Builds an Expr node by node; equal nodes are shared (common subexpressions once)."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self._numbers: dict[Node, int] = {}
        self.scalars: list = []
        self.captured: list = []
        self._captured_slot: dict[int, int] = {}

    def _add(self, node: Node) -> int:
        number = self._numbers.get(node)
        if number is None:
            number = self._numbers[node] = len(self.nodes)
            self.nodes.append(node)
        return number

    def kind(self, number: int) -> str:
        return self.nodes[number].kind

    def input(self, name: str, kind: str) -> int:
        if name not in INPUTS:
            raise ExprError(f"unknown input {name!r}")
        return self._add(Node("input", (), (name,), kind))

    def scalar(self, value) -> int:
        """A number used by the function: a runtime value, never part of the structure."""
        if isinstance(value, bool):
            kind = BOOL
        elif isinstance(value, int):
            kind = INT
        elif isinstance(value, float):
            kind = FLOAT
        else:
            raise ExprError(f"expected a Python number, got {type(value).__name__}")
        self.scalars.append(value)
        return self._add(Node("scalar", (), (len(self.scalars) - 1,), kind))

    def forward(self, node: int, kind: str) -> int:
        """The value of node `node` of the forward's Expr (in a derivative)."""
        return self._add(Node(FORWARD_VALUE, (), (node,), kind))

    def load(self, array, index: list[int], kind: str) -> int:
        """array[index...]: one index node per axis of a captured tensor."""
        shape = tuple(getattr(array, "shape", ()))
        if len(index) != len(shape):
            raise ExprError(f"a captured tensor of shape {shape} indexed by {len(index)} indices; index every "
                            "axis with one expression of b, h, q_idx or kv_idx")
        slot = self._captured_slot.get(id(array))
        if slot is None:
            slot = self._captured_slot[id(array)] = len(self.captured)
            self.captured.append(array)
        return self._add(Node("load", tuple(index), (slot,), kind))

    def op(self, name: str, *args: int, attr: tuple = ()) -> int:
        kinds = [self.nodes[a].kind for a in args]
        if name == "cast" and kinds[0] == attr[0]:
            return args[0]
        return self._add(Node(name, tuple(args), attr, result_kind(name, kinds, attr)))

    def include(self, expr: Expr, node: int | None = None) -> int:
        """Copy expr's node (default its output) and what it reads into this builder; inputs are shared
        by name, scalars and captured tensors keep their values. Returns the copy's number."""
        copied: dict[int, int] = {}
        for number in ancestors(expr, expr.output if node is None else node):
            n = expr.nodes[number]
            args = [copied[a] for a in n.args]
            if n.op == "input":
                copied[number] = self.input(n.attr[0], n.kind)
            elif n.op == "scalar":
                copied[number] = self.scalar(expr.scalars[n.attr[0]])
            elif n.op == "load":
                copied[number] = self.load(expr.captured[n.attr[0]], args, n.kind)
            else:
                copied[number] = self.op(n.op, *args, attr=n.attr)
        return copied[expr.output if node is None else node]

    def numbering(self, output: int, shared: dict | None = None) -> dict[int, int]:
        """Builder node -> its number in finish(output, shared): the nodes output needs, in order."""
        needed: set[int] = set()
        stack = [output]
        while stack:
            number = stack.pop()
            if number not in needed:
                needed.add(number)
                if not (shared and number in shared):
                    stack.extend(self.nodes[number].args)
        return {number: i for i, number in enumerate(sorted(needed))}

    def finish(self, output: int, shared: dict | None = None) -> Expr:
        """The Expr of `output`: unused nodes dropped, scalar and captured slots renumbered in use order.
        shared: builder node -> forward Expr node, for a derivative: those nodes become `forward` leaves."""
        renumber = self.numbering(output, shared)
        nodes, scalars, captured, captured_new = [], [], [], {}
        for number in renumber:
            node = self.nodes[number]
            attr = node.attr
            if shared and number in shared:
                nodes.append(Node(FORWARD_VALUE, (), (shared[number],), node.kind))
                continue
            if node.op == "scalar":
                scalars.append(self.scalars[attr[0]])
                attr = (len(scalars) - 1,)
            elif node.op == "load":
                if attr[0] not in captured_new:
                    captured_new[attr[0]] = len(captured)
                    captured.append(self.captured[attr[0]])
                attr = (captured_new[attr[0]],)
            nodes.append(Node(node.op, tuple(renumber[a] for a in node.args), attr, node.kind))
        nodes_t = tuple(nodes)
        key = (nodes_t, renumber[output], tuple(_describe_captured(a) for a in captured))
        return Expr(nodes_t, renumber[output], tuple(scalars), tuple(captured), key)


def ancestors(expr: Expr, node: int) -> list[int]:
    """The nodes `node` is computed from (itself included), in order."""
    seen, stack = set(), [node]
    while stack:
        number = stack.pop()
        if number not in seen:
            seen.add(number)
            stack.extend(expr.nodes[number].args)
    return sorted(seen)


def dependencies(expr: Expr) -> list[frozenset]:
    """For each node, the inputs it depends on; a load also counts as "captured"."""
    deps: list[frozenset] = []
    for node in expr.nodes:
        if node.op == "input":
            own = frozenset(node.attr)
        elif node.op == FORWARD_VALUE:
            own = frozenset({"score"})  # only values made from the score are shared
        elif node.op == "load":
            own = frozenset({"captured"}).union(*(deps[a] for a in node.args))
        else:
            own = frozenset().union(*(deps[a] for a in node.args))
        deps.append(own)
    return deps


# ----------------------------------------------------------------------------- evaluation

def _floor_mod(m, a, b):
    return a - b * m.floor(a / b)


def _trunc_rem(m, a, b):
    return a - b * m.trunc(a / b)


_MATH: dict = {}  # framework name -> its table (built once: evaluate runs on every call's aux tensors)


def _math(ops):
    """Elementwise functions of one framework, by our op names."""
    table = _MATH.get(ops.name)
    if table is None:
        table = _MATH[ops.name] = _math_table(ops)
    return table


def _math_table(ops):
    m = ops.module
    if ops.name == "torch":
        sigmoid, rsqrt, power = m.sigmoid, m.rsqrt, m.pow
    else:
        import jax

        sigmoid, rsqrt, power = jax.nn.sigmoid, jax.lax.rsqrt, m.power
    return {
        "neg": lambda x: -x, "abs": m.abs, "exp": m.exp, "log": m.log, "sqrt": m.sqrt, "rsqrt": rsqrt,
        "tanh": m.tanh, "sigmoid": sigmoid, "sin": m.sin, "cos": m.cos, "floor": m.floor, "ceil": m.ceil,
        "trunc": m.trunc, "erf": ops.erf, "sign": m.sign, "reciprocal": lambda x: 1.0 / x,
        "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
        "div": lambda a, b: a / b, "floordiv": lambda a, b: m.floor(a / b), "truncdiv": lambda a, b: m.trunc(a / b),
        "mod": lambda a, b: _floor_mod(m, a, b), "rem": lambda a, b: _trunc_rem(m, a, b),
        "max": m.maximum, "min": m.minimum, "pow": power, "tanh_grad": lambda g, x: g * (1.0 - m.tanh(x) ** 2),
        "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
        "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
        "and": m.logical_and, "or": m.logical_or, "xor": m.logical_xor, "not": m.logical_not,
    }


def _as_float(ops, x, dtype: str):
    return x if ops.dtype_name(x) == dtype else ops.astype(x, dtype)


def evaluate(expr: Expr, ops, env: dict, dtype: str = "float32", values: tuple | None = None, only=None,
             memo: dict | None = None, views: bool = False):
    """The Expr on arrays of one framework: env maps input names to arrays (broadcasting).

    Everything is computed in `dtype` (ints and bools as exact floats, as the cuDNN lowering
    does), so int division and remainders follow the op names, not a framework's int rules.
    values: the scalar slots (default the traced ones). only: a node number to stop at.
    memo: kept between calls with the same env, dtype and scalars: holds the nodes that read no
    captured tensor (indices, numbers) and their int64 casts, so a repeat call computes only the rest.
    views: a load indexed by the positions themselves may be a strided view of its array (_sliced), for
    a caller that makes the result dense itself.
    Returns the output (or node `only`) as a float array of `dtype`, or a bool array.
    """
    table = _math(ops)
    scalars = expr.scalars if values is None else values
    results: dict = {}
    like = next(iter(env.values()))
    stop = expr.output if only is None else only
    fixed = () if memo is None else memo.get(_FIXED_NODES)
    if fixed is None:
        fixed = memo[_FIXED_NODES] = frozenset(n for n, deps in enumerate(dependencies(expr)) if "captured" not in deps)
    for number in ancestors(expr, stop):
        if number in fixed and number in memo:
            results[number] = memo[number]
            continue
        node = expr.nodes[number]
        args = [results[a] for a in node.args]
        if node.op == "input":
            value = _as_float(ops, env[node.attr[0]], dtype)
        elif node.op == "scalar":
            value = ops.full((), scalars[node.attr[0]], like, "bool" if node.kind == BOOL else dtype)
        elif node.op == "load":
            array = expr.captured[node.attr[0]]
            value = _sliced(ops, expr, node, array, env) if views else None
            if value is None:
                index = tuple(_memo_index(ops, memo, fixed, a, i) for a, i in zip(node.args, args))
                value = array[index]
            value = _as_float(ops, value, dtype)
        elif node.op == "cast":
            value = _cast(ops, table, args[0], node.attr[0], dtype)
        elif node.op == "where":
            value = ops.where(_as_bool(ops, args[0]), args[1], args[2])
        elif node.op in COMPARE or node.op in LOGICAL:
            value = table[node.op](*(_as_bool(ops, a) if node.op in LOGICAL else a for a in args))
        else:
            value = table[node.op](*args)
        results[number] = value
        if number in fixed:
            memo[number] = value
    return results[stop]


_FIXED_NODES = "fixed nodes"  # evaluate's memo: which nodes it may keep


def _sliced(ops, expr: Expr, node: Node, array, env: dict):
    """A load indexed by the positions themselves, each axis of the array by its own one in the grid's
    order (slopes[h], bias[h, q_idx, kv_idx]): the array's leading part as a view placed on those axes,
    with no gather (whose backward sorts the indices on a GPU). None for any other load, or where the
    array is shorter than an axis (the gather raises there)."""
    names = [expr.nodes[a].attr[0] if expr.nodes[a].op == "input" else None for a in node.args]
    axes = [INDEX_INPUTS.index(n) if n in INDEX_INPUTS else -1 for n in names]
    if -1 in axes or axes != sorted(set(axes)) or len(axes) != len(array.shape):
        return None
    extents = [env[n].shape[axis] for n, axis in zip(names, axes)]
    if any(size < extent for size, extent in zip(array.shape, extents)):
        return None
    placed = [1, 1, 1, 1]
    for axis, extent in zip(axes, extents):
        placed[axis] = extent
    return ops.reshape(array[tuple(slice(0, extent) for extent in extents)], tuple(placed))


def _memo_index(ops, memo: dict | None, fixed, number: int, value):
    """Node `number`'s value as int64 indices, kept in the memo where the node is."""
    if number not in fixed:
        return _as_index(ops, value)
    key = ("index", number)
    if key not in memo:
        memo[key] = _as_index(ops, value)
    return memo[key]


def _as_bool(ops, x):
    return x if ops.dtype_name(x) == "bool" else x != 0


def _as_index(ops, x):
    return ops.astype(x, "int64")


def _cast(ops, table, x, kind: str, dtype: str):
    if kind == BOOL:
        return _as_bool(ops, x)
    if ops.dtype_name(x) == "bool":
        return ops.astype(x, dtype)
    return table["trunc"](x) if kind == INT else x


NUMBER_OPS = {
    "neg": lambda x: -x, "abs": abs, "exp": math.exp, "log": math.log, "sqrt": math.sqrt,
    "rsqrt": lambda x: 1.0 / math.sqrt(x), "tanh": math.tanh, "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
    "sin": math.sin, "cos": math.cos, "floor": math.floor, "ceil": math.ceil, "trunc": math.trunc, "erf": math.erf,
    "sign": lambda x: (x > 0) - (x < 0), "reciprocal": lambda x: 1.0 / x,
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b, "div": lambda a, b: a / b,
    "floordiv": lambda a, b: math.floor(a / b), "truncdiv": lambda a, b: math.trunc(a / b),
    "mod": lambda a, b: a - b * math.floor(a / b), "rem": lambda a, b: a - b * math.trunc(a / b),
    "max": max, "min": min, "pow": lambda a, b: a ** b, "tanh_grad": lambda g, x: g * (1.0 - math.tanh(x) ** 2),
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "and": lambda a, b: bool(a) and bool(b), "or": lambda a, b: bool(a) or bool(b),
    "xor": lambda a, b: bool(a) != bool(b), "not": lambda a: not a,
    "where": lambda c, a, b: a if c else b,
}


def evaluate_numbers(expr: Expr, node: int) -> float:
    """A node computed from scalars only, in Python numbers (on the host, no framework)."""
    results: dict = {}
    for number in ancestors(expr, node):
        n = expr.nodes[number]
        args = [results[a] for a in n.args]
        if n.op == "scalar":
            value = expr.scalars[n.attr[0]]
        elif n.op == "cast":
            value = bool(args[0]) if n.attr[0] == BOOL else math.trunc(args[0]) if n.attr[0] == INT else args[0]
        elif n.op in NUMBER_OPS:
            value = NUMBER_OPS[n.op](*args)
        else:
            raise ExprError(f"op {n.op!r} of numbers only")
        results[number] = value
    return float(results[node])
