"""Tracing a flex-style callback written in jax.numpy into our expression graph (expr.Expr).

JAX's own tracer (`make_jaxpr`) runs the function once on zero-dimensional stand-ins for
score and the four indices; every primitive of the jaxpr (nested jit calls inlined) is
translated to our ops. Literals become runtime scalars; captured arrays (the jaxpr's
constants) become loads, through the `dynamic_slice` that indexing by a traced index
records. The derivative is traced the same way through `jax.vjp`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.score_mods.expr import BOOL, FLOAT, INT, Builder, Expr, ExprError

__all__ = ["trace_jax", "trace_jax_into"]

_SAME = {"add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "neg": "neg", "abs": "abs", "exp": "exp",
         "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh", "logistic": "sigmoid", "sin": "sin",
         "cos": "cos", "floor": "floor", "ceil": "ceil", "sign": "sign", "max": "max", "min": "min", "pow": "pow",
         "rem": "rem", "erf": "erf", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne"}
_LOGICAL = {"and": "and", "or": "or", "xor": "xor", "not": "not"}
# Shape-only primitives: on one-element values they change nothing.
_PASS_THROUGH = frozenset({"squeeze", "reshape", "broadcast_in_dim", "expand_dims", "copy", "copy_p",
                           "optimization_barrier", "stop_gradient", "reduce_precision"})
_NAMED_CALLS = {"floor_divide": "floordiv", "remainder": "mod"}  # jnp functions traced as nested jit calls
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr",
           "remat": "jaxpr", "checkpoint": "jaxpr"}


def _kind_of_dtype(dtype) -> str:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return BOOL
    if jnp.issubdtype(dtype, jnp.floating):  # (NumPy's own test says no to bfloat16, an ml_dtypes type)
        return FLOAT
    if jnp.issubdtype(dtype, jnp.integer):
        return INT
    raise ExprError(f"dtype {dtype} is not supported in a score_mod")


class _Translator:
    def __init__(self, builder: Builder):
        self.b = builder

    def value(self, env: dict, var) -> int:
        if type(var).__name__ == "Literal":
            number = np.asarray(var.val).item()
            kind = _kind_of_dtype(np.asarray(var.val).dtype) if hasattr(var.val, "dtype") else None
            if kind == BOOL or isinstance(number, bool):
                return self.b.scalar(bool(number))
            return self.b.scalar(int(number) if kind == INT or isinstance(number, int) else float(number))
        value = env[var]
        if isinstance(value, tuple):  # a captured array used whole
            array = value[1]
            if np.size(array) != 1:
                raise ExprError(f"a captured array of shape {tuple(np.shape(array))} is used whole; index it by "
                                "b, h, q_idx or kv_idx (one index per axis), as in bias[h]")
            # the array itself at index 0 on each axis: a load of the captured array, so a learnable
            # scalar (score + c * (kv_idx - q_idx)) is followed and learns
            zeros = [self.b.scalar(0) for _ in range(np.ndim(array))]
            return self.b.load(array, zeros, _kind_of_dtype(array.dtype))
        return value

    def run(self, jaxpr, consts, args: list) -> list:
        env: dict = {}
        for var, const in zip(jaxpr.constvars, consts):
            # (a NumPy constant, from jnp.asarray(host) inside the callback: read as a JAX array, as a jitted
            # call indexes it with traced positions)
            env[var] = ("captured", jnp.asarray(const) if isinstance(const, np.ndarray) else const)
        for var, arg in zip(jaxpr.invars, args):
            env[var] = arg
        for eqn in jaxpr.eqns:
            outs = self.equation(env, eqn)
            for var, out in zip(eqn.outvars, outs):
                env[var] = out
        return [self.value(env, v) for v in jaxpr.outvars]

    def equation(self, env: dict, eqn) -> list:
        name, params, b = eqn.primitive.name, eqn.params, self.b
        if name in ("pjit", "jit") and params.get("name") in _NAMED_CALLS:
            # jnp's // and % on integers: one op of ours, not their sign-and-select expansion
            return [b.op(_NAMED_CALLS[params["name"]], *(self.value(env, v) for v in eqn.invars))]
        if name in _INLINE or (name not in _SAME and any(k in params for k in ("jaxpr", "call_jaxpr"))):
            inner = params.get(_INLINE.get(name, "jaxpr")) or params.get("call_jaxpr") or params.get("jaxpr")
            if callable(inner) and not hasattr(inner, "jaxpr"):  # a thunk (custom_vjp's fun_jaxpr)
                inner = inner()
            closed = inner if hasattr(inner, "consts") else None
            jaxpr = closed.jaxpr if closed is not None else inner
            consts = closed.consts if closed is not None else []
            args = [self._raw(env, v) for v in eqn.invars]
            return self.run(jaxpr, consts, args)
        if name == "dynamic_slice":
            return [self._load(env, eqn)]
        if name in _PASS_THROUGH:
            raw = self._raw(env, eqn.invars[0])
            if isinstance(raw, tuple) and name != "stop_gradient":
                raise ExprError(f"'{name}' of a captured array; index captured arrays directly (bias[h])")
            return [raw]
        operands = [self.value(env, v) for v in eqn.invars]
        if name == "div":
            integral = all(b.kind(x) != FLOAT for x in operands)
            return [b.op("truncdiv" if integral else "div", *operands)]
        if name in _SAME:
            return [b.op(_SAME[name], *operands)]
        if name in _LOGICAL:
            if any(b.kind(x) != BOOL for x in operands):
                raise ExprError(f"op '{name}' on integers (bitwise) has no form here; use it on booleans only")
            return [b.op(_LOGICAL[name], *operands)]
        if name == "select_n":
            if len(operands) != 3:
                raise ExprError(f"select_n with {len(operands) - 1} cases; use jnp.where (two cases)")
            condition = operands[0]
            if b.kind(condition) != BOOL:
                condition = b.op("cast", condition, attr=(BOOL,))
            return [b.op("where", condition, operands[2], operands[1])]
        if name == "convert_element_type":
            return [b.op("cast", operands[0], attr=(_kind_of_dtype(params["new_dtype"]),))]
        if name == "integer_pow":
            power = params["y"]
            if power == 2:
                return [b.op("mul", operands[0], operands[0])]
            return [b.op("pow", operands[0], b.scalar(float(power)))]
        if name == "one_minus_square":  # tanh's derivative in newer JAX: 1 - x * x
            return [b.op("sub", b.scalar(1.0), b.op("mul", operands[0], operands[0]))]
        if name == "square":
            return [b.op("mul", operands[0], operands[0])]
        if name == "clamp":  # clamp(low, x, high)
            low, x, high = operands
            return [b.op("max", b.op("min", x, high), low)]
        if name in ("exp2", "log1p", "expm1"):
            x, one = operands[0], b.scalar(1.0)
            if name == "exp2":
                return [b.op("exp", b.op("mul", x, b.scalar(math.log(2.0))))]
            return [b.op("log", b.op("add", x, one)) if name == "log1p" else b.op("sub", b.op("exp", x), one)]
        if name == "logistic":
            return [b.op("sigmoid", operands[0])]
        raise ExprError(f"op '{name}' (jax.lax.{name}_p) has no form in fusedattn's score_mod graphs; use "
                        "pointwise math (+ - * /, where, tanh, exp, log, sqrt, abs, minimum, maximum, comparisons) "
                        "and captured arrays indexed by b, h, q_idx, kv_idx")

    def _raw(self, env: dict, var):
        if type(var).__name__ == "Literal":
            return self.value(env, var)
        return env[var]

    def _load(self, env: dict, eqn) -> int:
        source = self._raw(env, eqn.invars[0])
        if not (isinstance(source, tuple) and source[0] == "captured"):
            raise ExprError("indexing a computed value; index captured arrays only (bias[h], doc[b, q_idx])")
        array = source[1]
        if any(size != 1 for size in eqn.params["slice_sizes"]):
            raise ExprError(f"a slice of a captured array of shape {tuple(array.shape)}; index every axis with "
                            "one expression of b, h, q_idx or kv_idx")
        positions = [self.value(env, v) for v in eqn.invars[1:]]
        if any(self.b.kind(p) == FLOAT for p in positions):
            raise ExprError("a captured array indexed by a float expression; index by integers")
        return self.b.load(array, positions, _kind_of_dtype(array.dtype))


def trace_jax(fn, names: list[str]) -> Expr:
    """fn(*inputs named `names`) traced by make_jaxpr into an Expr (names from expr.INPUTS)."""
    builder = Builder()
    results = trace_jax_into(builder, fn, names)
    if len(results) != 1:
        raise ExprError(f"expected one result, got {len(results)}")
    return builder.finish(results[0])


def trace_jax_into(builder: Builder, fn, names: list[str]) -> list[int]:
    """fn traced into builder (inputs shared with what it holds by name): the node of each result."""
    # With x64 on, a float64 score: the numbers the callback writes (s * 0.37) stay float64 in the trace,
    # where a float32 one would round them (a float64 call then carries float32 error); cuDNN's graphs
    # take them as float32 either way.
    score = jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32
    stand_ins = [jnp.zeros((), score if n in ("score", "dscore") else jnp.int32) for n in names]
    try:
        # A fresh wrapper each time: JAX caches traces by function, and would miss a changed global.
        closed = jax.make_jaxpr(lambda *args: fn(*args))(*stand_ins)
    except ExprError:
        raise
    except Exception as error:
        text = " ".join(str(error).split())[:300]
        if "Concretization" in type(error).__name__ or "traced array" in text or "Tracer" in text:
            text = "Python control flow on a traced value; write conditions with jnp.where"
        raise ExprError(f"JAX could not trace the function ({type(error).__name__}: {text})") from None
    inputs = [builder.input(n, FLOAT if n in ("score", "dscore") else INT) for n in names]
    return _Translator(builder).run(closed.jaxpr, closed.consts, inputs)
