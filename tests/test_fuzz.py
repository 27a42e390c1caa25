"""The differential fuzzer, CPU profile (CI): hypothesis draws valid attention calls
(tests/fuzz_cases.py), each runs on the backend fusedattn selects (or a forced one) and is compared,
out, lse and every gradient, with tests/naive.py in float64 (STYLE 15), proving which backend ran
(STYLE 17). Examples are fixed (derandomized) and bounded: the file takes about a minute on 2 cores.

Failures are collected, not raised one by one: a failing test prints every failing call in full,
each ready to paste as `assert_case_passes(Case(...))` into a named regression test.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import pytest
from needs_torch import import_torch

torch = import_torch("the fuzz cases (tests/fuzz_cases.py) and their reference (tests/naive.py) are torch's")
hypothesis = pytest.importorskip("hypothesis")

import fuzz_cases as fc  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fusedattn.backends import BACKENDS  # noqa: E402
from fusedattn.backends.small_seq import ENV_ON_CPU  # noqa: E402
from fusedattn.selection import clear_decisions  # noqa: E402

TORCH_EXAMPLES = 1500
JAX_EXAMPLES = 40
SMALL_SEQ_EXAMPLES = 300
SELECTION_EXAMPLES = 1000

# Selection warns when a GPU call falls back to the reference: here that is expected, many times over.
pytestmark = pytest.mark.filterwarnings("ignore:fusedattn. no fused backend supports this call")


@pytest.fixture(autouse=True)
def _plain_selection(monkeypatch, fresh_selection):
    """No backend forced from the environment, small_seq off the CPU unless a test turns it on,
    decisions made afresh (the environment is not part of their key)."""
    monkeypatch.delenv(ENV_ON_CPU, raising=False)


def fuzz(profile: fc.Profile, examples: int, **run) -> fc.FuzzLog:
    """Run `examples` cases of `profile` through fc.run_case(**run); the log of every result."""
    log = fc.FuzzLog()

    @fc.fuzz_settings(examples)
    @given(fc.cases(profile))
    def one(case):
        log.add(fc.run_case(case, **run))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's warnings about empty or odd shapes
        one()
    print(log.report(f"fuzz {profile.name}: {run}"))
    return log


def test_reference_torch_matches_naive():
    log = fuzz(fc.CPU_PROFILE, TORCH_EXAMPLES)
    log.check(at_least_ran=TORCH_EXAMPLES * 9 // 10)
    assert set(log.ran()) == {"reference"}, "on the CPU, selection picks the reference"
    assert not log.missing(fc.REQUIRED_FEATURES), "never drawn (raise the examples or the feature's percent)"


def test_reference_jax_matches_naive():
    pytest.importorskip("jax")
    log = fuzz(fc.JAX_PROFILE, JAX_EXAMPLES, framework="jax")
    log.check(at_least_ran=JAX_EXAMPLES * 9 // 10)
    assert set(log.ran()) == {"reference"}


def test_small_seq_kernels_in_the_interpreter(monkeypatch):
    """small_seq's Triton kernels under TRITON_INTERPRET=1 (set by conftest before triton loads), forced:
    calls inside its rules run and are compared; calls outside them are skips with its reasons."""
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in Triton's interpreter on CPU machines (tests/gpu has the GPU run)")
    monkeypatch.setenv(ENV_ON_CPU, "1")
    clear_decisions()
    log = fuzz(fc.SMALL_SEQ_PROFILE, SMALL_SEQ_EXAMPLES, backend="small_seq")
    log.check(at_least_ran=SMALL_SEQ_EXAMPLES // 2)
    assert set(log.ran()) == {"small_seq"}
    assert log.skips(), "some calls outside small_seq's rules were drawn: their skips carry its reasons"
    assert not log.missing({*(f"layout={x}" for x in ("thd", "bshd", "thd_t2hd", "bshd_bs2hd")), "dtype=float16",
                            "dtype=bfloat16", "GQA", "MQA", "empty sequence", "THD gaps"})


@fc.fuzz_settings(SELECTION_EXAMPLES)
@given(case=st.one_of(fc.cases(fc.CPU_PROFILE), fc.cases(fc.GPU_PROFILE), fc.cases(fc.SMALL_SEQ_PROFILE)),
       device=st.sampled_from(("cpu", "cuda")), framework=st.sampled_from(("torch", "jax")))
def test_selection_never_raises_and_picks_a_backend_that_supports_the_call(case, device, framework):
    """Configs of every kind of case, on either device and framework: the config is valid, explain
    never raises, the selected backend has no reasons and every forced backend is consistent."""
    cfg = fc.case_config(case, device=device, framework=framework)
    problems = fc.selection_problems(cfg)
    assert not problems, f"{case!r} on {device}/{framework}:\n" + "\n".join(problems)


@pytest.mark.parametrize("dtype,rows,factor", [("float32", 1, 1.01), ("bfloat16", None, 1.03)],
                         ids=["float32-one-row-1%", "bfloat16-all-3%"])
def test_comparison_catches_a_slightly_wrong_backend(monkeypatch, dtype, rows, factor):
    """The comparison can fail: a reference whose output is a little off (one row by 1% in float32,
    everything by 3% in bfloat16, about 4 times its rounding) is caught; untouched, the case passes."""
    reference = next(b for b in BACKENDS if b.name == "reference")
    original = type(reference).forward

    def a_little_off(cfg, inputs):
        outputs, saved = original(reference, cfg, inputs)
        out = outputs.out.clone()
        out.view(-1, out.shape[-1])[:rows] *= factor
        return outputs._replace(out=out), saved

    case = fc.Case(layout="bshd", dtype=dtype, batch=2, seqlen_q=9, seqlen_kv=13, heads_q=4, heads_kv=2,
                   head_dim=64, head_dim_v=64, mask="causal_bottom_right", seed=5)
    assert fc.run_case(case).status == "passed"
    monkeypatch.setattr(reference, "forward", a_little_off)
    result = fc.run_case(case)
    assert result.status == "failed" and any(p.startswith("out:") for p in result.problems), result.describe()


def test_error_rule_matches_the_gpu_checks():
    """CPU and GPU fuzz runs and tests/gpu share one rule: the same FACTOR and ATOL as exact_rule.py."""
    path = Path(__file__).parent / "gpu" / "exact_rule.py"
    spec = importlib.util.spec_from_file_location("exact_rule_for_fuzz", path)
    exact_rule = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(exact_rule)
    assert fc.FACTOR == exact_rule.FACTOR
    for dtype, atol in exact_rule.ATOL.items():
        assert fc.ATOL[dtype] == atol
