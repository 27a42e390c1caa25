"""Running a cuDNN-native score_mod callback eagerly on a materialised score array.

`EagerGraph` answers the callback graph's ops (cuDNN's names and keywords) with torch
or jax.numpy arithmetic, so the reference backend runs any user callback without a GPU,
and autodiff through it is the truth a callback's bprop is tested against.
"""

from __future__ import annotations

import math

__all__ = ["EagerGraph", "EagerValue", "run_eager"]


class EagerValue:
    """An array (or number) standing in for a graph tensor; tensor setters are accepted."""

    def __init__(self, graph: EagerGraph, value):
        self._graph, self.value = graph, value

    def set_data_type(self, data_type):
        self.value = self._graph.cast(self.value, data_type)
        return self

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        # set_name, set_output, set_dim, ...: no meaning for an eager value.
        return lambda *args, **kwargs: self


def _kind(data_type) -> str:
    text = str(data_type).upper()
    for kind in ("BOOLEAN", "INT32", "INT64", "BFLOAT16", "HALF", "FLOAT", "DOUBLE"):
        if kind in text:
            return kind
    return "FLOAT"


_BINARY = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
           "div": lambda a, b: a / b, "add_square": lambda a, b: a + b * b}
_BINARY_INPUTS = {"max": "maximum", "min": "minimum", "mod": "remainder", "pow": "pow"}
_COMPARE = {"cmp_eq": lambda a, b: a == b, "cmp_neq": lambda a, b: a != b, "cmp_lt": lambda a, b: a < b,
            "cmp_le": lambda a, b: a <= b, "cmp_gt": lambda a, b: a > b, "cmp_ge": lambda a, b: a >= b}
_UNARY_SAME_NAME = ("abs", "ceil", "cos", "exp", "floor", "log", "sin", "sqrt", "tan", "tanh")


class EagerGraph:
    """Stands in for cuDNN's callback graph; `ops` is the fusedattn.xp namespace of the score."""

    def __init__(self, ops, like, dtype: str):
        self.ops, self._like, self._dtype = ops, like, dtype
        self._math = ops.module

    def data_type_named(self, name: str) -> str:
        return name

    # -- values
    def _v(self, x):
        return x.value if isinstance(x, EagerValue) else x

    def _wrap(self, value) -> EagerValue:
        return EagerValue(self, value)

    def _float(self, x):
        x = self._v(x)
        if isinstance(x, (int, float)):
            return x
        return x if self.ops.dtype_name(x) == self._dtype else self.ops.astype(x, self._dtype)

    def cast(self, value, data_type):
        kind = _kind(data_type)
        if isinstance(value, (int, float, bool)):
            return bool(value) if kind == "BOOLEAN" else int(value) if kind.startswith("INT") else float(value)
        if kind == "BOOLEAN":
            return value != 0
        if kind.startswith("INT"):
            return self.ops.astype(self._trunc(value), "int32")
        return self.ops.astype(value, self._dtype)

    def _trunc(self, value):
        if self.ops.dtype_name(value) in ("bool", "int32", "int64"):
            return value
        return self._math.trunc(value)

    def _result(self, value, compute_data_type=None, **_):
        if compute_data_type is not None and _kind(compute_data_type).startswith("INT"):
            value = self.cast(value, "INT32")
        return self._wrap(value)

    # -- ops in cuDNN's vocabulary (keywords as in the frontend's bindings; positional too).
    # Each op also takes compute_data_type= and name=; name has no meaning here.
    def __getattr__(self, op: str):
        if op in _BINARY:
            combine = _BINARY[op]
            return lambda a=None, b=None, *, compute_data_type=None, name=None: self._result(
                combine(self._float(a), self._float(b)), compute_data_type)
        if op in _BINARY_INPUTS:
            combine = getattr(self._math, _BINARY_INPUTS[op])
            return lambda input0=None, input1=None, *, compute_data_type=None, name=None: self._result(
                combine(self._as_array(self._float(input0)), self._as_array(self._float(input1))), compute_data_type)
        if op in _COMPARE:
            test = _COMPARE[op]
            return lambda input=None, comparison=None, *, compute_data_type=None, name=None: self._wrap(
                test(self._as_array(self._float(input)), self._float(comparison)))
        if op in _UNARY_SAME_NAME:
            apply = getattr(self._math, op)
            return lambda input=None, *, compute_data_type=None, name=None: self._result(
                apply(self._as_array(self._float(input))), compute_data_type)
        raise AttributeError(f"score_mod graph: op {op!r} has no eager form in fusedattn (EagerGraph); the "
                             "reference backend cannot run this callback")

    def _as_array(self, x):
        if isinstance(x, (int, float)):
            return self.ops.full((), x, self._like, self._dtype)
        return x

    def neg(self, input=None, **kwargs):
        return self._result(-self._float(input), **kwargs)

    def identity(self, input=None, **kwargs):
        return self._wrap(self._v(input))

    def reciprocal(self, input=None, **kwargs):
        return self._result(1.0 / self._float(input), **kwargs)

    def rsqrt(self, input=None, **kwargs):
        return self._result(1.0 / self._math.sqrt(self._as_array(self._float(input))), **kwargs)

    def sigmoid(self, input=None, **kwargs):
        return self._result(1.0 / (1.0 + self.ops.exp(-self._as_array(self._float(input)))), **kwargs)

    def softplus(self, input=None, **kwargs):
        x = self._as_array(self._float(input))
        return self._result(self.ops.maximum(x, 0.0 * x) + self.ops.log(1.0 + self.ops.exp(-self.ops.abs(x))),
                            **kwargs)

    def logical_not(self, input=None, **kwargs):
        return self._wrap(self._v(input) == 0)

    def logical_and(self, a=None, b=None, **kwargs):
        return self._wrap(self.ops.logical_and(self._v(a) != 0, self._v(b) != 0))

    def logical_or(self, a=None, b=None, **kwargs):
        return self._wrap((self.cast(self._v(a), "INT32") + self.cast(self._v(b), "INT32")) != 0)

    def binary_select(self, input0=None, input1=None, mask=None, **kwargs):
        keep = self._v(mask)
        keep = keep if self.ops.dtype_name(keep) == "bool" else keep != 0
        return self._wrap(self.ops.where(keep, self._float(input0), self._float(input1)))

    def gen_index(self, input=None, axis=None, **kwargs):
        shape = self._v(input).shape
        index = [1] * len(shape)
        index[axis] = shape[axis]
        value = self.ops.reshape(self.ops.arange(shape[axis], like=self._like, dtype="int32"), index)
        return self._wrap(self.ops.broadcast_to(value, tuple(shape)))

    def scale(self, input=None, scale=None, **kwargs):
        return self._result(self._float(input) * self._float(scale), **kwargs)

    def bias(self, input=None, bias=None, **kwargs):
        return self._result(self._float(input) + self._float(bias), **kwargs)

    def tensor_scalar(self, value, scalar_type=None, **kwargs):
        return self._wrap(value)

    def relu(self, input=None, negative_slope=None, lower_clip=None, upper_clip=None, **kwargs):
        x = self._as_array(self._float(input))
        y = self.ops.where(x > 0, x, x * (negative_slope or 0.0))
        if lower_clip is not None:
            y = self.ops.maximum(y, self._as_array(float(lower_clip)) + 0.0 * y)
        if upper_clip is not None:
            y = self._math.minimum(y, self._as_array(float(upper_clip)) + 0.0 * y)
        return self._wrap(y)

    # derivatives: loss is dLoss/d(output of the op), input is the op's input
    def tanh_backward(self, loss=None, input=None, **kwargs):
        t = self._math.tanh(self._as_array(self._float(input)))
        return self._result(self._float(loss) * (1.0 - t * t), **kwargs)

    def sigmoid_backward(self, loss=None, input=None, **kwargs):
        s = 1.0 / (1.0 + self.ops.exp(-self._as_array(self._float(input))))
        return self._result(self._float(loss) * s * (1.0 - s), **kwargs)

    def relu_backward(self, loss=None, input=None, negative_slope=None, **kwargs):
        x = self._as_array(self._float(input))
        return self._result(self._float(loss) * self.ops.where(x > 0, 1.0 + 0.0 * x, (negative_slope or 0.0)
                                                                + 0.0 * x), **kwargs)

    def erf(self, input=None, **kwargs):
        x = self._as_array(self._float(input))
        return self._result(self.ops.erf(x), **kwargs)

    def gelu(self, input=None, **kwargs):
        x = self._as_array(self._float(input))
        return self._result(0.5 * x * (1.0 + self.erf(input=x).value), **kwargs)

    def gelu_approx_tanh(self, input=None, **kwargs):
        x = self._as_array(self._float(input))
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return self._result(0.5 * x * (1.0 + self._math.tanh(inner)), **kwargs)


def run_eager(ops, callback, score, tensors: dict, dtype: str):
    """callback(graph, score, tensors) evaluated on arrays; returns the resulting array.

    `tensors` is updated in place (values wrapped, intermediates stored by the callback), so
    a score_mod's bprop run next with the same dict sees what its forward kept, as on cuDNN.
    """
    graph = EagerGraph(ops, score, dtype)
    for name, value in list(tensors.items()):
        if not isinstance(value, EagerValue):
            tensors[name] = EagerValue(graph, value)
    result = callback(graph, EagerValue(graph, score), tensors)
    if not isinstance(result, EagerValue):
        raise ValueError(f"score_mod: expected the callback to return a graph tensor, got {type(result).__name__}")
    return result.value
