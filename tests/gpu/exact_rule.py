"""The GPU tests' error rule (STYLE 15), in one place and without a framework: a fused backend's error
against a float64 computation stays within a small multiple of the same-dtype reference's own error
(the reference computes in float32 and rounds once to the I/O dtype), plus a small floor. Takes NumPy,
JAX or torch arrays."""

from __future__ import annotations

import numpy as np

FACTOR = 4.0  # cuDNN rounds P to the I/O dtype before P @ V; the reference does not
ATOL = {"bfloat16": 2e-3, "float16": 3e-4}  # of the magnitude: about one rounding (the fuzz rule's too)
REDUCTION_ATOL = 1e-2  # dBias/dSink: sums over many score entries that cuDNN rounds to the I/O dtype


def as_float64(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch
        x = x.detach().double().cpu().numpy()
    elif str(getattr(x, "dtype", "")) in ("bfloat16", "float16"):  # NumPy cannot widen JAX's bfloat16 itself
        x = np.asarray(x).astype(np.float32)
    return np.asarray(x, np.float64)


def assert_close_to_exact(name, got, same_dtype, exact, reduction=False):
    """reduction=True for dBias/dSink, whose error grows with the number of terms: 1% of the magnitude."""
    got, same_dtype, exact = (as_float64(x) for x in (got, same_dtype, exact))
    err = float(np.abs(got - exact).max(initial=0.0))
    ref_err = float(np.abs(same_dtype - exact).max(initial=0.0))
    scale = float(np.abs(exact).max(initial=0.0))
    limit = FACTOR * ref_err + (REDUCTION_ATOL if reduction else ATOL["bfloat16"]) * max(scale, 1.0)
    assert err <= limit, f"{name}: error {err:.3e} > {limit:.3e} (the same-dtype reference's own {ref_err:.3e})"
