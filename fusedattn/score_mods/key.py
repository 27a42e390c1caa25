"""Cache keys for cuDNN-native score_mod callbacks: what the callback builds, not who it is.

`structural_key(score_mod, tensors)` runs the callback once against a `RecordingGraph`, which
records every call it makes (op names, keyword arguments, baked-in constants, the shapes,
dtypes and strides of aux tensors) and returns placeholders. Two callbacks that build the
same graph get the same key; anything that changes the built graph changes the key. Runtime
scalars (Python or NumPy numbers, 0-d arrays) enter as "a scalar of this type": their value
is passed at execute time, so changing it never rebuilds. Nothing here uses id(), names or
addresses, and nothing imports cudnn, torch or JAX.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any

__all__ = ["RecordingGraph", "RecordedTensor", "structural_key", "describe_aux", "aux_used"]


class RecordedTensor:
    """A placeholder for a tensor the callback made, an aux tensor, or the score itself."""

    def __init__(self, graph: RecordingGraph, token: tuple):
        self._graph = graph
        self.token = token

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        # Tensor methods (set_data_type, set_name, ...) change the built graph: record them.
        def method(*args, **kwargs):
            self._graph._record(("method", name, self.token), args, kwargs)
            return self

        return method

    def __repr__(self) -> str:
        return f"<recorded {self.token}>"


class RecordingGraph:
    """Stands in for the cuDNN callback graph; every op call is recorded and returns a placeholder."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._count = 0

    def data_type_named(self, name: str) -> str:
        # graph_ops.data_type: recording and eager graphs name data types by string.
        return name

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)

        def op(*args, **kwargs):
            self._count += 1
            result = RecordedTensor(self, ("op", self._count))
            self._record(("op", name, self._count), args, kwargs)
            return result

        return op

    def _record(self, head: tuple, args, kwargs) -> None:
        normalized = tuple(_normalize(a) for a in args)
        named = tuple(sorted((k, _normalize(v)) for k, v in kwargs.items()))
        self.calls.append((head, normalized, named))


def _normalize(value: Any):
    """A hashable, content-based description of an argument of a graph call."""
    if isinstance(value, RecordedTensor):
        return value.token
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Number):  # a constant baked into the graph: its value matters
        return ("const", type(value).__name__, float(value) if not isinstance(value, int) else value)
    if isinstance(value, (tuple, list)):
        return tuple(_normalize(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _normalize(v)) for k, v in value.items()))
    text = str(value)  # enums such as cudnn.data_type.FLOAT, cudnn.pointwise_mode...
    return ("opaque", type(value).__name__, text)


def describe_aux(value: Any) -> tuple:
    """What of an aux entry shapes the graph: array metadata, or the type of a runtime scalar."""
    if type(value).__name__ == "RuntimeScalar":
        return ("scalar", value.dtype)
    if isinstance(value, (bool, numbers.Number)):
        return ("scalar", type(value).__name__)
    shape = getattr(value, "shape", None)
    if shape is None:
        raise ValueError(f"score_mod_tensors: expected arrays or numbers, got {type(value).__name__}")
    if len(shape) == 0 or (hasattr(value, "ndim") and value.ndim == 0):  # 0-d arrays are runtime scalars
        return ("scalar", str(value.dtype))
    if callable(getattr(value, "stride", None)):  # torch: strides in elements
        stride = tuple(value.stride())
    else:  # JAX arrays have none; XLA hands callbacks dense row-major buffers
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    dtype = str(value.dtype).removeprefix("torch.")
    return ("array", tuple(shape), dtype, stride)


def structural_key(score_mod: Callable, tensors: dict | None = None, score_mod_bprop: Callable | None = None,
                   bprop_tensors: dict | None = None, api: str = "score_mod") -> tuple:
    """The recorded structure of what the callbacks build, plus the aux entries' metadata.

    Both callbacks run against one recording graph and share one tensors dict, as they do
    in a real build (forward may leave intermediates there for bprop).
    """
    if not callable(score_mod):
        raise ValueError(f"{api}: score_mod: expected a callable score_mod(graph, score, tensors), got {score_mod!r}")
    if score_mod_bprop is not None and not callable(score_mod_bprop):
        raise ValueError(f"{api}: score_mod_bprop: expected a callable or None, got {score_mod_bprop!r}")
    aux = {**(tensors or {}), **(bprop_tensors or {})}
    described = tuple(sorted((str(name), describe_aux(value)) for name, value in aux.items()))
    graph = RecordingGraph()
    shared = {name: RecordedTensor(graph, ("aux", str(name))) for name in aux}
    parts = [described]
    for label, callback, start in (("score_mod", score_mod, ("score",)), ("score_mod_bprop", score_mod_bprop,
                                                                          ("dscore",))):
        if callback is None:
            parts.append((label, None))
            continue
        try:
            result = callback(graph, RecordedTensor(graph, start), shared)
        except Exception as error:
            raise ValueError(f"{api}: {label}: the callback failed while its graph was recorded: "
                             f"{type(error).__name__}: {error}") from error
        if not isinstance(result, RecordedTensor):
            raise ValueError(f"{api}: {label}: expected the callback to return a graph tensor, got "
                             f"{type(result).__name__}")
        parts.append((label, result.token))
    parts.append(tuple(graph.calls))
    return tuple(parts)


class _Tracking(dict):
    """A tensors dict that notes which entries are read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.read: set = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)

    def get(self, name, default=None):
        self.read.add(name)
        return super().get(name, default)


def aux_used(score_mod: Callable, names, score_mod_bprop: Callable | None = None) -> set:
    """The aux names the callbacks read (a graph declares only those: unused inputs are errors)."""
    graph = RecordingGraph()
    shared = _Tracking({name: RecordedTensor(graph, ("aux", str(name))) for name in names})
    score_mod(graph, RecordedTensor(graph, ("score",)), shared)
    if score_mod_bprop is not None:
        score_mod_bprop(graph, RecordedTensor(graph, ("dscore",)), shared)
    return shared.read & set(names)


_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int32": 4, "int64": 8}


def dense_aux_notes(aux: tuple) -> list[str]:
    """Lines for explain: the aux tensors that vary over both q_idx and kv_idx, which the call
    makes (or reads) whole every time, with their memory."""
    notes = []
    for name, description in aux:
        if description[0] != "array" or len(description[1]) != 4 or min(description[1][2:]) <= 1:
            continue
        shape, dtype, stride = description[1], description[2], description[3]
        if 0 in stride[2:]:  # a view spread over one axis (torch's expand): no copy, nothing per call
            continue
        size = math.prod(shape) * _BYTES.get(dtype, 4)
        notes.append(f"score_mod: {name} is a {list(shape)} {dtype} tensor over every (q_idx, kv_idx) pair, "
                     f"{size / 2**20:.3g} MiB per call (materialized: an index that mixes q_idx and kv_idx is a "
                     "gather, and a term over kv_idx alone is spread over Sq, as cuDNN 9.19 reads (., ., 1, Skv) "
                     "tensors wrongly in the backward)")
    return notes
