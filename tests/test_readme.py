"""Every Python block of the README runs as written, top to bottom in one namespace, as a newcomer
would paste them (on the CPU: the reference backend)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    """(first line number, code) of each ```python block."""
    text = README.read_text()
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        blocks.append((text[:match.start()].count("\n") + 2, match.group(1)))
    return blocks


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 5


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_every_python_block_runs_as_written():
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    namespace: dict = {"__name__": "readme"}
    for line, code in python_blocks():
        try:
            exec(compile(code, f"README.md:{line}", "exec"), namespace)
        except Exception as error:  # the block's own line numbers show in the traceback
            raise AssertionError(f"the README block at line {line} fails: {type(error).__name__}: {error}") from error
