"""bench/bench_jax.py --cpu-smoke: rows in the results format, a failing peer as an error entry, readable tables."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from needs_torch import import_torch

import_torch("bench/bench_jax.py takes its helpers from bench/bench_cudnn.py, a torch benchmark")
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


FEATURE_SHAPE = "b2-h2-s128-d32"  # --cpu-smoke's feature rows
SMALL_SEQ = "small_seq-b64-h2-sq1-skv16-d32"
NO_JAX_NN = ("sink", "softcap", "thd")  # jax.nn.dot_product_attention has no keyword for these


def test_cpu_smoke_feature_rows_have_their_fields(tmp_path, capsys):
    path = tmp_path / "jax.json"
    assert bench_jax.main(["--cpu-smoke", "--features", "--repeats", "1", "--out", str(path)]) == 0
    document = json.loads(path.read_text())
    rows = {row["workload"]: row for row in document["rows"]}
    names = [f"{feature}-{FEATURE_SHAPE}" for feature in bench_jax.feature_rows.FEATURES[:-1]] + [SMALL_SEQ]
    assert set(rows) == {f"{name}-{mode}" for name in names for mode in ("fwd", "fwd+bwd")}
    for workload, row in rows.items():
        params, peers = row["params"], row["peers"]
        feature = params["feature"]
        assert row["ours"]["backend"] == "reference" and row["ours"]["ms"] > 0, workload
        assert params["torch_cuda_in_jax_process"] is False and "torch_path" not in peers
        if feature in NO_JAX_NN:  # the reason is the entry; no check without a peer
            assert all(peers[name]["error"].startswith("skipped: jax.nn.dot_product_attention takes no")
                       for name in ("jax_cudnn", "jax_xla")), workload
            assert params["max_abs_diff_ref"] is None
        else:
            assert peers["jax_xla"]["ms"] > 0 and params["max_abs_diff_ref"] == "jax_xla", workload
            assert params["max_abs_diff_vs_sdpa"] < 0.05, workload
            if params["mode"] == "fwd+bwd":
                assert params["max_abs_grad_diff_vs_sdpa"] < 0.1, workload
        if feature == "small_seq":
            assert params["bytes"] > 0 and params["copy_GBps"] > 0 and params["ours_GBps"] > 0
            assert params["fraction_of_copy"] > 0 and params["ours_launch"] == "reference (cpu smoke)"
            assert "host_us" not in params
        else:
            assert params["host_us"]["ours"] > 0 and params["host_loop_us"] > 0, workload
            assert isinstance(params["host_us_minus_plain"], float), workload
            assert isinstance(params["host_loop_us_minus_plain"], float), workload
    assert rows[f"padding-{FEATURE_SHAPE}-fwd"]["params"]["seqlens"] == [128, 96]
    assert rows[f"thd-{FEATURE_SHAPE}-fwd"]["params"]["seqlens"] == [32, 48, 80, 96]
    assert "feature rows: peer us / ours us" in capsys.readouterr().out
    assert f"| `{SMALL_SEQ}` | fwd |" in make_tables.table(document)


def test_cpu_smoke_torch_peer_runs_our_torch_path_in_a_subprocess(tmp_path):
    path = tmp_path / "jax.json"
    only = f"^thd-{FEATURE_SHAPE}-fwd\\+bwd$"
    assert bench_jax.main(["--cpu-smoke", "--features", "--torch-peer", "--only", only, "--repeats", "1",
                           "--out", str(path)]) == 0
    (row,) = json.loads(path.read_text())["rows"]
    params = row["params"]
    assert row["peers"]["torch_path"]["ms"] > 0 and params["torch_path_us"] > 0 and params["torch_path_ratio"] > 0
    assert params["torch_path_jax_loaded"] is False and params["torch_cuda_in_jax_process"] is False
    assert params["max_abs_diff_ref"] == "torch_path (sampled)"
    assert params["torch_path_max_abs_diff"] < 0.05 and params["torch_path_max_abs_grad_diff"] < 0.1
    assert row["ratio_vs_best_peer"] == pytest.approx(params["torch_path_ratio"], rel=1e-3)
