"""Tracing a flex-style callback written in torch into our expression graph (expr.Expr).

torch's own tracer (`make_fx`) runs the function once on one-element stand-ins for score
and the four indices (one element, not zero dimensions, so `bias[h]` stays a tensor index
instead of a Python int); every aten op it records is translated to our ops. Numbers the
function used become runtime scalars; tensors it captured become loads. The derivative is
traced the same way through `torch.func.vjp`, so no user writes a backward.
"""

from __future__ import annotations

import numbers

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fusedattn.score_mods.expr import BOOL, FLOAT, INT, Builder, Expr, ExprError

__all__ = ["trace_torch", "trace_torch_into"]

_SAME = {"neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh",
         "sigmoid": "sigmoid", "sin": "sin", "cos": "cos", "floor": "floor", "ceil": "ceil", "trunc": "trunc",
         "erf": "erf", "sign": "sign", "sgn": "sign", "reciprocal": "reciprocal",
         "add": "add", "sub": "sub", "mul": "mul", "maximum": "max", "minimum": "min", "pow": "pow",
         "floor_divide": "floordiv", "remainder": "mod", "fmod": "rem",
         "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge",
         "logical_and": "and", "logical_or": "or", "logical_xor": "xor", "logical_not": "not"}
_BITWISE = {"bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor", "bitwise_not": "not"}
# Ops that only change shape, layout or identity of a one-element value.
_PASS_THROUGH = frozenset({"clone", "expand", "view", "_unsafe_view", "reshape", "squeeze", "unsqueeze", "alias",
                           "detach", "lift_fresh_copy", "contiguous", "expand_copy", "view_copy", "squeeze_copy",
                           "unsqueeze_copy", "alias_copy", "permute", "t", "_conj", "resolve_conj", "resolve_neg"})
_FILL = {"ones_like": 1, "zeros_like": 0, "new_ones": 1, "new_zeros": 0}


def _kind_of_dtype(dtype) -> str:
    if dtype == torch.bool:
        return BOOL
    if dtype.is_floating_point:
        return FLOAT
    if dtype.is_complex:
        raise ExprError(f"complex dtype {dtype} is not supported in a score_mod")
    return INT


class _Translator:
    """Walks an FX graph from make_fx and adds our nodes to a Builder."""

    def __init__(self, module, builder: Builder, inputs: list[tuple[str, str]]):
        self.module, self.b = module, builder
        self.inputs = list(inputs)
        self.values: dict = {}  # fx node -> our node number, or ("captured", tensor)

    def run(self) -> list[int]:
        placeholders = iter(self.inputs)
        for node in self.module.graph.nodes:
            if node.op == "placeholder":
                name, kind = next(placeholders)
                self.values[node] = self.b.input(name, kind)
            elif node.op == "get_attr":
                self.values[node] = ("captured", getattr(self.module, node.target))
            elif node.op == "call_function":
                self.values[node] = self.call(node)
            elif node.op == "output":
                result = node.args[0]
                return [self.value(r) for r in (result if isinstance(result, (tuple, list)) else [result])]
            else:
                raise ExprError(f"unexpected traced node {node.op!r}")
        raise ExprError("the traced graph has no output")

    def value(self, arg) -> int:
        """Our node number for an argument: a traced value, a number, or a captured tensor."""
        if isinstance(arg, torch.fx.Node):
            value = self.values[arg]
            if isinstance(value, tuple):  # a captured tensor used without an index
                tensor = value[1]
                if tensor.dim() != 0 and tensor.numel() != 1:
                    raise ExprError(f"a captured tensor of shape {tuple(tensor.shape)} is used whole; index it by "
                                    "b, h, q_idx or kv_idx (one index per axis), as in bias[h]")
                # the tensor itself (a 0-d one) or its one element at index 0: a load of the captured tensor,
                # so a learnable scalar (score + c * (kv_idx - q_idx)) is followed and learns
                zeros = [self.b.scalar(0) for _ in range(tensor.dim())]
                return self.b.load(tensor, zeros, _kind_of_dtype(tensor.dtype))
            return value
        if isinstance(arg, bool) or isinstance(arg, numbers.Number):
            number = arg.item() if hasattr(arg, "item") else arg
            return self.b.scalar(bool(number) if isinstance(number, bool) else
                                 int(number) if isinstance(number, numbers.Integral) else float(number))
        raise ExprError(f"unexpected argument {type(arg).__name__} in the traced graph")

    def call(self, node):
        target = node.target
        name = getattr(getattr(target, "overloadpacket", None), "__name__", getattr(target, "__name__", str(target)))
        name = name.removesuffix("_") if name.endswith("_") and not name.startswith("_") else name
        args, kwargs = node.args, node.kwargs
        b = self.b
        if name in _PASS_THROUGH:
            return self.values[args[0]] if isinstance(args[0], torch.fx.Node) else self.value(args[0])
        if name == "index":
            return self._index(args[0], args[1])
        if name in ("add", "sub") and kwargs.get("alpha", 1) != 1:
            return b.op(name, self.value(args[0]), b.op("mul", self.value(args[1]), self.value(kwargs["alpha"])))
        if name == "rsub":
            return b.op("sub", self.value(args[1]), self.value(args[0]))
        if name == "div":
            mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
            op = {None: "div", "floor": "floordiv", "trunc": "truncdiv"}[mode]
            return b.op(op, self.value(args[0]), self.value(args[1]))
        if name in _SAME:
            return b.op(_SAME[name], *(self.value(a) for a in args))
        if name in _BITWISE:
            operands = [self.value(a) for a in args]
            if any(b.kind(x) != BOOL for x in operands):
                raise ExprError(f"op '{name}' on integers (bitwise) has no form here; use it on booleans only")
            return b.op(_BITWISE[name], *operands)
        if name == "square":
            x = self.value(args[0])
            return b.op("mul", x, x)
        if name == "relu":
            return b.op("max", self.value(args[0]), b.scalar(0.0))
        if name in ("clamp", "clamp_min", "clamp_max"):
            low = args[1] if name != "clamp_max" and len(args) > 1 else kwargs.get("min")
            high = (args[1] if name == "clamp_max" else args[2] if len(args) > 2 else kwargs.get("max"))
            x = self.value(args[0])
            if low is not None:
                x = b.op("max", x, self.value(low))
            if high is not None:
                x = b.op("min", x, self.value(high))
            return x
        if name == "where":
            condition = self.value(args[0])
            if b.kind(condition) != BOOL:
                condition = b.op("cast", condition, attr=(BOOL,))
            return b.op("where", condition, self.value(args[1]), self.value(args[2]))
        if name in ("expm1", "log1p"):
            x, one = self.value(args[0]), b.scalar(1.0)
            return b.op("sub", b.op("exp", x), one) if name == "expm1" else b.op("log", b.op("add", x, one))
        if name == "tanh_backward":  # (grad, tanh's output)
            grad, y = self.value(args[0]), self.value(args[1])
            tanh = b.nodes[y]
            if tanh.op == "tanh" and b.kind(grad) == FLOAT:  # one op: cuDNN's own tanh derivative
                return b.op("tanh_grad", grad, tanh.args[0])
            return b.op("mul", grad, b.op("sub", b.scalar(1.0), b.op("mul", y, y)))
        if name == "sigmoid_backward":  # (grad, sigmoid's output)
            grad, y = self.value(args[0]), self.value(args[1])
            return b.op("mul", grad, b.op("mul", y, b.op("sub", b.scalar(1.0), y)))
        if name == "threshold_backward":  # (grad, input, threshold): relu's derivative
            grad, x, threshold = self.value(args[0]), self.value(args[1]), self.value(args[2])
            return b.op("where", b.op("le", x, threshold), b.scalar(0.0), grad)
        if name in ("_to_copy", "to", "type_as", "_convert_element_type"):
            dtype = kwargs.get("dtype")
            x = self.value(args[0])
            return x if dtype is None else b.op("cast", x, attr=(_kind_of_dtype(dtype),))
        if name == "scalar_tensor":
            return self._literal(args[0], kwargs.get("dtype"))
        if name in _FILL:
            return self._literal(_FILL[name], kwargs.get("dtype") or node.args[0].meta.get("val").dtype)
        if name in ("full_like", "new_full"):
            return self._literal(args[1] if name == "full_like" else args[2], kwargs.get("dtype"))
        if name == "full":
            return self._literal(args[1], kwargs.get("dtype"))
        raise ExprError(f"op '{name}' (torch.ops.aten.{name}) has no form in fusedattn's score_mod graphs; "
                        "use pointwise math (+ - * /, where, tanh, exp, log, sqrt, abs, minimum, maximum, "
                        "comparisons) and captured tensors indexed by b, h, q_idx, kv_idx")

    def _literal(self, value, dtype) -> int:
        number = value.item() if hasattr(value, "item") else value
        if dtype is not None:
            kind = _kind_of_dtype(dtype)
            number = bool(number) if kind == BOOL else int(number) if kind == INT else float(number)
        return self.value(number)

    def _index(self, source, indices) -> int:
        value = self.values.get(source) if isinstance(source, torch.fx.Node) else None
        if not (isinstance(value, tuple) and value[0] == "captured"):
            raise ExprError("indexing a computed value; index captured tensors only (bias[h], doc[b, q_idx])")
        tensor = value[1]
        if any(i is None for i in indices) or len(indices) != tensor.dim():
            raise ExprError(f"a captured tensor of shape {tuple(tensor.shape)} indexed by {len(indices)} indices; "
                            "index every axis with one expression of b, h, q_idx or kv_idx")
        positions = [self.value(i) for i in indices]
        if any(self.b.kind(p) == FLOAT for p in positions):
            raise ExprError("a captured tensor indexed by a float expression; index by integers")
        return self.b.load(tensor, positions, _kind_of_dtype(tensor.dtype))


_INDEX_DTYPE = torch.int64


def _stand_ins(names: list[str], device):
    return [torch.zeros(1, dtype=torch.float32 if name in ("score", "dscore") else _INDEX_DTYPE, device=device)
            for name in names]


def trace_torch(fn, names: list[str], device=None) -> Expr:
    """fn(*inputs named `names`) traced by make_fx into an Expr (names from expr.INPUTS); the
    stand-ins live on `device` (q's), beside the tensors fn captures."""
    builder = Builder()
    results = trace_torch_into(builder, fn, names, device)
    if len(results) != 1:
        raise ExprError(f"expected one result, got {len(results)}")
    return builder.finish(results[0])


def trace_torch_into(builder: Builder, fn, names: list[str], device=None) -> list[int]:
    """fn traced into builder (inputs shared with what it holds by name): the node of each result."""
    try:
        stand_ins = _stand_ins(names, device)
        # make_fx reads fn's signature: give it exactly the stand-ins (a bound method has one more).
        module = make_fx(lambda *args: fn(*args))(*stand_ins)
    except ExprError:
        raise
    except Exception as error:  # data-dependent control flow, unsupported Python...
        text = " ".join(str(error).split())[:300]
        if "data-dependent" in text or "_local_scalar_dense" in text:
            text = ("Python control flow or int()/float()/.item() on a traced value; write conditions with "
                    "torch.where")
        raise ExprError(f"torch could not trace the function ({type(error).__name__}: {text})") from None
    kinds = [FLOAT if n in ("score", "dscore") else INT for n in names]
    return _Translator(module, builder, list(zip(names, kinds))).run()
