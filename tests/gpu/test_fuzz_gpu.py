"""The differential fuzzer, GPU profile: 1000+ generated calls through fusedattn's selection on CUDA
tensors (bfloat16, float16), each compared, out, lse and every gradient, with a float64 result by the
rule of gpu_checks.py (tests/fuzz_cases.py has the generator, the runs and the comparison, shared with
the CPU profile in tests/test_fuzz.py). Writes a summary: calls tried, calls per backend, skips and
declines with their reasons (grouped), and every mismatch in full, one line each to paste into a named
regression test. Any mismatch, NaN or crash fails the test.

    FUZZ_CALLS=1000     calls through the selection (default 1000)
    FUZZ_SHARDS=4       tests that share them (each runs every FUZZ_SHARDS-th drawn config): pytest-xdist's
                        workers run them side by side, so the whole GPU suite fits one device call
    FUZZ_SUMMARY=path   the summary file (default bench/results/fuzz-gpu.txt; a shard's name gets -kofn)

cuDNN builds a graph per config on its first call (0.3-1 s), so each drawn config runs REPEATS times
with fresh data (seed, seed+1, ...). Then each fused backend that selection did not pick is forced
once on it: it runs and is compared too, or declines, and its reasons are the skip's.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

import fuzz_cases as fc  # noqa: E402
from hypothesis import given  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.filterwarnings("ignore:fusedattn. no fused backend supports this call")]

REPEATS = 10
FUSED = ("cudnn", "small_seq")
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SUMMARY = ROOT / "bench" / "results" / "fuzz-gpu.txt"


def _revision() -> str:
    """The commit tested: FUSEDATTN_GIT_REV where the machine's copy of the checkout has stale git data."""
    if os.environ.get("FUSEDATTN_GIT_REV"):
        return os.environ["FUSEDATTN_GIT_REV"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _title(calls: int, seconds: float, shard: int) -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else "none"
    part = f" (shard {shard + 1} of {SHARDS})" if SHARDS > 1 else ""
    return (f"fusedattn GPU fuzz{part}: {calls} calls through the selection (REPEATS={REPEATS} per config) on "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {cudnn}, git {_revision()}, "
            f"{seconds:.0f} s")


SHARDS = max(1, int(os.environ.get("FUZZ_SHARDS", "4")))


def _summary_path(shard: int) -> Path:
    path = Path(os.environ.get("FUZZ_SUMMARY", DEFAULT_SUMMARY))
    return path if SHARDS == 1 else path.with_name(f"{path.stem}-{shard + 1}of{SHARDS}{path.suffix}")


@pytest.mark.parametrize("shard", range(SHARDS))
def test_fuzz_through_the_selection_on_cuda(shard):
    configs = math.ceil(int(os.environ.get("FUZZ_CALLS", "1000")) / REPEATS)
    calls = len(range(shard, configs, SHARDS)) * REPEATS  # (the same draws in every shard: derandomized)
    log, oracle = fc.FuzzLog(), fc.GpuOracle()
    drawn = iter(range(configs * 100))

    @fc.fuzz_settings(configs)
    @given(fc.cases(fc.GPU_PROFILE))
    def one_config(case):
        if next(drawn) % SHARDS != shard:
            return
        selected = set()
        for repeat in range(REPEATS):
            result = log.add(fc.run_case(dataclasses.replace(case, seed=case.seed + repeat), device="cuda",
                                         oracle=oracle))
            selected.add(result.backend)
        for name in FUSED:
            if name not in selected:
                log.add(fc.run_case(case, device="cuda", backend=name, oracle=oracle))

    start = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        one_config()
    through_selection = sum(1 for r in log.results if r.forced is None)
    summary = log.report(_title(through_selection, time.time() - start, shard))
    path = _summary_path(shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(summary)
    print(summary)
    assert through_selection >= calls, f"only {through_selection} calls through the selection (asked {calls})"
    log.check(at_least_ran=calls // 2)


@pytest.mark.parametrize("shape", ["b111", "bh11", "b1q1", "b11k", "bhq1", "1h11", "bhqk"])
def test_a_score_mod_tensor_per_batch_is_read_per_batch(shape):
    """Found by the fuzzer: cuDNN 9.19 read a (B, 1, 1, 1) or (B, H, 1, 1) score_mod tensor as if each batch
    had the first one's values (out off by up to 2.3); score_mods.core declares it (B, ., Sq, 1). Every
    broadcast shape of an added tensor, forward, LSE and gradients against float64."""
    fc.assert_case_passes(fc.Case(layout="sbhd", dtype="float16", batch=2, seqlen_q=127, seqlen_kv=127, heads_q=8,
                                  heads_kv=2, head_dim=160, head_dim_v=160, mask="causal", window=(56, 0),
                                  softmax_type="off_by_one", score_mod=("additive_bias", shape, False), scale=1.703,
                                  seed=362881), device="cuda", framework="torch")
