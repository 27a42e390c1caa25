"""bench/common.ResultsFile: --merge keeps earlier rows and the peers a later run did not measure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import common  # noqa: E402


def row(workload, ours_ms, peers):
    return {"workload": workload, "params": {}, "ours": {"ms": ours_ms, "value": 1.0},
            "peers": {name: ({"ms": ms} if ms else {"error": "crashed"}) for name, ms in peers.items()}}


def test_merge_keeps_rows_and_the_peers_of_other_runs(tmp_path):
    path = tmp_path / "suite.json"
    first = common.ResultsFile(path, {"suite": "s"})
    first.add(row("a", 1.0, {"cudnn": 4.0, "eager": 2.0}))
    first.add(row("b", 1.0, {"cudnn": 3.0}))
    second = common.ResultsFile(path, {"suite": "s"}, merge=True)
    second.add(row("a", 0.5, {"flash": 1.0, "eager": None}))  # a peer in its own process; eager crashed now
    rows = {r["workload"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"a", "b"}
    assert set(rows["a"]["peers"]) == {"cudnn", "eager", "flash"} and "error" in rows["a"]["peers"]["eager"]
    assert rows["a"]["ours"]["ms"] == 0.5 and rows["a"]["ratio_vs_best_peer"] == pytest.approx(2.0)
    assert rows["b"]["peers"] == {"cudnn": {"ms": 3.0}}
