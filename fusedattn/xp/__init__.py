"""A small array namespace shared by torch and jax.numpy, so math is written once.

`namespace(x)` returns the ops for the framework that owns `x`, importing that
framework only then; `import fusedattn` stays free of torch and JAX.
"""

from __future__ import annotations

import importlib

__all__ = ["namespace", "framework_of"]

_MODULES = {"torch": "fusedattn.xp.torch_ops", "jax": "fusedattn.xp.jax_ops"}
_LOADED: dict = {}  # name -> ops, once imported (a dict lookup is also what torch.compile can trace)


def framework_of(x) -> str | None:
    """'torch' or 'jax' for an array of that framework (tracers included), else None."""
    module = type(x).__module__
    if module.startswith("torch"):
        return "torch"
    if module.startswith(("jax", "jaxlib")):
        return "jax"
    return None


def namespace(x_or_framework):
    """The ops object for a framework name or for an array of it."""
    name = x_or_framework if isinstance(x_or_framework, str) else framework_of(x_or_framework)
    if name not in _MODULES:
        raise ValueError(f"expected a torch tensor or a JAX array, got {type(x_or_framework).__name__}")
    ops = _LOADED.get(name)
    if ops is None:
        ops = _LOADED[name] = importlib.import_module(_MODULES[name]).OPS
    return ops


def loaded(name: str, ops) -> None:
    """Called by each ops module as it is imported: a frontend that imports its module has the ops
    without namespace() importing (which torch.compile cannot trace on a first call)."""
    _LOADED[name] = ops
