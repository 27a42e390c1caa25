"""Math for flex-style callbacks that run unchanged in torch and JAX.

    from fusedattn import score_mods as sm
    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * sm.tanh(score / 30.0)

Each helper calls the framework of its array arguments (torch, or jax.numpy for JAX arrays
and tracers) and Python's math for plain numbers, so one definition serves both frontends;
Python operators (+ - * / // % comparisons & | ~) already work on both.
"""

from __future__ import annotations

import math
import sys

__all__ = ["tanh", "exp", "log", "sqrt", "abs", "sigmoid", "where", "minimum", "maximum", "floor", "ceil",
           "clip"]


def _module(*values):
    """torch or jax.numpy when one of values is their array, else None. Written with isinstance and
    sys.modules only, so TorchDynamo can trace it too (torch's own FlexAttention compiles score_mods)."""
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(v, torch.Tensor) for v in values):
        return torch
    jax = sys.modules.get("jax")
    if jax is not None and any(isinstance(v, jax.Array) for v in values):  # tracers included
        import jax.numpy as jnp

        return jnp
    return None


def _unary(name: str, scalar):
    def helper(x):
        module = _module(x)
        return scalar(x) if module is None else getattr(module, name)(x)

    helper.__name__ = name
    helper.__doc__ = f"{name}(x) in the framework of x (math for a number)."
    return helper


tanh = _unary("tanh", math.tanh)
exp = _unary("exp", math.exp)
log = _unary("log", math.log)
sqrt = _unary("sqrt", math.sqrt)
abs = _unary("abs", lambda x: x if x >= 0 else -x)  # noqa: A001 (the name users expect)
floor = _unary("floor", math.floor)
ceil = _unary("ceil", math.ceil)


def sigmoid(x):
    """1 / (1 + exp(-x)) in the framework of x."""
    module = _module(x)
    if module is None:
        return 1.0 / (1.0 + math.exp(-x))
    if module.__name__ == "torch":
        return module.sigmoid(x)
    import jax

    return jax.nn.sigmoid(x)


def where(condition, x, y):
    """x where condition, else y (arrays of one framework, or numbers)."""
    module = _module(condition, x, y)
    if module is None:
        return x if condition else y
    return module.where(condition, x, y)


def _extreme(name: str, python, clamp_keyword: str):
    def helper(x, y):
        module = _module(x, y)
        if module is None:
            return python(x, y)
        if module.__name__ == "torch" and _module(y) is None:  # a number: stays a runtime scalar when traced
            return module.clamp(x, **{clamp_keyword: y})
        if module.__name__ == "torch" and _module(x) is None:
            return module.clamp(y, **{clamp_keyword: x})
        return getattr(module, name)(x, y)

    helper.__name__ = name
    helper.__doc__ = f"The {'smaller' if name == 'minimum' else 'larger'} of x and y, elementwise."
    return helper


minimum = _extreme("minimum", min, "max")
maximum = _extreme("maximum", max, "min")


def clip(x, low, high):
    """x limited to [low, high]."""
    return minimum(maximum(x, low), high)
