"""Which parts of a traced score_mod become aux tensors, and how one call computes them.

cuDNN's score_mod graph sees the score and the query and key positions, pass-by-value
scalars and tensors that broadcast to (B, Hq, Sq, Skv); it cannot gather. So every largest
piece of the expression that reads captured tensors or the batch and head numbers, and
does not read the score, is computed per call in the user's framework (over aranges of
B, Hq, Sq, Skv, broadcasting) and handed to the graph as a float32 tensor shaped by the
indices it uses: `bias[h]` is (1, Hq, 1, 1), `doc[b, q_idx]` is (B, 1, Sq, 1). A captured
tensor indexed by an expression of both q_idx and kv_idx (`rel[h, q_idx - kv_idx]`) is a
gather: its values become a (., ., Sq, Skv) tensor ("dense"; its memory is reported).
"""

from __future__ import annotations

from dataclasses import dataclass

from fusedattn.score_mods.expr import (
    BOOL,
    INDEX_INPUTS,
    Expr,
    ExprError,
    ancestors,
    dependencies,
    evaluate,
    evaluate_numbers,
)

__all__ = ["Aux", "AuxPlan", "plan_aux", "materialize", "index_grid", "aux_signature"]

_SCORES = frozenset({"score", "dscore"})
_BATCH_HEAD = frozenset({"b", "h"})
_POSITIONS = frozenset({"q_idx", "kv_idx"})


@dataclass(frozen=True)
class Aux:
    node: int  # the Expr node it stands for
    axes: tuple  # which of (b, h, q_idx, kv_idx) it varies over
    dense: bool  # a gather over both positions: (., ., Sq, Skv)
    host: bool = False  # computed from numbers only: a runtime scalar, computed on the host


@dataclass(frozen=True)
class AuxPlan:
    aux: tuple  # Aux entries, in node order
    graph_nodes: tuple  # the nodes the graph computes itself, in order

    def aux_of(self, node: int) -> int | None:
        for number, entry in enumerate(self.aux):
            if entry.node == node:
                return number
        return None

    def dense_bytes(self, shape: tuple) -> int:
        """float32 bytes of the dense aux tensors for a (B, Hq, Sq, Skv) call."""
        total = 0
        for entry in self.aux:
            if entry.dense:
                size = 4
                for axis, extent in zip(INDEX_INPUTS, shape):
                    size *= extent if axis in entry.axes else 1
                total += size
        return total


def plan_aux(expr: Expr) -> AuxPlan:
    deps = dependencies(expr)
    consumers: dict[int, list[int]] = {}
    for number, node in enumerate(expr.nodes):
        for a in node.args:
            consumers.setdefault(a, []).append(number)

    def candidate(number: int) -> bool:
        d, node = deps[number], expr.nodes[number]
        return (node.op != "scalar" and not d & _SCORES and not _POSITIONS <= d
                and (not d or bool(d & (_BATCH_HEAD | {"captured"}))))

    chosen: dict[int, bool] = {}  # node -> dense
    for number in range(len(expr.nodes)):
        users = consumers.get(number, [])
        if candidate(number) and (number == expr.output or any(not candidate(u) for u in users)):
            chosen[number] = False
    # What the graph must compute: walk back from the output, stopping at aux.
    needed, stack = set(), [expr.output]
    while stack:
        number = stack.pop()
        if number in needed:
            continue
        needed.add(number)
        if number in chosen:
            continue
        node = expr.nodes[number]
        if node.op == "load":  # a gather the graph cannot do: materialize it whole
            if deps[number] & _SCORES:
                raise ExprError("a captured tensor indexed by an expression of the score; index by b, h, q_idx "
                                "and kv_idx only")
            chosen[number] = True
            continue
        stack.extend(node.args)
    aux = tuple(Aux(n, tuple(a for a in INDEX_INPUTS if a in deps[n]), chosen[n], host=not deps[n])
                for n in sorted(chosen) if n in needed)
    graph_nodes = tuple(n for n in sorted(needed) if n not in chosen)
    return AuxPlan(aux, graph_nodes)


def aux_signature(expr: Expr, node: int) -> tuple:
    """What a node computes, values included (numbers, which captured tensors): equal signatures give
    equal aux tensors, across the forward's and the derivative's expressions."""
    position: dict[int, int] = {}
    parts = []
    for number in ancestors(expr, node):
        n = expr.nodes[number]
        if n.op == "scalar":
            attr = (expr.scalars[n.attr[0]],)
        elif n.op == "load":
            attr = (id(expr.captured[n.attr[0]]),)
        else:
            attr = n.attr
        position[number] = len(parts)
        parts.append((n.op, tuple(position[a] for a in n.args), attr, n.kind))
    return tuple(parts)


def index_grid(ops, like, shape: tuple) -> dict:
    """b, h, q_idx, kv_idx as int arrays that broadcast to `shape` = (B, Hq, Sq, Skv)."""
    grid = {}
    for axis, (name, extent) in enumerate(zip(INDEX_INPUTS, shape)):
        view = [1, 1, 1, 1]
        view[axis] = extent
        grid[name] = ops.reshape(ops.arange(extent, like=like, dtype="int32"), tuple(view))
    return grid


def materialize(expr: Expr, entry: Aux, ops, grid: dict, dtype: str = "float32", memo: dict | None = None,
                views: bool = False):
    """One aux tensor for this call: `dtype` (float32 for the graphs; float64 for a float64 call's term
    run as a bias), 4-D, extent 1 on the axes it does not use (a host entry is a Python float); dense,
    as the graphs read it, unless `views` (a term run as a bias, which the launch makes dense). memo:
    expr.evaluate's, kept by a caller that materializes the same entry again."""
    if entry.host:
        return evaluate_numbers(expr, entry.node)
    value = evaluate(expr, ops, grid, dtype, only=entry.node, memo=memo, views=views)
    if ops.dtype_name(value) == "bool" or expr.nodes[entry.node].kind == BOOL:
        value = ops.astype(value, dtype)
    node = expr.nodes[entry.node]
    if node.op == "load" and entry.dense:
        # A gather of a half-precision table (relative positions): its own values, exactly, in half the
        # bytes: the kernels read a dense aux tile per score tile, forward and backward.
        own = ops.dtype_name(expr.captured[node.attr[0]])
        if own in ("float16", "bfloat16"):
            value = ops.astype(value, own)
    shape = tuple(value.shape)
    if len(shape) < 4:
        value = ops.reshape(value, (1,) * (4 - len(shape)) + shape)
    return value
