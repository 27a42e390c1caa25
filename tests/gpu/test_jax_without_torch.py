"""JAX's cuDNN calls where torch cannot be imported: every feature as a native custom call, against
JAX's own reference (tests/gpu/jax_torchless_checks.py runs in a subprocess that blocks torch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")

pytestmark = pytest.mark.gpu


def test_every_cudnn_feature_runs_from_jax_with_torch_blocked():
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (jax.default_backend() is {jax.default_backend()!r})")
    script = Path(__file__).with_name("jax_torchless_checks.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "ALL OK" in result.stdout, output[-6000:]
