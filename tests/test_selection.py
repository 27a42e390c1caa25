"""Backend selection: the "no backend" error shape, explain, overrides, the decision cache,
logging and warnings, probes that never raise, and "forward decides backward"."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
from needs_torch import requires_torch

import fusedattn
import fusedattn.backends
import fusedattn.backends.base
import fusedattn.selection
from fusedattn import AttentionConfig, NoBackendError, Selection, explain, select_backend
from fusedattn.backends import BACKENDS, Backend
from fusedattn.backends.reference import ReferenceBackend
from fusedattn.selection import clear_decisions

torch_frontend = requires_torch("the torch frontend")

REFERENCE = next(b for b in BACKENDS if b.name == "reference")
NAMES = ("small_seq", "cudnn", "triton", "reference")


@pytest.fixture(autouse=True)
def _clean(monkeypatch, fresh_selection):
    """Fresh decisions, no environment overrides, and package availability fixed:
    cudnn frontend missing, triton present (what CI has; the pinned texts depend on it)."""
    monkeypatch.setattr(fusedattn.backends.base, "package_missing", lambda module: module == "cudnn")


def make_cfg(**changes) -> AttentionConfig:
    base = dict(dtype="float32", layout="bshd", batch=2, seqlen_q=8, seqlen_kv=8, heads_q=4, heads_kv=2,
                head_dim_qk=16, head_dim_v=16)
    return AttentionConfig(**{**base, **changes})


def qkv(requires_grad=False):
    import torch

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 4, 16, generator=gen, requires_grad=requires_grad)
    k = torch.randn(2, 8, 2, 16, generator=gen, requires_grad=requires_grad)
    v = torch.randn(2, 8, 2, 16, generator=gen, requires_grad=requires_grad)
    return q, k, v


def jax_qkv():
    """qkv()'s shapes as JAX arrays."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32)) for shape in ((2, 8, 4, 16), (2, 8, 2, 16),
                                                                                    (2, 8, 2, 16)))


class SpyBackend(ReferenceBackend):
    """The reference math under another name, recording what ran."""

    def __init__(self, name: str = "spy") -> None:
        self.name = name
        self.calls: list[str] = []

    def forward(self, cfg, inputs):
        self.calls.append("forward")
        return super().forward(cfg, inputs)

    def backward(self, *args, **kwargs):
        self.calls.append("backward")
        return super().backward(*args, **kwargs)


@pytest.fixture
def install(monkeypatch):
    """Replace the backend registry (selection order) for one test."""

    def install_(*backends):
        monkeypatch.setattr(fusedattn.backends, "BACKENDS", tuple(backends))
        monkeypatch.setattr(fusedattn.selection, "BACKENDS", tuple(backends))
        clear_decisions()

    return install_


def count_probes(monkeypatch, backends=BACKENDS) -> dict[str, int]:
    """Wrap each backend's supports() to count its calls."""
    counts = {b.name: 0 for b in backends}
    for backend in backends:
        original = backend.supports

        def counted(cfg, _original=original, _name=backend.name):
            counts[_name] += 1
            return _original(cfg)

        monkeypatch.setattr(backend, "supports", counted)
    return counts


def forbid_selection(monkeypatch):
    """From now on, any probe or decision fails the test."""

    def boom(*args, **kwargs):
        raise AssertionError("selection was consulted again")

    monkeypatch.setattr(Backend, "supports", boom)
    monkeypatch.setattr(fusedattn.selection, "_decide", boom)
    monkeypatch.setattr(fusedattn.selection, "select_backend", boom)


# --------------------------------------------------------------------------- the "no backend" error

CUDNN_ON_CPU_FLOAT32 = """\
  cudnn:
    - package nvidia-cudnn-frontend not installed (import cudnn)
    - device cpu not supported (needs cuda)
    - dtype float32 not supported (supports float16, bfloat16)"""


@torch_frontend
def test_forced_backend_error_has_the_fixed_shape():
    q, k, v = qkv()
    expected = "\n".join([
        "fusedattn: backend 'cudnn' cannot run this call (forced by backend='cudnn')",
        "  q: shape (2, 8, 4, 16), dtype float32, device cpu",
        "  k: shape (2, 8, 2, 16), dtype float32, device cpu",
        "  v: shape (2, 8, 2, 16), dtype float32, device cpu",
        "  attributes: layout=bshd dtype=float32 B=2 Sq=8 Skv=8 Hq=4 Hkv=2 D=16 Dv=16 mask=none scale=0.25 "
        "training=False device=cpu framework=torch",
        "backends:",
        CUDNN_ON_CPU_FLOAT32,
    ])
    import fusedattn.torch as fat

    with pytest.raises(NoBackendError) as info:
        fat.attention(q, k, v, backend="cudnn")
    assert str(info.value) == expected
    assert isinstance(info.value, ValueError)
    assert set(info.value.reasons) == {"cudnn"}
    assert info.value.reasons["cudnn"][0] == "package nvidia-cudnn-frontend not installed (import cudnn)"
    assert info.value.cfg.layout == "bshd" and info.value.cfg.heads_kv == 2


def test_forced_backend_error_from_jax_has_the_same_shape():
    pytest.importorskip("jax")
    import fusedattn.jax as fj

    q, k, v = jax_qkv()
    device = ",".join(sorted(str(d) for d in q.devices()))
    expected = "\n".join([
        "fusedattn: backend 'cudnn' cannot run this call (forced by backend='cudnn')",
        f"  q: shape (2, 8, 4, 16), dtype float32, device {device}",
        f"  k: shape (2, 8, 2, 16), dtype float32, device {device}",
        f"  v: shape (2, 8, 2, 16), dtype float32, device {device}",
        "  attributes: layout=bshd dtype=float32 B=2 Sq=8 Skv=8 Hq=4 Hkv=2 D=16 Dv=16 mask=none scale=0.25 "
        "training=True device=cpu framework=jax",
        "backends:",
        CUDNN_ON_CPU_FLOAT32,  # the same reasons as from torch: JAX reaches cuDNN through buffer callbacks
    ])
    with pytest.raises(NoBackendError) as info:
        fj.attention(q, k, v, backend="cudnn")
    assert str(info.value) == expected


@torch_frontend
def test_no_backend_at_all_lists_every_backend_with_its_reasons(monkeypatch):
    import torch

    import fusedattn.torch as fat

    monkeypatch.setattr(REFERENCE, "_reasons", lambda cfg: ["disabled by the test"])
    q = torch.randn(10, 4, 16, requires_grad=True)
    k = v = torch.randn(10, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    expected = textwrap.dedent("""\
        fusedattn: no backend can run this call
          q: shape (10, 4, 16), dtype float32, device cpu
          k: shape (10, 2, 16), dtype float32, device cpu
          v: shape (10, 2, 16), dtype float32, device cpu
          alibi_slopes: shape (4,), dtype float32, device cpu
          sink: shape (4,), dtype float32, device cpu
          cu_seqlens_q: shape (3,), dtype int32, device cpu
          cu_seqlens_kv: shape (3,), dtype int32, device cpu
          attributes: {attributes}
        backends:
          small_seq:
            - device cpu not supported (needs cuda)
            - dtype float32 not supported (supports float16, bfloat16)
          cudnn:
            - package nvidia-cudnn-frontend not installed (import cudnn)
            - device cpu not supported (needs cuda)
            - dtype float32 not supported (supports float16, bfloat16)
          triton:
            - the triton backend is not implemented in this version of fusedattn
            - device cpu not supported (needs cuda)
            - dtype float32 not supported (supports float16, bfloat16)
          reference:
            - disabled by the test""").format(attributes=(
        "layout=thd dtype=float32 B=2 Sq=6 Skv=6 Hq=4 Hkv=2 D=16 Dv=16 mask=padding_causal window=(8, 0) "
        "bias=alibi[4] softmax=learnable scale=0.25 training=True device=cpu framework=torch"))
    with pytest.raises(NoBackendError) as info:
        fat.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, mask="causal", window=(8, 0),
                      alibi_slopes=torch.ones(4), softmax_type="learnable", sink=torch.zeros(4))
    assert str(info.value) == expected
    assert list(info.value.reasons) == list(NAMES)
    assert info.value.reasons["reference"] == ("disabled by the test",)


def test_no_backend_error_from_select_backend_without_call_lines(monkeypatch):
    monkeypatch.setattr(REFERENCE, "_reasons", lambda cfg: ["disabled by the test"])
    cfg = make_cfg()
    with pytest.raises(NoBackendError) as info:
        select_backend(cfg)
    lines = str(info.value).splitlines()
    assert lines[0] == "fusedattn: no backend can run this call"
    assert lines[1] == f"  attributes: {cfg.summary()}"
    assert lines[2] == "backends:"
    assert [line for line in lines if not line.startswith("    ")][3:] == [f"  {n}:" for n in NAMES]


def test_failed_decisions_are_not_cached(monkeypatch):
    counts = count_probes(monkeypatch)
    cfg = make_cfg()
    for _ in range(2):
        with pytest.raises(NoBackendError):
            select_backend(cfg, "cudnn")
    assert counts["cudnn"] == 2


# --------------------------------------------------------------------------- explain

def test_explain_output_is_pinned():
    cfg = make_cfg(dtype="bfloat16", batch=2, seqlen_q=128, seqlen_kv=128, heads_q=8, heads_kv=8,
                   head_dim_qk=64, head_dim_v=64, device="cuda")
    expected = textwrap.dedent("""\
        config: {config}
        selected: reference
        backends (in selection order):
          small_seq: rejected
            - Sq=128: needs Sq = 1 (THD: max_seqlen_q = 1, sequences of one query or none)
            - Skv=128 > 64 (longer key sequences are faster elsewhere; 64 needs Hq == Hkv and D <= 128)
          cudnn: rejected
            - package nvidia-cudnn-frontend not installed (import cudnn)
          triton: rejected
            - the triton backend is not implemented in this version of fusedattn
          reference: selected""").format(config=(
        "layout=bshd dtype=bfloat16 B=2 Sq=128 Skv=128 Hq=8 Hkv=8 D=64 Dv=64 mask=none scale=0.125 "
        "training=False device=cuda framework=torch"))
    assert explain(cfg) == expected


def test_explain_forced_backend_that_cannot_run():
    cfg = make_cfg(dtype="bfloat16", device="cuda")
    text = explain(cfg, backend="cudnn")
    lines = text.splitlines()
    assert lines[0] == f"config: {cfg.summary()}"
    assert lines[1] == ("selected: none; backend 'cudnn' (forced by backend='cudnn') cannot run this call, "
                        "which raises NoBackendError")
    assert "  reference: supported (not used: forced by backend='cudnn')" in lines
    assert "  cudnn: rejected" in lines


def test_explain_forced_backend_that_runs():
    text = explain(make_cfg(), backend="reference")
    assert text.splitlines()[1] == "selected: reference"
    assert "  reference: selected (forced by backend='reference')" in text.splitlines()


def test_explain_with_a_supported_backend_later_in_order(install):
    spy, other = SpyBackend("spy"), SpyBackend("other")
    install(spy, other)
    assert explain(make_cfg()).splitlines()[2:] == [
        "backends (in selection order):",
        "  spy: selected",
        "  other: supported (not used: spy comes first)",
    ]


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_explain_never_raises_on_a_bad_forced_name(monkeypatch, how):
    cfg = make_cfg()
    if how == "environment":
        monkeypatch.setenv("FUSEDATTN_BACKEND", "flash")
        text = explain(cfg)
    else:
        text = explain(cfg, backend="flash")
    assert text.splitlines()[0] == f"config: {cfg.summary()}"
    assert text.splitlines()[1].startswith("error: ")
    assert "'flash'" in text


def test_explain_never_raises_when_a_probe_throws(monkeypatch):
    def broken(cfg):
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(REFERENCE, "_reasons", broken)
    text = explain(make_cfg())
    assert text.splitlines()[1].startswith("selected: none")
    assert "    - reference: support check failed: RuntimeError: probe exploded" in text.splitlines()


def test_explain_all_rejected_line_reads_correctly(monkeypatch):
    """With nothing selectable, the verdict line must not say "no backend cannot run" (which means
    every backend can)."""
    monkeypatch.setattr(REFERENCE, "_reasons", lambda cfg: ["disabled by the test"])
    line = explain(make_cfg()).splitlines()[1]
    assert line.startswith("selected: none; ")
    assert "no backend cannot" not in line


# --------------------------------------------------------------------------- select_backend

def test_select_backend_returns_reference_with_every_other_backends_reasons():
    selection = select_backend(make_cfg())
    assert isinstance(selection, Selection)
    assert selection.name == "reference" and selection.backend is REFERENCE
    assert selection.forced_by is None
    assert set(selection.rejected) == {"small_seq", "cudnn", "triton"}
    for name, reasons in selection.rejected.items():
        assert reasons and all(isinstance(r, str) and r for r in reasons), name
    assert selection.rejected["cudnn"][0] == "package nvidia-cudnn-frontend not installed (import cudnn)"
    assert "device cpu not supported (needs cuda)" in selection.rejected["triton"]


def test_backends_after_the_winner_are_marked_not_probed(install, monkeypatch):
    first, second = SpyBackend("first"), SpyBackend("second")
    install(first, second)
    counts = count_probes(monkeypatch, (first, second))
    selection = select_backend(make_cfg())
    assert selection.backend is first
    assert selection.rejected == {"second": ("not probed: first comes first in the order",)}
    assert counts == {"first": 1, "second": 0}


def test_force_by_name():
    selection = select_backend(make_cfg(), "reference")
    assert selection.backend is REFERENCE
    assert selection.forced_by == "backend='reference'"
    assert dict(selection.rejected) == {}


def test_force_by_unknown_name():
    with pytest.raises(ValueError, match=r"backend: expected one of 'small_seq', 'cudnn', 'triton', 'reference', "
                                         r"got 'flash'"):
        select_backend(make_cfg(), "flash")


def test_environment_forces_a_backend(monkeypatch):
    monkeypatch.setenv("FUSEDATTN_BACKEND", " reference ")
    selection = select_backend(make_cfg())
    assert selection.backend is REFERENCE
    assert selection.forced_by == "FUSEDATTN_BACKEND=reference"
    monkeypatch.setenv("FUSEDATTN_BACKEND", "cudnn")
    with pytest.raises(NoBackendError, match=r"\(forced by FUSEDATTN_BACKEND=cudnn\)"):
        select_backend(make_cfg())


@torch_frontend
def test_explicit_backend_wins_over_environment(monkeypatch):
    import fusedattn.torch as fat

    monkeypatch.setenv("FUSEDATTN_BACKEND", "cudnn")
    selection = select_backend(make_cfg(), "reference")
    assert selection.forced_by == "backend='reference'"
    q, k, v = qkv()
    with pytest.raises(NoBackendError, match="forced by FUSEDATTN_BACKEND=cudnn"):
        fat.attention(q, k, v)
    assert fat.attention(q, k, v, backend="reference").shape == (2, 8, 4, 16)


def test_empty_environment_value_means_no_override(monkeypatch):
    monkeypatch.setenv("FUSEDATTN_BACKEND", "")
    assert select_backend(make_cfg()).forced_by is None


# --------------------------------------------------------------------------- the decision cache

def test_decisions_are_cached_per_config(monkeypatch):
    counts = count_probes(monkeypatch)
    cfg = make_cfg()
    first = select_backend(cfg)
    assert counts == {name: 1 for name in NAMES}
    again = select_backend(make_cfg())  # an equal config built anew
    assert again is first
    assert counts == {name: 1 for name in NAMES}
    select_backend(make_cfg(mask="causal"))
    assert counts == {name: 2 for name in NAMES}
    select_backend(cfg, "reference")  # a forced decision is its own entry
    assert counts["reference"] == 3
    assert len(fusedattn.selection._decisions) == 3
    clear_decisions()
    select_backend(cfg)
    assert counts["small_seq"] == 3


@torch_frontend
def test_frontend_calls_with_the_same_shapes_probe_once(monkeypatch):
    import fusedattn.torch as fat

    counts = count_probes(monkeypatch)
    for _ in range(3):
        fat.attention(*qkv(), mask="causal")
    assert counts == {name: 1 for name in NAMES}
    fat.attention(*qkv(), mask="causal", scale=0.5)
    assert counts == {name: 2 for name in NAMES}


# --------------------------------------------------------------------------- logging and warnings

def test_log_environment_logs_each_new_decision_once(monkeypatch, caplog):
    monkeypatch.setenv("FUSEDATTN_LOG", "1")
    caplog.set_level(logging.INFO, logger="fusedattn")
    cfg = make_cfg()
    select_backend(cfg)
    select_backend(cfg)
    records = [r for r in caplog.records if r.name == "fusedattn"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert message.startswith(f"fusedattn: {cfg.summary()} -> reference; others: small_seq: ")
    select_backend(make_cfg(mask="causal"))
    select_backend(cfg, "reference")
    messages = [r.getMessage() for r in caplog.records if r.name == "fusedattn"]
    assert len(messages) == 3
    assert messages[2].endswith("-> reference (forced by backend='reference'); others: -")


def test_no_log_without_the_environment(caplog):
    caplog.set_level(logging.DEBUG, logger="fusedattn")
    select_backend(make_cfg())
    assert not [r for r in caplog.records if r.name == "fusedattn"]


def test_log_environment_logs_to_stderr_without_logging_setup():
    script = textwrap.dedent("""\
        from fusedattn import AttentionConfig, select_backend
        cfg = AttentionConfig(dtype="float32", layout="bshd", batch=1, seqlen_q=4, seqlen_kv=4,
                              heads_q=2, heads_kv=2, head_dim_qk=8, head_dim_v=8)
        select_backend(cfg)
        select_backend(cfg)
    """)
    env = {"FUSEDATTN_LOG": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if " -> " in line]
    assert len(lines) == 1
    assert lines[0].startswith("fusedattn: layout=bshd dtype=float32 B=1 Sq=4 Skv=4") and "-> reference" in lines[0]


def test_log_environment_logs_when_the_application_configured_logging():
    """FUSEDATTN_LOG=1 is an explicit request: it shows even under logging.basicConfig() (root at WARNING)."""
    script = textwrap.dedent("""\
        import logging
        logging.basicConfig(format="%(name)s %(message)s")
        from fusedattn import AttentionConfig, select_backend
        cfg = AttentionConfig(dtype="float32", layout="bshd", batch=1, seqlen_q=4, seqlen_kv=4,
                              heads_q=2, heads_kv=2, head_dim_qk=8, head_dim_v=8)
        select_backend(cfg)
    """)
    env = {"FUSEDATTN_LOG": "1", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert len([line for line in result.stderr.splitlines() if " -> reference" in line]) == 1, result.stderr


def test_concurrent_first_calls_log_the_decision_once(monkeypatch, caplog):
    """Threads racing on one new config share one decision, and it is announced once."""
    monkeypatch.setenv("FUSEDATTN_LOG", "1")
    caplog.set_level(logging.INFO, logger="fusedattn")
    release = threading.Event()
    entered = threading.Event()
    original = REFERENCE._reasons

    def slow(cfg):
        entered.set()
        release.wait(5)
        return original(cfg)

    monkeypatch.setattr(REFERENCE, "_reasons", slow)
    cfg = make_cfg()
    barrier = threading.Barrier(4)
    results = []

    def worker():
        barrier.wait()
        results.append(select_backend(cfg))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    assert entered.wait(5)
    threading.Event().wait(0.2)  # let the other threads reach the pending build
    release.set()
    for t in threads:
        t.join(5)
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert len([r for r in caplog.records if r.name == "fusedattn"]) == 1


def _recorded(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [w for w in caught if issubclass(w.category, RuntimeWarning)]


def test_gpu_call_falling_back_to_reference_warns_once():
    cfg = make_cfg(dtype="bfloat16", device="cuda")
    caught = _recorded(lambda: (select_backend(cfg), select_backend(cfg)))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "unfused reference" in message
    assert "cudnn: package nvidia-cudnn-frontend not installed (import cudnn)" in message
    assert "fusedattn.explain(cfg)" in message
    # a new config is a new decision: it warns again, once
    assert len(_recorded(lambda: [select_backend(cfg.replace(mask="causal")) for _ in range(3)])) == 1


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_forced_reference_on_gpu_does_not_warn(monkeypatch, how):
    cfg = make_cfg(device="cuda")
    if how == "environment":
        monkeypatch.setenv("FUSEDATTN_BACKEND", "reference")
        assert not _recorded(lambda: select_backend(cfg))
    else:
        assert not _recorded(lambda: select_backend(cfg, "reference"))


@torch_frontend
def test_cpu_call_on_reference_does_not_warn():
    import fusedattn.torch as fat

    assert not _recorded(lambda: fat.attention(*qkv()))


@torch_frontend
def test_gpu_fallback_warning_points_at_the_callers_line(monkeypatch):
    """The RuntimeWarning is attributed to the user's call, not to fusedattn's internals."""
    import fusedattn.torch.functional as functional
    from fusedattn.arguments import TensorMeta

    original = functional._meta

    def as_if_on_gpu(x, name):
        meta = original(x, name)
        return None if meta is None else TensorMeta(meta.shape, meta.dtype, "cuda:0", "cuda")

    monkeypatch.setattr(functional, "_meta", as_if_on_gpu)
    caught = _recorded(lambda: functional.attention(*qkv()))
    assert len(caught) == 1
    assert caught[0].filename == __file__


# --------------------------------------------------------------------------- probes never raise

def test_supports_never_raises_when_a_backends_own_rule_throws(monkeypatch):
    def broken(cfg):
        raise KeyError("boom")

    monkeypatch.setattr(REFERENCE, "_reasons", broken)
    reasons = REFERENCE.supports(make_cfg())
    assert reasons == ["reference: support check failed: KeyError: 'boom'"]
    with pytest.raises(NoBackendError, match="reference: support check failed: KeyError"):
        select_backend(make_cfg())


def test_supports_never_raises_when_availability_throws(monkeypatch):
    def broken(module):
        raise RuntimeError("finder exploded")

    monkeypatch.setattr(fusedattn.backends.base, "package_missing", broken)
    for backend in BACKENDS:
        reasons = backend.supports(make_cfg())
        if backend.packages:
            assert reasons == [f"{backend.name}: support check failed: RuntimeError: finder exploded"]
        assert all(isinstance(r, str) for r in reasons)


@pytest.mark.parametrize("cfg", [
    make_cfg(),
    make_cfg(dtype="float16", device="cuda", seqlen_q=1, seqlen_kv=16),
    make_cfg(dtype="bfloat16", device="cuda", head_dim_qk=320, head_dim_v=12),
    make_cfg(framework="jax", device="cuda", dtype="float16", layout="thd", mask="padding", padded_offsets=True),
], ids=["cpu", "decode", "big-head-dim", "jax-thd"])
def test_supports_returns_reason_strings_for_every_backend(cfg):
    for backend in BACKENDS:
        reasons = backend.supports(cfg)
        assert isinstance(reasons, list) and all(isinstance(r, str) and r for r in reasons)


def test_shared_rules_give_value_and_limit():
    cudnn = next(b for b in BACKENDS if b.name == "cudnn")
    reasons = cudnn.supports(make_cfg(dtype="bfloat16", device="cuda", head_dim_qk=320, head_dim_v=12))
    assert "head_dim_qk=320 > 256" in reasons
    assert "head_dim_v=12 is not a multiple of 8" in reasons


@torch_frontend
# --------------------------------------------------------------------------- forward decides backward

def test_torch_backward_runs_on_the_forward_backend(install, monkeypatch):
    import torch

    import fusedattn.torch as fat

    spy = SpyBackend()
    install(*BACKENDS, spy)
    q, k, v = qkv(requires_grad=True)
    out = fat.attention(q, k, v, mask="causal", backend="spy")
    assert spy.calls == ["forward"]
    forbid_selection(monkeypatch)
    out.sum().backward()
    assert spy.calls == ["forward", "backward"]
    assert q.grad is not None and k.grad is not None and v.grad is not None
    assert torch.isfinite(q.grad).all()


@torch_frontend
def test_torch_backward_ignores_a_changed_selection(install, monkeypatch):
    """Between forward and backward the order changes so that a re-dispatch would pick another
    backend: backward still goes to the backend that ran the forward pass."""
    import fusedattn.torch as fat

    calls = []
    original = REFERENCE.backward

    def recording(*args, **kwargs):
        calls.append("reference.backward")
        return original(*args, **kwargs)

    monkeypatch.setattr(REFERENCE, "backward", recording)
    q, k, v = qkv(requires_grad=True)
    out = fat.attention(q, k, v)  # selected: reference
    interloper = SpyBackend("interloper")
    install(interloper, *BACKENDS)
    assert select_backend(make_cfg(is_training=True)).backend is interloper
    out.sum().backward()
    assert calls == ["reference.backward"]
    assert interloper.calls == []


def test_jax_grad_runs_forward_and_backward_on_the_forced_backend(install, monkeypatch):
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    spy = SpyBackend()
    install(*BACKENDS, spy)
    counts = count_probes(monkeypatch, (*BACKENDS, spy))
    q, k, v = jax_qkv()
    grad = jax.jit(jax.grad(lambda q: fj.attention(q, k, v, mask="causal", backend="spy").sum()))(q)
    assert grad.shape == q.shape
    assert spy.calls.count("forward") >= 1 and spy.calls.count("backward") == 1
    assert counts["spy"] == 1 and sum(counts.values()) == 1


def test_jax_pullback_does_not_consult_selection(install, monkeypatch):
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    spy = SpyBackend()
    install(*BACKENDS, spy)
    q, k, v = jax_qkv()
    out, pullback = jax.vjp(jax.jit(lambda q, k, v: fj.attention(q, k, v, backend="spy")), q, k, v)
    assert "backward" not in spy.calls
    forbid_selection(monkeypatch)
    grads = pullback(jax.numpy.ones_like(out))
    assert spy.calls[-1] == "backward" and spy.calls.count("backward") == 1
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
