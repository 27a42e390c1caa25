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


def test_host_extra_pairs_each_rounds_turns():
    """What ours adds is the median of per-round differences: a slow spell that touches one round's two
    turns cancels (the difference of the two medians would keep part of it); rounds without both skip."""
    import contextlib

    import common

    samples = {"ours": [10.0, 30.0, 12.5, None, 11.0], "cudnn_plain": [8.0, 28.0, 9.0, 9.0, 10.0]}
    assert common.paired_median(samples, "ours", "cudnn_plain") == 2.0  # of 2, 2, 3.5, 1
    assert common.medians(samples) == {"ours": 11.75, "cudnn_plain": 9.0}  # their difference: 2.75
    assert common.paired_median({"ours": [None], "cudnn_plain": [1.0]}, "ours", "cudnn_plain") is None

    class Turn:  # one implementation: its samples in turn, None where a round gives none
        def __init__(self, values):
            self.values = iter(values)

        def context(self):
            return contextlib.nullcontext()

    turns = common._take_turns({"a": Turn([1.0, None, 3.0]), "b": Turn([4.0, 5.0, None])}, 3,
                               lambda impl: next(impl.values))
    assert turns == {"a": [1.0, None, 3.0], "b": [4.0, 5.0, None]}  # the i-th of each is round i's
