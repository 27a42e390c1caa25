"""`import fusedattn.jax` and a JAX call on the CPU need no torch: run in a subprocess whose imports of
torch fail (as where torch is not installed), so the check also means something where torch is."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("jax")

SCRIPT = textwrap.dedent("""
    import sys

    class NoTorch:
        \"\"\"Every import of torch fails, naming the module asked for; the traceback shows who asked.\"\"\"

        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"{name} is blocked: the JAX path must not import torch")
            return None

    sys.meta_path.insert(0, NoTorch())

    import jax
    import fusedattn
    import fusedattn.jax as fj

    q = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))
    k, v = (jax.random.normal(jax.random.key(i), (2, 8, 2, 16)) for i in (1, 2))
    out = fj.attention(q, k, v, mask="causal", backend="reference")
    grad = jax.jit(jax.grad(lambda q: fj.attention(q, k, v, mask="causal").sum()))(q)
    assert out.shape == q.shape and grad.shape == q.shape
    print(sorted(name for name in sys.modules if name.split(".")[0] == "torch"))
""")


def test_the_jax_frontend_runs_with_torch_imports_blocked():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[-1] == "[]", "torch modules were imported: " + result.stdout
