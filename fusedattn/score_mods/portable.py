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

__all__ = ["tanh", "exp", "log", "sqrt", "abs", "sigmoid", "where", "minimum", "maximum", "floor", "ceil",
           "clip"]


def _module(*values):
    for value in values:
        kind = type(value).__module__
        if kind.startswith("torch"):
            import torch

            return torch
        if kind.startswith(("jax", "jaxlib")):
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


def minimum(x, y):
    """The smaller of x and y, elementwise."""
    module = _module(x, y)
    if module is None:
        return min(x, y)
    if module.__name__ == "torch" and _module(y) is None:  # a number: stays a runtime scalar when traced
        return module.clamp(x, max=y)
    if module.__name__ == "torch" and _module(x) is None:
        return module.clamp(y, max=x)
    return module.minimum(x, y)


def maximum(x, y):
    """The larger of x and y, elementwise."""
    module = _module(x, y)
    if module is None:
        return max(x, y)
    if module.__name__ == "torch" and _module(y) is None:  # a number: stays a runtime scalar when traced
        return module.clamp(x, min=y)
    if module.__name__ == "torch" and _module(x) is None:
        return module.clamp(y, min=x)
    return module.maximum(x, y)


def clip(x, low, high):
    """x limited to [low, high]."""
    return minimum(maximum(x, low), high)
