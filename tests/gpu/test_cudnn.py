"""The cuDNN backend against the reference, forward and every gradient, on a GPU.

Error rule (STYLE 15): cuDNN's error against a float64 computation must stay within a
small multiple of the same-dtype reference's own error (the reference computes in float32
and rounds once to the I/O dtype).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cudnn")

from gpu_checks import (  # noqa: E402
    _lengths,
    _pack,
    _thd,
    assert_close_to_exact,
    assert_replay_matches,
    check_against_reference,
    make,
    run,
)

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends import get_backend  # noqa: E402

pytestmark = pytest.mark.gpu

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "bs3hd", "sb3hd", "bshd_bs2hd", "sbhd_sb2hd"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_layouts_and_masks(dtype, layout, mask):
    packed_all = layout in ("bs3hd", "sb3hd")
    q, k, v = make(2, 128, 128 if packed_all else 192, 4, 4 if packed_all else 2, 64, 64, dtype)
    tensors, _ = _pack(layout, q, k, v)
    check_against_reference(tensors, {"layout": layout, "mask": mask}, dtype)


@pytest.mark.parametrize("mask,sq,skv", [("causal", 96, 160), ("causal", 160, 96), ("causal_bottom_right", 96, 160),
                                         ("causal_bottom_right", 160, 96), ("none", 96, 160)])
def test_alignment(mask, sq, skv):
    q, k, v = make(2, sq, skv, 4, 4, 128, 128, torch.bfloat16, seed=1)
    check_against_reference((q, k, v), {"mask": mask}, torch.bfloat16)


@pytest.mark.parametrize("mask,window", [("causal", (32, 0)), ("none", (16, 16)), ("none", (-1, 8)),
                                         ("none", (24, -1)), ("causal_bottom_right", (40, 0))])
def test_windows(mask, window):
    q, k, v = make(2, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=2)
    check_against_reference((q, k, v), {"mask": mask, "window": window}, torch.bfloat16)


@pytest.mark.parametrize("hq,hkv,d,dv", [(8, 2, 128, 128), (8, 1, 64, 64), (4, 4, 192, 128), (4, 4, 256, 256),
                                         (4, 2, 32, 32)])
def test_heads_and_dims(hq, hkv, d, dv):
    q, k, v = make(2, 128, 128, hq, hkv, d, dv, torch.bfloat16, seed=3)
    check_against_reference((q, k, v), {"mask": "causal"}, torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 4, 128, 128), (2, 1, 128, 128), (1, 1, 128, 128), (2, 4, 128, 128),
                                   (128, 128)])
def test_post_scale_bias(shape):
    q, k, v = make(2, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=4)
    bias = torch.randn(shape, device="cuda").to(torch.bfloat16)
    check_against_reference((q, k, v), {"bias": bias}, torch.bfloat16)


@pytest.mark.parametrize("softmax_type", ["off_by_one", "learnable"])
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_sinks(softmax_type, mask):
    q, k, v = make(2, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=5)
    options = {"softmax_type": softmax_type, "mask": mask}
    if softmax_type == "learnable":
        options["sink"] = torch.randn(4, device="cuda")
    check_against_reference((q, k, v), options, torch.bfloat16)


@pytest.mark.parametrize("mask,softmax_type", [("none", "vanilla"), ("causal", "vanilla"), ("causal", "learnable"),
                                               ("padding_causal", "vanilla"), ("padding", "vanilla")])
def test_max_logit_and_lse(mask, softmax_type):
    q, k, v = make(3, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=10)
    options = {"mask": mask, "softmax_type": softmax_type}
    if mask.startswith("padding"):  # rows past each end, and a sequence without keys
        options.update(cu_seqlens_q=_lengths([128, 70, 33]), cu_seqlens_kv=_lengths([100, 0, 128]))
    if softmax_type == "learnable":
        options["sink"] = torch.randn(4, device="cuda")
    # Freed blocks full of large numbers: a buffer the call reads before anything writes it shows.
    poison = [torch.full((3 * 4 * 128,), 1e4, device="cuda") for _ in range(256)]
    del poison
    limit = "README: max_logit not with a learnable sink" if softmax_type == "learnable" else None
    check_against_reference((q, k, v), options, torch.bfloat16, max_logit=True, known_limit=limit)


def test_dropout_is_reproducible_and_drops_about_p():
    q, k, v = make(2, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=6)
    options = {"dropout_p": 0.25, "dropout_seed": 1234, "dropout_offset": 0}
    first, first_grads = run("cudnn", (q, k, v), options)
    again, again_grads = run("cudnn", (q, k, v), options)
    assert torch.equal(first.out, again.out)
    for a, b in zip(first_grads, again_grads):
        assert torch.equal(a, b)
    other, _ = run("cudnn", (q, k, v), {**options, "dropout_seed": 99})
    assert not torch.equal(first.out, other.out)
    # v = identity over 64 keys: out[b, i, h, j] = P_ij * keep_ij / (1 - p), zero where dropped.
    v_eye = torch.eye(64, device="cuda").reshape(1, 64, 1, 64).expand(2, 64, 4, 64).to(torch.bfloat16).contiguous()
    probe = fat.attention(q, k[:, :64], v_eye, backend="cudnn", dropout_p=0.25, dropout_seed=5)
    dropped = (probe == 0).float().mean().item()
    assert 0.2 < dropped < 0.3, dropped


def test_deterministic_backward_is_bitwise_repeatable():
    q, k, v = make(2, 256, 256, 8, 2, 64, 64, torch.bfloat16, seed=8)
    _, first = run("cudnn", (q, k, v), {"mask": "causal", "deterministic": True})
    _, again = run("cudnn", (q, k, v), {"mask": "causal", "deterministic": True})
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_auto_selection_picks_cudnn_and_explain_shows_cudnn_reasons():
    q, k, v = make(1, 64, 64, 2, 2, 64, 64, torch.bfloat16)
    cfg = fusedattn.AttentionConfig(dtype="bfloat16", layout="bshd", batch=1, seqlen_q=64, seqlen_kv=64, heads_q=2,
                                    heads_kv=2, head_dim_qk=64, head_dim_v=64, device="cuda", is_training=True)
    assert fusedattn.select_backend(cfg).name == "cudnn"
    rejected = cfg.replace(head_dim_qk=72 * 8, head_dim_v=72 * 8)  # 576 > 256: cheap rule
    assert "head_dim_qk=576 > 256" in fusedattn.explain(rejected)
    # A config cuDNN itself declines shows cuDNN's own message.
    declined = cfg.replace(mask="causal", softmax="learnable", return_max_logit=True)
    text = fusedattn.explain(declined)
    assert "cudnn: rejected" in text and "cuDNN" in text, text


def test_graphs_are_built_once_and_reused():
    from fusedattn.backends.cudnn.runtime import graph_cache

    q, k, v = make(1, 80, 80, 2, 2, 64, 64, torch.bfloat16, seed=9)
    builds = graph_cache().builds
    for _ in range(3):
        fat.attention(q, k, v, mask="causal", backend="cudnn")
    assert graph_cache().builds - builds == 1  # the forward graph, built by the probe


def test_backend_object_reports_available():
    assert get_backend("cudnn").availability() == []


def test_model_step_runs_under_cuda_graph_capture():
    def setup():
        torch.manual_seed(1)
        proj = torch.nn.Linear(256, 3 * 256, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(2, 256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

        def step():
            q, k, v = proj(x).view(2, 256, 3, 4, 64).unbind(2)
            loss = fat.attention(q, k, v, mask="causal", backend="cudnn").float().square().mean()
            return torch.autograd.grad(loss, (x, proj.weight, proj.bias))

        return step

    assert_replay_matches(setup)


@pytest.mark.parametrize("mask,lens_q,lens_kv", [
    ("padding", [100, 37, 128], [128, 64, 90]),
    ("padding_causal", [100, 37, 128], [128, 64, 90]),
    ("padding_causal_bottom_right", [50, 37, 90], [128, 64, 90]),
])
def test_padding_masks_on_bshd(mask, lens_q, lens_kv):
    q, k, v = make(3, 128, 128, 4, 2, 64, 64, torch.bfloat16, seed=12)
    options = {"mask": mask, "cu_seqlens_q": _lengths(lens_q), "cu_seqlens_kv": _lengths(lens_kv)}
    check_against_reference((q, k, v), options, torch.bfloat16)


@pytest.mark.parametrize("layout", ["thd", "t3hd", "thd_t2hd"])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_thd(layout, mask):
    lens_q = [100, 37, 128, 5]
    lens_kv = lens_q if layout == "t3hd" else [128, 64, 90, 7]
    hkv = 4 if layout == "t3hd" else 2
    tensors = _thd(layout, lens_q, lens_kv, 4, hkv, 64, seed=13)
    options = {"layout": layout, "mask": mask, "cu_seqlens_q": _lengths(lens_q), "cu_seqlens_kv": _lengths(lens_kv)}
    check_against_reference(tensors, options, torch.bfloat16)


def test_thd_with_padded_offsets_and_gaps():
    lens = [60, 17, 128]
    tensors = _thd("thd", lens, lens, 4, 4, 64, seed=14, gaps=8)
    starts = torch.tensor([0, 68, 93, 229], dtype=torch.int32, device="cuda")  # 8-token gaps after each
    options = {"layout": "thd", "mask": "padding_causal", "cu_seqlens_q": _lengths(lens),
               "cu_seqlens_kv": _lengths(lens), "cu_seqlens_q_padded": starts, "cu_seqlens_kv_padded": starts}
    check_against_reference(tensors, options, torch.bfloat16)


def test_thd_with_an_empty_sequence():
    lens_q, lens_kv = [40, 0, 30], [40, 0, 30]
    tensors = _thd("thd", lens_q, lens_kv, 4, 4, 64, seed=15)
    options = {"layout": "thd", "mask": "padding_causal", "cu_seqlens_q": _lengths(lens_q),
               "cu_seqlens_kv": _lengths(lens_kv)}
    check_against_reference(tensors, options, torch.bfloat16)


@pytest.mark.parametrize("shape", [(1, 4, 128, 128), (2, 4, 128, 128)])
def test_pre_scale_bias(shape):
    q, k, v = make(2, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=16)
    bias = torch.randn(shape, device="cuda").to(torch.bfloat16)
    check_against_reference((q, k, v), {"bias": bias, "bias_type": "pre_scale"}, torch.bfloat16)


def test_model_step_under_torch_compile_fullgraph():
    from fusedattn.torch import ops

    torch.manual_seed(0)
    proj = torch.nn.Linear(256, 3 * 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x):
        q, k, v = proj(x).view(2, 128, 3, 4, 64).unbind(2)
        return fat.attention(q, k, v, mask="causal").float().square().mean()

    torch._dynamo.reset()
    eager = step(x)
    eager_grads = torch.autograd.grad(eager, [x, proj.weight])
    compiled = torch.compile(step, fullgraph=True)(x)
    compiled_grads = torch.autograd.grad(compiled, [x, proj.weight])
    assert any(key.startswith("cudnn:") for key in ops._CONFIGS.keys())
    torch.testing.assert_close(compiled, eager, atol=1e-3, rtol=1e-2)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=5e-2)


def test_dropout_matches_the_reference_under_cudnns_own_mask():
    """cuDNN's Philox mask differs from the reference's; read it back and hand it to the naive float64 math."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from naive import naive_attention

    from fusedattn.backends.base import AttentionInputs
    from fusedattn.backends.cudnn.torch_run import dropout_mask

    p = 0.2
    q, k, v = make(2, 128, 128, 4, 2, 64, 64, torch.bfloat16, seed=17)
    cfg = fusedattn.AttentionConfig(dtype="bfloat16", layout="bshd", batch=2, seqlen_q=128, seqlen_kv=128,
                                    heads_q=4, heads_kv=2, head_dim_qk=64, head_dim_v=64, mask="causal",
                                    dropout_p=p, is_training=True, device="cuda")
    seed = torch.tensor(3, dtype=torch.int64, device="cuda")
    offset = torch.tensor(0, dtype=torch.int64, device="cuda")
    dump = dropout_mask(cfg, AttentionInputs(q, k, v, dropout_seed=seed, dropout_offset=offset))
    values = torch.unique(dump)
    keep = dump != 0
    assert values.numel() <= 3, f"rng_dump is not a mask: {values[:8]}"
    assert 0.15 < 1 - keep.float().mean().item() < 0.25
    fused, fused_grads = run("cudnn", (q, k, v), {"mask": "causal", "dropout_p": p, "dropout_seed": 3})
    leaves = [x.double().requires_grad_(True) for x in (q, k, v)]
    exact, _, _ = naive_attention(*leaves, mask="causal", dropout_keep=keep, dropout_p=p)
    gen = torch.Generator(device="cuda").manual_seed(7)
    grad = torch.randn(exact.shape, generator=gen, device="cuda", dtype=torch.float32)
    exact_grads = torch.autograd.grad(exact, leaves, grad.double())
    assert_close_to_exact("out", fused.out, exact.to(torch.bfloat16), exact)
    for i, (g, e) in enumerate(zip(fused_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", g, e.to(torch.bfloat16), e)


@pytest.mark.parametrize("heads,heads_kv,mask", [(8, 8, "causal"), (8, 2, "causal"), (12, 4, "causal"),
                                                 (8, 8, "padding_causal")])
def test_alibi_with_the_papers_slopes(heads, heads_kv, mask):
    q, k, v = make(3, 128, 128, heads, heads_kv, 64, 64, torch.bfloat16, seed=18)
    slopes = torch.tensor(fusedattn.standard_alibi_slopes(heads), device="cuda")
    options = {"mask": mask, "alibi_slopes": slopes}
    if mask == "padding_causal":
        options.update(cu_seqlens_q=_lengths([128, 70, 100]), cu_seqlens_kv=_lengths([128, 70, 100]))
    check_against_reference((q, k, v), options, torch.bfloat16)


def test_alibi_with_other_slopes_falls_back_with_a_reason():
    q, k, v = make(1, 64, 64, 4, 4, 64, 64, torch.bfloat16, seed=19)
    with pytest.raises(fusedattn.NoBackendError, match="paper's slopes"):
        fat.attention(q, k, v, mask="causal", alibi_slopes=torch.ones(4, device="cuda"), backend="cudnn")


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_bottom_right_with_more_queries_than_keys(layout):
    q, k, v = make(2, 160, 96, 4, 2, 64, 64, torch.bfloat16, seed=20)
    tensors, _ = _pack(layout, q, k, v)
    bias = torch.randn(1, 4, 160, 96, device="cuda").to(torch.bfloat16)
    check_against_reference(tensors, {"layout": layout, "mask": "causal_bottom_right", "bias": bias},
                            torch.bfloat16)


def test_non_contiguous_bias_is_read_correctly():
    q, k, v = make(2, 128, 128, 4, 4, 64, 64, torch.bfloat16, seed=21)
    big = torch.randn(2, 4, 160, 160, device="cuda").to(torch.bfloat16)
    bias = big[:, :, 16:144, 8:136]  # a strided view, not a contiguous tensor
    assert not bias.is_contiguous()
    check_against_reference((q, k, v), {"bias": bias}, torch.bfloat16)


def _raw_cases():
    """name -> (tensors, options): calls whose buffers are all on the GPU (no host scalars)."""
    from fusedattn import score_mods as sm

    q, k, v = make(2, 128, 128, 4, 2, 64, 64, torch.bfloat16, seed=40)
    gen = torch.Generator(device="cuda").manual_seed(41)
    lens_q, lens_kv = [100, 37, 128], [128, 64, 90]
    padded = make(3, 128, 128, 4, 2, 64, 64, torch.bfloat16, seed=42)
    return {
        "causal-gqa": ((q, k, v), {"mask": "causal"}),
        "bias-and-sink": ((q, k, v), {"bias": torch.randn(1, 4, 128, 128, generator=gen, device="cuda").to(q.dtype),
                                      "softmax_type": "learnable",
                                      "sink": torch.randn(4, generator=gen, device="cuda")}),
        "dropout": ((q, k, v), {"dropout_p": 0.2, "dropout_seed": 5, "dropout_offset": 3}),
        "padding": (padded, {"mask": "padding_causal", "cu_seqlens_q": _lengths(lens_q),
                             "cu_seqlens_kv": _lengths(lens_kv)}),
        "thd": (_thd("thd", lens_q, lens_kv, 4, 2, 64, seed=43),
                {"layout": "thd", "mask": "padding", "cu_seqlens_q": _lengths(lens_q),
                 "cu_seqlens_kv": _lengths(lens_kv)}),
        "score_mod-aux-tensor": ((q, k, v), {"mask": "causal", "score_mod": sm.relative_position_bias(
            torch.randn(4, 2 * 16 + 1, generator=gen, device="cuda").to(q.dtype))}),
    }


@pytest.mark.parametrize("name", ["causal-gqa", "bias-and-sink", "dropout", "padding", "thd", "score_mod-aux-tensor"])
def test_repeated_calls_launch_from_addresses_with_the_same_bits(name, monkeypatch):
    """After a graph's first public execute, calls binding the same buffers launch from their addresses
    through the native launch core (runtime.execute, core_launch.py): the bits equal the first call's,
    forward and every gradient, and the core-launched call still matches the float64 reference. (Cases
    the torch operator runs take the Python path here: it is the path under test.)"""
    from fusedattn.backends.cudnn import core_launch
    from fusedattn.backends.cudnn.native import torch_plans
    from fusedattn.backends.cudnn.runtime import graph_cache
    from fusedattn.cache import clear_all

    monkeypatch.setenv(torch_plans.ENV_SWITCH, "0")
    clear_all()  # no plan remembered with the operator; every launcher below is this case's
    tensors, options = _raw_cases()[name]
    options = {**options, "deterministic": True}
    first, first_grads = run("cudnn", tensors, options)
    second, second_grads = run("cudnn", tensors, options)
    exact = 2 + len(tensors)  # out, lse and the q/k/v gradients; dBias and dSink are sums cuDNN
    pairs = list(zip(["out", "lse"] + [f"grad {i}" for i in range(len(first_grads))],  # adds in any order
                     [first.out, first.lse, *first_grads], [second.out, second.lse, *second_grads]))
    for label, a, b in pairs[:exact]:
        assert torch.equal(a, b), f"{name}: {label} differs between the public execute and the core's launch"
    for label, a, b in pairs[exact:]:
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=f"{name}: {label}")
    launchers = [launcher for key in graph_cache().keys() for launcher in graph_cache().get(key).launchers.values()]
    assert launchers, f"{name}: no graph ran through runtime.execute"
    assert core_launch.unavailable() is None, core_launch.unavailable()
    assert all(isinstance(launcher, core_launch.CoreLaunch) for launcher in launchers), launchers
    if name != "dropout":  # cuDNN's dropout mask is not the reference's (see the dropout tests)
        check_against_reference(tensors, options, torch.bfloat16)
