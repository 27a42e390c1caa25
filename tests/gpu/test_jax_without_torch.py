"""JAX's cuDNN calls where torch cannot be imported: every feature as a native custom call, against
JAX's own reference (tests/gpu/jax_torchless_checks.py runs in a subprocess that blocks torch), and
tests/gpu/test_jax.py in such a process.

    FUSEDATTN_TORCHLESS_WORKERS=3   pytest-xdist processes for that suite, each blocking torch (default 3
                                    where xdist is installed; 0: one process, about three times as long)
"""

from __future__ import annotations

import os
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


ALLOWED_SKIPS = ("needs torch:", "needs 2 GPUs", "cudnn declines this call from JAX")


def test_the_jax_gpu_suite_passes_with_torch_blocked():
    """tests/gpu/test_jax.py in a process where importing torch raises: every test passes, or skips for
    a reason that names torch (the full run makes those), a second GPU, or cuDNN's own refusal."""
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (jax.default_backend() is {jax.default_backend()!r})")
    here = Path(__file__).parent
    # -p loads block_torch in xdist's workers too, before any other plugin could import torch
    args = ["-q", "-rs", "-p", "block_torch", "-p", "no:cacheprovider", *_workers(), "tests/gpu/test_jax.py"]
    code = f"import block_torch, sys, pytest; sys.exit(pytest.main({args!r}))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], cwd=here.parents[1], env=env, capture_output=True,
                            text=True, timeout=1800)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-8000:]
    skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
    unexpected = [line for line in skips if not any(reason in line for reason in ALLOWED_SKIPS)]
    assert not unexpected, "\n".join(unexpected)
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-2000:]


def _workers() -> list[str]:
    """xdist's options for the torch-blocked suite: it is the longest test, and split so it ends within one
    device call beside the others (conftest.LONGEST_FIRST starts it first)."""
    import importlib.util

    default = "3" if importlib.util.find_spec("xdist") is not None else "0"
    count = int(os.environ.get("FUSEDATTN_TORCHLESS_WORKERS", default))
    return ["-n", str(count)] if count > 0 else []
