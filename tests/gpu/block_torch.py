"""Importing this module makes `import torch` raise ImportError in the process: how the GPU tests check
that JAX runs without torch (jax_torchless_checks.py, and test_jax.py run by test_jax_without_torch.py)."""

from __future__ import annotations

import importlib.abc
import sys


class _NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this process")


if not any(isinstance(finder, _NoTorch) for finder in sys.meta_path):
    sys.meta_path.insert(0, _NoTorch())
