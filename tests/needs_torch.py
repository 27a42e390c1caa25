"""Tests that need torch say so once, here: in the torch-free JAX run (`make test`'s .venv-notorch)
they skip with the reason `needs torch: <why>`; the full environment runs them."""

from __future__ import annotations

import importlib.util

import pytest


def _torch_importable() -> bool:
    try:
        return importlib.util.find_spec("torch") is not None
    except ImportError:  # blocked in this process (tests/gpu/block_torch.py)
        return False


HAS_TORCH = _torch_importable()


def requires_torch(why: str) -> pytest.MarkDecorator:
    """A skip mark for a test (or a whole module, as `pytestmark`) that needs torch, saying why."""
    return pytest.mark.skipif(not HAS_TORCH, reason=f"needs torch: {why}")


def import_torch(why: str):
    """torch, for a module (at import) or a test that needs it part way; without torch they skip, saying why."""
    __tracebackhide__ = True  # a skip names the caller's line, not this one
    return pytest.importorskip("torch", reason=f"needs torch: {why}")
