"""bench/bench_score_mod.py on the CPU (reference backend): rows at S <= 1024 carry the host time of ours
and of cudnn_plain and what the modification adds (the measure issue 13's score_mod target names)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_score_mod  # noqa: E402


def test_small_rows_record_host_time(tmp_path):
    path = tmp_path / "score_mod.json"
    assert bench_score_mod.main(["--device", "cpu", "--ours-backend", "reference", "--seqlens", "64",
                                 "--head-dims", "16", "--mods", "softcap_flex", "--modes", "fwd",
                                 "--host-rounds", "2", "--repeats", "2", "--warmup", "1", "--out", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    ours, plain = row["ours"]["host_us"], row["peers"]["cudnn_plain"]["host_us"]
    assert ours > 0 and plain > 0
    assert row["params"]["host_extra_us"] == pytest.approx(ours - plain, abs=0.02)
