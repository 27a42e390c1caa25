"""fusedattn.torch.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention
itself, on the same inputs (CPU: the reference backend): outputs and gradients in float64 and bfloat16,
GQA, boolean and float masks of every broadcast shape, causal with L != S, scale, fully masked rows,
the 2-D/3-D/5-D forms, and the errors SDPA raises."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import fusedattn.torch as fat

F64, BF16 = torch.float64, torch.bfloat16


def _inputs(shape_q, shape_k, dv, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64).to(dtype).requires_grad_(True)  # noqa: E731
    return make(*shape_q), make(*shape_k), make(*shape_k[:-1], dv)


def _both(q, k, v, theirs: dict | None = None, **options):
    """(ours, SDPA's): outputs and the gradients of q, k, v (and a float mask) for one random cotangent.
    theirs: SDPA's options where they differ from ours."""
    results = []
    for fn, given in ((fat.scaled_dot_product_attention, options), (F.scaled_dot_product_attention, theirs or options)):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        mask = given.get("attn_mask")
        extra = {}
        if mask is not None and mask.is_floating_point():
            extra["attn_mask"] = mask.detach().clone().requires_grad_(True)
        out = fn(*leaves, **{**given, **extra})
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=F64).to(out.dtype)
        wrt = leaves + ([extra["attn_mask"]] if extra else [])
        grads = torch.autograd.grad(out, wrt, grad)
        results.append((out, grads))
    return results


def _close(ours, theirs, dtype):
    tol = dict(atol=1e-10, rtol=1e-10) if dtype == F64 else dict(atol=3e-2, rtol=3e-2)
    (out, grads), (want_out, want_grads) = ours, theirs
    torch.testing.assert_close(out, want_out, **tol)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want.reshape(got.shape) if got.shape != want.shape else want, **tol)


SHAPES = [  # (q shape, k shape, dv, enable_gqa)
    ((2, 4, 7, 16), (2, 4, 9, 16), 16, False),
    ((2, 4, 9, 16), (2, 4, 7, 16), 8, False),
    ((1, 8, 5, 32), (1, 2, 5, 32), 32, True),
    ((2, 4, 6, 16), (2, 1, 6, 16), 16, False),  # one key/value head broadcasts, as in PyTorch
    ((3, 6, 16), (3, 8, 16), 16, False),  # (N, L, E): one head
    ((6, 16), (8, 16), 16, False),  # (L, E)
    ((2, 3, 2, 5, 16), (2, 3, 2, 4, 16), 16, False),  # two batch dimensions
    ((4, 5, 8), (2, 6, 8), 8, True),  # (H, L, E) with grouped heads (sweep 13: refused as batches)
    ((2, 1, 5, 8), (2, 2, 6, 8), 8, False),  # one query head meets two key heads (sweep 13: refused)
    ((2, 5, 8), (3, 2, 6, 8), 8, False),  # a 3-D query beside 4-D keys: its first dimension is heads
    ((2, 4, 5, 0), (2, 4, 6, 0), 8, False),  # E=0: every key weighs alike (sweep 13: refused)
    ((2, 4, 5, 8), (2, 4, 6, 8), 0, False),  # Ev=0: an empty output
]


@pytest.mark.parametrize("dtype", [F64, BF16], ids=["f64", "bf16"])
@pytest.mark.parametrize("shape_q, shape_k, dv, gqa", SHAPES, ids=[str(s[0]) for s in SHAPES])
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_sdpa_without_a_mask(dtype, shape_q, shape_k, dv, gqa, is_causal):
    q, k, v = _inputs(shape_q, shape_k, dv, dtype, seed=len(shape_q) + dv)
    _close(*_both(q, k, v, is_causal=is_causal, enable_gqa=gqa), dtype)


def _mask_shapes(b, h, lq, s):
    """Every broadcast shape of a (B, H, L, S) mask, and (L, S)."""
    for keep in itertools.product((True, False), repeat=4):
        yield tuple(n if k else 1 for n, k in zip((b, h, lq, s), keep))
    yield (lq, s)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("dtype", [F64, BF16], ids=["f64", "bf16"])
def test_matches_sdpa_with_masks_of_every_broadcast_shape(kind, dtype):
    q, k, v = _inputs((2, 3, 5, 16), (2, 3, 7, 16), 16, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    for shape in _mask_shapes(2, 3, 5, 7):
        if kind == "bool":
            mask = torch.rand(shape, generator=gen) > 0.3
        else:
            mask = torch.randn(shape, generator=gen, dtype=F64).to(dtype)
        _close(*_both(q, k, v, attn_mask=mask), dtype)


def test_fully_masked_rows_give_zero_like_sdpa():
    q, k, v = _inputs((1, 2, 4, 8), (1, 2, 6, 8), 8, F64, seed=5)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[2] = False
    ours, theirs = _both(q, k, v, attn_mask=mask)
    assert torch.equal(ours[0][:, :, 2], torch.zeros_like(ours[0][:, :, 2]))
    _close(ours, theirs, F64)


def test_scale_and_dropout_free_defaults():
    q, k, v = _inputs((2, 2, 5, 16), (2, 2, 5, 16), 16, F64, seed=6)
    _close(*_both(q, k, v, scale=0.37), F64)


def test_dropout_runs_and_is_reproducible_from_torchs_generator():
    q, k, v = _inputs((1, 2, 8, 16), (1, 2, 8, 16), 16, torch.float32, seed=7)
    torch.manual_seed(11)
    a = fat.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(11)
    b = fat.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.allclose(a, fat.scaled_dot_product_attention(q, k, v))


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k[:, :3], v[:, :3]), "expected 4 heads like query"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k[:, :2], v[:, :2]), "pass enable_gqa=True"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k[:, :3], v[:, :3], enable_gqa=True),
     "expected 4 heads like query or a divisor of it"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(5, 5, dtype=F64)),
     "attn_mask: expected a bool tensor, a float32 one or one of query's dtype"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool)),
     "attn_mask: expected a shape broadcastable"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=torch.ones(2, 1, 1, 5,
                                                                                                dtype=torch.bool)),
     r"attn_mask: expected a shape broadcastable to the scores' \(1, 4, 5, 5\), got \(2, 1, 1, 5\)"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=torch.zeros(2, 1, 5, 5)),
     r"attn_mask: expected a shape broadcastable to the scores' \(1, 4, 5, 5\), got \(2, 1, 5, 5\)"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q[0, 0, 0], k, v), "query: expected at least 2 dimensions"),
    (lambda q, k, v: fat.scaled_dot_product_attention(q, k[..., :8], v), "head dim"),
])
def test_refuses_what_sdpa_refuses_naming_the_argument(call, match):
    q, k, v = _inputs((2, 4, 5, 16), (2, 4, 5, 16), 16, torch.float32, seed=8)
    with pytest.raises(ValueError, match=match):
        call(q, k, v)
    with pytest.raises((RuntimeError, ValueError)):  # SDPA refuses the same call
        _sdpa_twin(call)(q, k, v)


def _sdpa_twin(call):
    """The same lambda with fusedattn's function swapped for PyTorch's."""
    import types

    globals_ = dict(call.__globals__)
    globals_["fat"] = types.SimpleNamespace(scaled_dot_product_attention=F.scaled_dot_product_attention)
    return types.FunctionType(call.__code__, globals_)


def test_it_can_replace_torchs_function_in_a_model(monkeypatch):
    monkeypatch.setattr(F, "scaled_dot_product_attention", fat.scaled_dot_product_attention)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    x = torch.randn(2, 6, 32)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        loss = layer(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_a_float32_mask_with_half_inputs_and_autocast_follow_pytorch():
    q, k, v = (torch.randn(2, 3, 6, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.zeros(2, 1, 1, 6).masked_fill(torch.arange(6) >= 4, float("-inf"))  # float32, as nn.MHA makes
    half = [x.bfloat16() for x in (q, k, v)]
    torch.testing.assert_close(fat.scaled_dot_product_attention(*half, attn_mask=mask),
                               F.scaled_dot_product_attention(*half, attn_mask=mask), atol=2e-2, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=0)


def test_a_zero_or_negative_scale_raises():  # PyTorch's CPU math gives NaN rows for them under is_causal
    q = torch.randn(1, 2, 5, 8, dtype=F64)
    for scale in (0.0, -0.5):
        with pytest.raises(ValueError, match="scale: expected a finite float > 0"):
            fat.scaled_dot_product_attention(q, q, q, scale=scale)


@pytest.mark.parametrize("q_shape, kv_shape, gqa", [
    ((0, 2, 4, 8), (0, 2, 5, 8), False), ((2, 0, 4, 8), (2, 0, 5, 8), False), ((2, 2, 0, 8), (2, 2, 5, 8), False),
    ((0, 4, 3, 8), (0, 2, 5, 8), True), ((3, 0, 8), (3, 5, 8), False)])
def test_empty_batches_heads_and_queries_answer_as_sdpa(q_shape, kv_shape, gqa):
    """An empty batch, no heads or no queries raised ("batch: expected an integer >= 1"); SDPA answers an empty
    output, and empty gradients."""
    q, k = torch.randn(q_shape, requires_grad=True), torch.randn(kv_shape, requires_grad=True)
    v = torch.randn((*kv_shape[:-1], 6), requires_grad=True)
    got = fat.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
    assert got.shape == F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa).shape
    got.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("name, value", [("is_causal", "False"), ("is_causal", 1), ("enable_gqa", "no"),
                                         ("enable_gqa", None)])
def test_flags_that_are_not_bools_are_refused(name, value):
    """is_causal="False" ran a causal mask (a non-empty string is true); PyTorch raises a TypeError."""
    q, k, v = _inputs((2, 4, 5, 16), (2, 2, 5, 16), 16, F64, seed=9)
    with pytest.raises(ValueError, match=f"{name}: expected a bool, got {value!r}"):
        fat.scaled_dot_product_attention(q, k, v, **{name: value})
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, k, v, **{name: value})


@pytest.mark.parametrize("lq, lk", [(4, 6), (6, 4), (5, 5)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_is_causal_beside_a_mask_applies_both_as_sdpa_computes_them(lq, lk, kind):
    """It was refused ("PyTorch raises here too"). PyTorch 2.13 runs the mask and the top-left causal mask
    together in its CPU kernel (no gradient, some mask shapes) and raises in its math kernel: both apply
    here, gradients too, as SDPA with the two folded into one mask gives them."""
    gen = torch.Generator().manual_seed(lq * 10 + lk)
    q, k, v = _inputs((2, 3, lq, 16), (2, 3, lk, 16), 8, F64, seed=lq + lk)
    mask = (torch.rand(3, lq, lk, generator=gen) > 0.4 if kind == "bool"
            else torch.randn(2, 1, lq, lk, generator=gen, dtype=F64))
    future = ~torch.ones(lq, lk, dtype=torch.bool).tril()
    folded = mask & ~future if kind == "bool" else mask.masked_fill(future, float("-inf"))
    ours, theirs = _both(q, k, v, {"attn_mask": folded}, attn_mask=mask, is_causal=True)
    _close(ours, theirs, F64)


@pytest.mark.parametrize("q_len, k_len", [(0, 5), (3, 0)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_an_empty_query_or_key_length_beside_a_mask_answers_as_sdpa(q_len, k_len, kind):
    """The mask's pattern was read with no rows or no keys: an IndexError from inside the library."""
    q, k, v = _inputs((2, 4, q_len, 8), (2, 4, k_len, 8), 8, F64, seed=11)
    mask = torch.ones(q_len, k_len, dtype=torch.bool) if kind == "bool" else torch.zeros(q_len, k_len, dtype=F64)
    got = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


def test_numbers_given_as_numpy_or_0d_tensors_run_as_sdpa_takes_them():
    """PyTorch takes scale=torch.tensor(0.3) and dropout_p=np.float32(...); ours refused both (the second
    with 'expected a float in [0, 1), got np.float32(0.1)')."""
    import numpy as np

    q, k, v = (torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(fat.scaled_dot_product_attention(q, k, v, scale=torch.tensor(0.3)), want)
    torch.testing.assert_close(fat.scaled_dot_product_attention(q, k, v, scale=np.float32(0.3)), want)
    torch.manual_seed(4)
    a = fat.scaled_dot_product_attention(q, k, v, dropout_p=np.float32(0.25))
    torch.manual_seed(4)
    b = fat.scaled_dot_product_attention(q, k, v, dropout_p=0.25)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_dropout_of_one_drops_every_weight_as_sdpa():
    leaves = [torch.randn(2, 3, 5, 8, requires_grad=True) for _ in range(3)]
    out = fat.scaled_dot_product_attention(*leaves, dropout_p=1.0)
    assert out.shape == (2, 3, 5, 8) and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(out, F.scaled_dot_product_attention(*leaves, dropout_p=1.0))
    out.sum().backward()
    assert all(torch.equal(x.grad, torch.zeros_like(x)) for x in leaves)
