"""Helpers that build common pieces of a score_mod graph on any graph kind.

They work on cuDNN's callback graph, on the `EagerGraph` the reference runs, and on the
`RecordingGraph` that makes cache keys, so built-ins and user callbacks can share them.
"""

from __future__ import annotations

__all__ = ["data_type", "row_index", "col_index", "index_plus", "compare", "both", "keep_where"]

_COMPARE = {"lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge", "eq": "cmp_eq", "ne": "cmp_neq"}


def data_type(graph, name: str):
    """The graph's spelling of a data type ('BOOLEAN', 'INT32', 'FLOAT')."""
    own = getattr(type(graph), "data_type_named", None)
    if own is not None:
        return own(graph, name)
    import cudnn  # a real cuDNN callback graph

    return getattr(cudnn.data_type, name)


def _index(graph, score, axis: int):
    index = graph.gen_index(input=score, axis=axis, compute_data_type=data_type(graph, "INT32"))
    index.set_data_type(data_type(graph, "INT32"))
    return index


def row_index(graph, score):
    """The query position of each score (per sequence for packed layouts)."""
    return _index(graph, score, 2)


def col_index(graph, score):
    """The key position of each score (per sequence for packed layouts)."""
    return _index(graph, score, 3)


def index_plus(graph, index, shift):
    """index + shift in int32; keep both >= 0 (cuDNN 9.19 gave wrong masks for signed distances)."""
    total = graph.add(a=index, b=shift, compute_data_type=data_type(graph, "INT32"))
    total.set_data_type(data_type(graph, "INT32"))
    return total


def compare(graph, how: str, a, b):
    """a <how> b as a boolean tensor; how is one of lt, le, gt, ge, eq, ne."""
    if how not in _COMPARE:
        raise ValueError(f"compare: how: expected one of {', '.join(_COMPARE)}, got {how!r}")
    result = getattr(graph, _COMPARE[how])(input=a, comparison=b, compute_data_type=data_type(graph, "FLOAT"))
    result.set_data_type(data_type(graph, "BOOLEAN"))
    return result


def both(graph, a, b):
    """Logical and of two boolean tensors (either may be None: then the other).

    On cuDNN 9.19 a mask built from a chain of these gave wrong results (measured); prefer
    one keep_where per condition.
    """
    if a is None or b is None:
        return b if a is None else a
    result = graph.logical_and(a=a, b=b, compute_data_type=data_type(graph, "FLOAT"))
    result.set_data_type(data_type(graph, "BOOLEAN"))
    return result


def keep_where(graph, score, keep, masked):
    """score where keep, else the `masked` value (a tensor holding score_mods.MASKED)."""
    return graph.binary_select(input0=score, input1=masked, mask=keep)
