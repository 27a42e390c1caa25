"""bench/bench_jax.py --cpu-smoke: rows in the results format, a failing peer as an error entry, readable tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
jax = pytest.importorskip("jax")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_jax  # noqa: E402
import make_tables  # noqa: E402


def test_cpu_smoke_writes_rows_with_errors_as_entries(tmp_path, capsys):
    path = tmp_path / "jax.json"
    only = "^(overhead-b1-h8-s128-d64-loop-fwd|bshd-b4-h16-s128-d64-causal-fwd\\+bwd)$"
    assert bench_jax.main(["--cpu-smoke", "--only", only, "--repeats", "2", "--out", str(path)]) == 0
    document = json.loads(path.read_text())
    assert document["suite"] == "jax-ours-reference" and "jax" in document["versions"]
    rows = {row["workload"]: row for row in document["rows"]}
    assert set(rows) == {"overhead-b1-h8-s128-d64-loop-fwd", "bshd-b4-h16-s128-d64-causal-fwd+bwd"}
    for row in rows.values():
        assert row["metric"] == "tflops" and row["ours"]["backend"] == "reference"
        assert row["ours"]["ms"] > 0 and row["peers"]["jax_xla"]["ms"] > 0
        assert row["params"]["max_abs_diff_ref"] == "jax_xla" and row["params"]["max_abs_diff_vs_sdpa"] < 0.05
        if jax.default_backend() == "cpu":  # no cuDNN: the peer's failure is its entry, not a crash
            assert set(row["peers"]["jax_cudnn"]) == {"error"}
    assert rows["bshd-b4-h16-s128-d64-causal-fwd+bwd"]["params"]["max_abs_grad_diff_vs_sdpa"] < 0.1
    assert "us_per_call" in rows["overhead-b1-h8-s128-d64-loop-fwd"]["params"]
    assert "| `bshd-b4-h16-s128-d64-causal` | fwd+bwd |" in make_tables.table(document)
