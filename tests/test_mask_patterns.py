"""Recognising boolean masks that are native masks (fusedattn/mask_patterns.py), and the SDPA drop-in
running them as such: exact (a recognised pattern reproduces every entry of the mask), and the same
results as the mask run as a bias and as PyTorch's SDPA."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fusedattn.mask_patterns import Pattern, classify

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import fusedattn.torch as fat  # noqa: E402
from fusedattn.torch import dropin  # noqa: E402


def visible(pattern: Pattern, batch: int, seqlen_q: int, seqlen_kv: int) -> np.ndarray:
    """(batch, Sq, Skv) booleans of a pattern, written out from attention's documented masks."""
    i = np.arange(seqlen_q)[None, :, None]
    j = np.arange(seqlen_kv)[None, None, :]
    lengths = np.array(pattern.kv_lengths if pattern.kv_lengths else [seqlen_kv] * batch)[:, None, None]
    shift = seqlen_kv - seqlen_q if pattern.mask == "causal_bottom_right" else 0
    keep = np.broadcast_to(j < lengths, (batch, seqlen_q, seqlen_kv)).copy()
    if pattern.mask in ("causal", "causal_bottom_right", "padding_causal"):
        keep &= j <= i + shift
    if pattern.window is not None:
        left, right = pattern.window
        if left >= 0:
            keep &= j >= i + shift - left
        if right >= 0:
            keep &= j <= i + shift + right
    return keep


def stats(mask: np.ndarray):
    """What the frontend reads of a (Bm, Lm, S) boolean mask: keys taken, first taken, runs per row."""
    count = mask.sum(-1)
    first = mask.argmax(-1)
    runs = (mask[..., 1:] & ~mask[..., :-1]).sum(-1) + mask[..., 0]
    return count, first, runs


def check(mask: np.ndarray, batch: int, seqlen_q: int) -> Pattern | None:
    """classify, and if it recognises the mask, that the pattern reproduces it exactly."""
    seqlen_kv = mask.shape[-1]
    pattern = classify(*stats(mask), seqlen_q, seqlen_kv, batch)
    if pattern is not None:
        expected = np.broadcast_to(mask, (batch, seqlen_q, seqlen_kv))
        assert (visible(pattern, batch, seqlen_q, seqlen_kv) == expected).all(), pattern
    return pattern


@st.composite
def family_masks(draw):
    """A mask of one of the native families, with its parameters drawn."""
    batch, seqlen_q, seqlen_kv = draw(st.integers(1, 4)), draw(st.integers(1, 12)), draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["causal", "causal_bottom_right", "padding", "padding_causal", "window"]))
    if kind == "window":
        seqlen_kv = seqlen_q
    lengths = None
    if kind.startswith("padding"):
        lengths = tuple(draw(st.lists(st.integers(0, seqlen_kv), min_size=batch, max_size=batch)))
    window = None
    if kind in ("causal", "causal_bottom_right", "padding_causal") and draw(st.booleans()):
        window = (draw(st.integers(0, 12)), 0)
    if kind == "window":
        window = (draw(st.integers(-1, 12)), draw(st.integers(-1, 12)))
        kind = "none"
    pattern = Pattern(kind, window, lengths)
    return visible(pattern, batch, seqlen_q, seqlen_kv), batch, seqlen_q


@settings(max_examples=400, deadline=None)
@given(family_masks())
def test_every_native_family_is_recognised_exactly(case):
    mask, batch, seqlen_q = case
    assert check(mask, batch, seqlen_q) is not None


@settings(max_examples=400, deadline=None)
@given(st.integers(1, 3), st.integers(1, 9), st.integers(1, 9), st.floats(0.0, 1.0), st.integers(0, 2**31))
def test_a_recognised_random_mask_is_reproduced_exactly(batch, seqlen_q, seqlen_kv, density, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random((batch, seqlen_q, seqlen_kv)) < density
    check(mask, batch, seqlen_q)  # asserts when recognised; most are not


def test_masks_that_broadcast_over_batch_or_queries():
    lengths = np.array([5, 0, 2])
    key_padding = (np.arange(6)[None, None, :] < lengths[:, None, None])  # (B, 1, S)
    assert check(key_padding, 3, 4) == Pattern("padding", kv_lengths=(5, 0, 2))
    assert check(np.ones((1, 1, 6), bool), 3, 4) == Pattern("none")
    causal = np.tril(np.ones((4, 6), bool))[None]  # (1, L, S), shared by the batch
    assert check(causal, 3, 4) == Pattern("causal")
    assert check(np.tril(np.ones((4, 6), bool), 2)[None], 3, 4) == Pattern("causal_bottom_right")
    assert check(np.zeros((1, 4, 6), bool), 3, 4) == Pattern("padding", kv_lengths=(0, 0, 0))
    gap = np.ones((1, 1, 6), bool)
    gap[..., 2] = False
    assert check(gap, 3, 4) is None
    suffix = np.arange(6)[None, None, :] >= 2  # keys taken from 2 on: no native mask
    assert check(suffix, 3, 4) is None


# --- the SDPA drop-in ------------------------------------------------------------------------------------

B, H, L, S, D = 3, 4, 7, 9, 8
LENGTHS = torch.tensor([9, 4, 0])
KEY_PADDING = torch.arange(S)[None, None, None, :] < LENGTHS[:, None, None, None]
CAUSAL = torch.ones(L, S, dtype=torch.bool).tril()
MASKS = {
    "padding": (KEY_PADDING, "padding"),
    "causal": (CAUSAL, "causal"),
    "causal_bottom_right": (torch.ones(L, S, dtype=torch.bool).tril(S - L), "causal_bottom_right"),
    "padding_causal": (CAUSAL[None, None] & KEY_PADDING, "padding_causal"),
    "causal_window": (CAUSAL & ~torch.ones(L, S, dtype=torch.bool).tril(-3), "causal"),
    "padding_expanded": (KEY_PADDING.expand(B, 1, L, S), "padding"),
    "float_causal": (torch.zeros(L, S, dtype=torch.float64).masked_fill(~CAUSAL, float("-inf")), "causal"),
    "random": (torch.rand(B, 1, L, S, generator=torch.Generator().manual_seed(3)) > 0.3, None),
    "float_values": (torch.randn(B, 1, L, S, dtype=torch.float64), None),
    "per_head": (torch.ones(B, H, L, S, dtype=torch.bool).tril(), None),
}


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, L, D), (B, H, S, D), (B, H, S, D))
    return [torch.randn(*s, dtype=torch.float64, generator=gen).requires_grad_() for s in shapes]


def _recognised_as(mask) -> str | None:
    folded = dropin._folded(mask, torch.empty(0, dtype=torch.float64), (B,), (H, L, S))
    options = dropin._recognized(mask, folded, B, L, S, torch.device("cpu"))
    return None if options is None else options["mask"]


@pytest.fixture(autouse=True)
def _fresh_patterns():
    dropin._patterns.clear()
    yield
    dropin._patterns.clear()


@pytest.mark.parametrize("name", list(MASKS))
def test_the_dropin_runs_a_mask_as_its_native_mask_with_sdpas_results(name):
    mask, kind = MASKS[name]
    assert _recognised_as(mask) == kind
    q, k, v = _inputs()
    grad = torch.randn(B, H, L, D, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    q2, k2, v2 = _inputs()
    expected = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
    rows = ~expected.isnan()  # PyTorch's math gives NaN for a row that takes no key; ours gives 0
    torch.testing.assert_close(out, torch.where(rows, expected, 0.0))
    theirs = torch.autograd.grad(torch.where(rows, expected, 0.0), (q2, k2, v2), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, torch.nan_to_num(b))


def test_a_mask_is_read_once_per_tensor_and_again_after_an_inplace_change(monkeypatch):
    reads = []
    original = dropin._read_pattern
    monkeypatch.setattr(dropin, "_read_pattern", lambda *a: reads.append(1) or original(*a))
    mask = CAUSAL.clone()
    q, k, v = _inputs()
    for _ in range(3):
        fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(reads) == 1
    mask[0, 2] = True  # now no longer causal: the version changed, so it is read again
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(reads) == 2 and _recognised_as(mask) is None
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_a_mask_that_learns_stays_a_bias_with_its_gradient():
    bias = torch.randn(1, 1, L, S, dtype=torch.float64).requires_grad_()
    q, k, v = _inputs()
    assert _recognised_as(bias) is None
    out = fat.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    (grad,) = torch.autograd.grad(out.sum(), bias)
    bias2 = bias.detach().clone().requires_grad_()
    (expected,) = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, attn_mask=bias2).sum(), bias2)
    torch.testing.assert_close(grad, expected)


def test_no_mask_is_read_while_compiling(monkeypatch):
    monkeypatch.setattr(dropin, "_read_pattern", lambda *a: pytest.fail("read while compiling"))
    q, k, v = (x.detach() for x in _inputs())
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: fat.scaled_dot_product_attention(q, k, v, attn_mask=CAUSAL),
                             backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=CAUSAL))
