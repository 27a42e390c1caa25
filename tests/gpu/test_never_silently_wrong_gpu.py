"""Regression tests for the wrong results of issue 12 ("never silently wrong") on the GPU.

1. THD with a one-token sequence beside longer ones: every gradient within the error rule, and the
   one-token sequence's dq and dk (exactly 0: a softmax over one key has derivative 0) at noise level.
2. A score_mod whose derivative is not 1 and that has no bprop: cuDNN refuses it for training.
3. Trusted GPU offsets that contradict max_seqlen: NaN outputs and gradients, with no host sync.
5. A q/k/v/bias view that starts one element into its storage: cuDNN runs it (an aligned copy),
   explain says so, and the result equals the aligned call's bit for bit.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cudnn")

from gpu_checks import _lengths, _thd, check_against_reference, run  # noqa: E402

import fusedattn  # noqa: E402
import fusedattn.selection  # noqa: E402
import fusedattn.torch as fat  # noqa: E402

pytestmark = pytest.mark.gpu


# ------------------------------------------------------------------ 1: one-token THD sequences

@pytest.mark.parametrize("lengths", [[1, 37, 1000, 5], [1, 37, 5], [37, 1, 1000, 5], [5, 1, 1, 37]],
                         ids=lambda x: "-".join(map(str, x)))
@pytest.mark.parametrize("heads, dim", [((8, 2), 128), ((8, 8), 64)], ids=["gqa-d128", "mha-d64"])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
@pytest.mark.parametrize("trusted", [False, True], ids=["read", "trusted"])
def test_one_token_sequences_beside_longer_ones(lengths, heads, dim, mask, trusted):
    cu = _lengths(lengths)
    tensors = _thd("thd", lengths, lengths, heads[0], heads[1], dim, seed=sum(lengths))
    options = {"layout": "thd", "mask": mask, "cu_seqlens_q": cu, "cu_seqlens_kv": cu}
    if trusted:
        options.update(max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    check_against_reference(tensors, options, torch.bfloat16)
    # The one-token sequences' dq and dk are exactly 0; cuDNN's are fp32 rounding noise
    # (dP and rowsum(dO * O) come from different kernels), far below the bf16 step of the others.
    fused, grads = run("cudnn", tensors, options)
    starts = cu.tolist()
    for name, grad in (("dq", grads[0]), ("dk", grads[1])):
        scale = grad.double().abs().max().item()
        for b, n in enumerate(lengths):
            if n == 1:
                got = grad[starts[b]].double().abs().max().item()
                assert got <= 1e-3 * scale, f"{name} of one-token sequence {b}: {got:.3e} (scale {scale:.3e})"


# ------------------------------------------------------------------ 2: score_mod without bprop

def _half(graph, score, tensors):
    return graph.mul(a=score, b=tensors["half"])


def test_a_score_mod_that_scales_the_score_is_refused_without_bprop(ran):
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 128, 4, 64, generator=gen, device="cuda").bfloat16().requires_grad_(True)
               for _ in range(3))
    with pytest.raises(fusedattn.NoBackendError, match="score_mod without score_mod_bprop: op 'mul'"):
        fat.attention(q, k, v, score_mod=_half, score_mod_tensors={"half": 0.5}, backend="cudnn")
    # Inference needs no derivative: cuDNN runs it.
    with torch.no_grad():
        fat.attention(q, k, v, score_mod=_half, score_mod_tensors={"half": 0.5})
    assert [name for name, _, _ in ran] == ["cudnn"]
    # With its derivative, cuDNN runs training too, and matches the reference.
    options = {"score_mod": _half, "score_mod_tensors": {"half": 0.5},
               "score_mod_bprop": lambda g, d, t: g.mul(a=d, b=t["half"])}
    check_against_reference((q.detach(), k.detach(), v.detach()), options, torch.bfloat16)


# ------------------------------------------------------------------ 3: trusted offsets

@pytest.mark.parametrize("offsets, max_seqlen", [([0, 4, 10], 3), ([0, 6, 4, 10], 6), ([0, 4, 11], 6)],
                         ids=["longer-than-max", "not-monotonic", "past-the-tokens"])
def test_trusted_offsets_that_break_the_rules_give_nan_without_a_sync(offsets, max_seqlen):
    q, k, v = (torch.randn(10, 2, 64, device="cuda").bfloat16().requires_grad_(True) for _ in range(3))
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = fat.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen,
                               max_seqlen_kv=max_seqlen, return_lse=True)
        result.out.float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isnan(result.out).all() and torch.isnan(result.lse).all()
    for x in (q, k, v):
        assert torch.isnan(x.grad).all()


def test_trusted_offsets_that_keep_the_rules_are_exact():
    lengths = [3, 0, 7]
    cu = _lengths(lengths)
    tensors = _thd("thd", lengths, lengths, 4, 2, 64, seed=3)
    check_against_reference(tensors, {"layout": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": 7,
                                      "max_seqlen_kv": 7}, torch.bfloat16)


# ------------------------------------------------------------------ 5: unaligned views

def _shifted(x: torch.Tensor) -> torch.Tensor:
    """x's values in a view that starts one element into its storage (2 bytes off a 16-byte boundary)."""
    buf = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
    view = buf[1:].view(x.shape)
    view.copy_(x)
    return view


def test_views_one_element_into_their_storage_run_on_cudnn(ran):
    gen = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = (torch.randn(2, 256, 4, 64, generator=gen, device="cuda").bfloat16() for _ in range(3))
    bias = torch.randn(1, 4, 256, 256, generator=gen, device="cuda").bfloat16()
    shifted = [_shifted(x) for x in (q, k, v, bias)]
    assert all(x.data_ptr() % 16 for x in shifted)
    aligned_grads, shifted_grads = [], []
    for tensors, grads in (((q, k, v, bias), aligned_grads), (shifted, shifted_grads)):
        leaves = [x.detach().clone().requires_grad_(True) if x.data_ptr() % 16 == 0 else x.requires_grad_(True)
                  for x in tensors]
        out = fat.attention(*leaves[:3], bias=leaves[3], mask="causal")
        out.float().square().sum().backward()
        grads.append(out.detach())
        grads.extend(x.grad for x in leaves)
    assert [name for name, _, _ in ran] == ["cudnn"] * 4
    for got, want in zip(shifted_grads, aligned_grads):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    fusedattn.selection.clear_decisions()  # a fresh call sees the views' addresses when it is configured
    with torch.no_grad():
        fat.attention(*shifted[:3], bias=shifted[3], mask="causal")
    assert ran[-1][2].unaligned == ("q", "k", "v", "bias")
    text = fusedattn.explain(ran[-1][2])
    assert "selected: cudnn" in text and "note: copies q, k, v, bias to 16-byte aligned memory" in text


def test_a_bias_of_another_dtype_is_refused():
    q = torch.randn(1, 64, 2, 64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="bias: expected dtype bfloat16 like q, got dtype float32"):
        fat.attention(q, q, q, bias=torch.zeros(1, 2, 64, 64, device="cuda"))


# ------------------------------------------- 6: a callback reading an attribute of an object it captures

class _Capped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cap = 30.0
        self.window = 64

    def forward(self, q, k, v, backend):
        # callbacks made anew at each call, over `self`, as a model's forward writes them
        def score_mod(s, b, h, q_idx, kv_idx):
            return self.cap * fusedattn.score_mods.tanh(s / self.cap)

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= self.window)

        return fat.attention(q, k, v, backend=backend, return_lse=True, score_mod=score_mod, mask_mod=mask_mod)


def test_a_warm_call_follows_the_attributes_its_callbacks_read():
    """The native warm path kept a binding (its scalars) and a mask rewrite (its window) while the callbacks
    read the same objects: after `layer.cap = 2.0` or `layer.window = 8` a closure over `self` gave the old
    modification. Each value is checked against the reference (the error rule, float64 as the exact)."""
    from gpu_checks import assert_close_to_exact, make

    layer = _Capped()
    q, k, v = make(2, 256, 256, 4, 4, 64, 64, torch.bfloat16, seed=61)
    for cap, window in ((30.0, 64), (30.0, 64), (2.0, 64), (2.0, 8), (30.0, 8)):
        layer.cap, layer.window = cap, window
        fused = layer(q, k, v, "cudnn")
        same = layer(q, k, v, "reference")
        exact = layer(*(x.double() for x in (q, k, v)), "reference")
        assert_close_to_exact(f"out, cap {cap} window {window}", fused.out, same.out, exact.out)
        torch.testing.assert_close(fused.lse, exact.lse.float(), atol=2e-2, rtol=2e-3)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_a_nan_sink_gives_nan_in_its_head_on_cudnn(mask):
    """The reference gave a finite, unnormalized answer for a NaN sink logit (sweep 9): cuDNN must give NaN
    in that head's output and LSE too, and the other heads the finite call's values."""
    gen = torch.Generator(device="cuda").manual_seed(12)
    q, k, v = (torch.randn(2, 64, 4, 64, generator=gen, device="cuda").bfloat16() for _ in range(3))
    sink = torch.tensor([float("nan"), 0.5, -0.5, 1.0], device="cuda")
    got = fat.attention(q, k, v, mask=mask, softmax_type="learnable", sink=sink, return_lse=True, backend="cudnn")
    finite = fat.attention(q, k, v, mask=mask, softmax_type="learnable", sink=sink.nan_to_num(0.25),
                           return_lse=True, backend="cudnn")
    assert got.out[:, :, 0].isnan().all() and got.lse[:, 0].isnan().all()
    assert torch.equal(got.out[:, :, 1:], finite.out[:, :, 1:]) and torch.equal(got.lse[:, 1:], finite.lse[:, 1:])
