"""Checks of single option values, each raising ValueError that names the caller's argument.

The config checks the values it receives with these, and so do the nn and Flax modules when they
are constructed (under the module's own argument names): one text per mistake, wherever it is made.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_window", "check_probability", "check_scale", "check_count", "check_backend", "number_from_array"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_window(value, argument: str = "window", accepted: tuple = (tuple, list)) -> tuple[int, int] | None:
    """(left, right) as a tuple, or None; a list is accepted (unless `accepted` says otherwise) and made
    a tuple."""
    if value is None:
        return None
    pair = tuple(value) if isinstance(value, accepted) else None
    if pair is not None:  # NumPy ints (np.int64(2)) as the Python ints of the same value
        pair = tuple(int(w) if isinstance(w, numbers.Integral) and not isinstance(w, bool) else w for w in pair)
    if not isinstance(pair, tuple) or len(pair) != 2 or not all(_is_int(w) and w >= -1 for w in pair):
        raise ValueError(f"{argument}: expected (left, right), two integers >= -1 (-1 = unbounded), got {value!r}")
    return pair


def check_probability(value, argument: str = "dropout_p") -> float:
    """A dropout probability in [0, 1), as a float (a NumPy float as the Python float of its value)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        raise ValueError(f"{argument}: expected a float in [0, 1), got {value!r}")
    return float(value)


def number_from_array(value, argument: str):
    """A 0-d array given where a drop-in's original takes a number (scale=1 / jnp.sqrt(d),
    scale=torch.tensor(0.3)) as the Python float of its value, read now (a host read: a Python float
    costs nothing); anything else as it is, for the checks. A value traced by jax.jit cannot be read:
    the kernel's scale is fixed when the call is traced."""
    if isinstance(value, numbers.Number) or getattr(value, "shape", None) != ():
        return value
    if any(kind.__name__.endswith("Tracer") for kind in type(value).__mro__):
        raise ValueError(f"{argument}: expected a number known when the call is traced (the kernels take the "
                         f"scale as a constant), got a traced array; pass a Python float, or mark the argument "
                         f"static (jax.jit(..., static_argnames=...))")
    try:
        return float(value)
    except (TypeError, ValueError):
        return value  # (not a real number: the checks say so)


def check_scale(value, argument: str = "scale") -> float | None:
    """A finite positive scale as a float, or None (1/sqrt(D))."""
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value) not in (int, float):
        value = float(value)  # a NumPy scalar (np.float32(0.5)): a Python number of the same value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{argument}: expected a Python float > 0 (or None for 1/sqrt(D)), got "
                         f"{type(value).__name__} {value!r}" + (" (a tensor or array: pass float(scale))"
                                                               if hasattr(value, "shape") else ""))
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{argument}: expected a finite float > 0 (or None for 1/sqrt(D)), got {value!r}")
    return float(value)


def check_count(value, argument: str, minimum: int = 1, optional: bool = False) -> int | None:
    """An int >= minimum (or None when optional)."""
    if optional and value is None:
        return None
    if not _is_int(value) or value < minimum:
        raise ValueError(f"{argument}: expected an int >= {minimum}{' (or None)' if optional else ''}, got {value!r}")
    return value


def check_backend(value, argument: str = "backend") -> str | None:
    """A backend's name, or None (selection chooses)."""
    from fusedattn.backends import backend_names  # the backends import the config, which imports this

    if value is not None and value not in backend_names():
        raise ValueError(f"{argument}: expected None or one of {', '.join(backend_names())}, got {value!r}")
    return value
