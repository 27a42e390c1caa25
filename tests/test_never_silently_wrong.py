"""Regression tests for the wrong results of issue 12 ("never silently wrong"), the CPU parts.

Each case once returned plausible wrong numbers (or crashed with an internal message); each test
shows the call now either gives the right answer, NaN where the values could not be checked, a
refusal with the reason, or a ValueError naming the argument.
"""

from __future__ import annotations

import types
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from naive import naive_attention

import fusedattn
import fusedattn.jax as fja
import fusedattn.torch as fat
from fusedattn import score_mods
from fusedattn.backends import get_backend
from fusedattn.backends.cudnn.spec import unsupported
from fusedattn.config import AttentionConfig
from fusedattn.layout import check_cu_seqlens, check_segment_ids, offsets_violated, segment_ids_violated
from fusedattn.score_mods.core import as_score_mod, bind

# ------------------------------------------------------------------ case 2: score_mod derivative


def _recipe(mod):
    mod = as_score_mod("test", mod, framework="torch", device="cpu")  # (a built-in: traced)
    return bind("test", mod, batch=1, heads_q=2, seqlen_q=4, seqlen_kv=4, device="cpu", training=True,
                like=torch.empty(1)).recipe


def _half(graph, score, tensors):
    return graph.mul(a=score, b=tensors["half"])


@pytest.mark.parametrize("callback, aux, op", [
    (_half, {"half": 0.5}, "mul"),
    (lambda g, s, t: g.tanh(input=s), {}, "tanh"),
    (lambda g, s, t: g.sub(a=t["x"], b=s), {"x": 1.0}, "sub"),
    (lambda g, s, t: g.add(a=s, b=s), {}, "add"),
    (lambda g, s, t: g.binary_select(input0=s, input1=t["zero"], mask=g.cmp_gt(input=s, comparison=t["zero"])),
     {"zero": 0.0}, "binary_select"),
    (lambda g, s, t: g.binary_select(input0=s, input1=t["zero"], mask=t["keep"]),
     {"zero": 0.0, "keep": torch.ones(1, 1, 4, 4, dtype=torch.bool)}, "binary_select"),
])
def test_a_score_mod_whose_derivative_is_not_one_needs_a_bprop_on_cudnn(callback, aux, op):
    mod = as_score_mod("test", callback, None, aux)
    recipe = _recipe(mod)
    assert recipe.derivative_issue is not None and f"'{op}'" in recipe.derivative_issue
    cfg = _cfg(score_mod_key=("k",), score_mod_recipe=recipe, is_training=True)
    reasons = unsupported(cfg)
    assert any("score_mod_bprop" in r and f"'{op}'" in r for r in reasons), reasons
    # Inference has no derivative: nothing to refuse.
    assert not any("score_mod_bprop" in r for r in unsupported(cfg.replace(is_training=False)))
    # With its bprop the same callback is trusted.
    with_bprop = as_score_mod("test", callback, lambda g, d, t: d, aux)
    assert _recipe(with_bprop).derivative_issue is None


@pytest.mark.parametrize("mod", [
    score_mods.causal(), score_mods.sliding_window(3, 1), score_mods.alibi(torch.tensor([0.5, 0.25])),
    score_mods.relative_position_bias(torch.randn(2, 7)), score_mods.document_mask(torch.tensor([[0, 0, 1, 1]])),
    score_mods.additive_bias(torch.randn(1, 2, 4, 4)),
    score_mods.compose(score_mods.causal(), score_mods.alibi(torch.tensor([0.5, 0.25]))),
    as_score_mod("test", lambda g, s, t: g.add(a=s, b=t["x"]), None, {"x": 0.5}),
], ids=lambda m: getattr(m, "name", "callback"))
def test_added_terms_and_masks_keep_derivative_one(mod):
    assert _recipe(mod).derivative_issue is None


def test_the_reference_differentiates_a_score_mod_without_bprop():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = fat.attention(q, k, v, score_mod=_half, score_mod_tensors={"half": 0.5}, backend="reference")
    grad = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    want_out, _, _ = naive_attention(*leaves, score_mod=lambda s, b, h, i, j: s * 0.5)
    want = torch.autograd.grad(want_out, leaves, grad)
    torch.testing.assert_close(out, want_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


# ------------------------------------------------------------------ case 3: offsets not read


def _cfg(**changes):
    base = dict(dtype="bfloat16", layout="bshd", batch=1, seqlen_q=4, seqlen_kv=4, heads_q=2, heads_kv=2,
                head_dim_qk=64, head_dim_v=64, device="cuda")
    return AttentionConfig(**{**base, **changes})


def _random_offsets(rng):
    """Offsets that are right about half the time: lengths, gaps, a drop, a first offset not 0."""
    lengths = rng.integers(0, 7, size=rng.integers(1, 5))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    kind = rng.integers(0, 5)
    if kind == 1 and len(cu) > 2:
        cu[1], cu[2] = cu[2], cu[1]  # not monotonic
    elif kind == 2:
        cu = cu + 1  # does not start at 0
    return cu.astype(np.int32), int(rng.integers(0, 8)), int(rng.integers(0, 30))


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_device_check_of_offsets_agrees_with_the_host_check(framework):
    rng = np.random.default_rng(3)
    to_array = (lambda a: torch.as_tensor(a)) if framework == "torch" else jnp.asarray
    for _ in range(300):
        cu, limit, total = _random_offsets(rng)
        try:
            longest = check_cu_seqlens("cu", cu, total)
            host_bad = longest > limit
        except ValueError:
            host_bad = True
        assert bool(offsets_violated(to_array(cu), limit, total)) == host_bad, (cu, limit, total)
        room = np.diff(cu.astype(np.int64)).clip(0) + rng.integers(0, 3, len(cu) - 1)
        padded = np.concatenate([[0], np.cumsum(room)]).astype(np.int32)
        try:
            host_bad = check_cu_seqlens("cu", cu, total, padded, "padded") > limit
        except ValueError:
            host_bad = True
        assert bool(offsets_violated(to_array(cu), limit, total, to_array(padded))) == host_bad, (cu, padded)


def _thd_jit(max_seqlen):
    return jax.jit(lambda q, cu: fja.attention(q, q, q, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                               max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, return_lse=True))


@pytest.mark.parametrize("cu, max_seqlen", [([0, 4, 10], 3), ([0, 6, 4, 10], 6), ([1, 4, 10], 6), ([0, 4, 11], 6)],
                         ids=["longer-than-max", "not-monotonic", "not-from-zero", "past-the-tokens"])
def test_traced_offsets_that_break_the_rules_give_nan_in_jax(cu, max_seqlen):
    q = jax.random.normal(jax.random.key(0), (10, 2, 16))
    result = _thd_jit(max_seqlen)(q, jnp.asarray(cu, jnp.int32))
    assert np.isnan(np.asarray(result.out)).all()
    grad = jax.grad(lambda q: _thd_jit(max_seqlen)(q, jnp.asarray(cu, jnp.int32)).out.sum())(q)
    assert np.isnan(np.asarray(grad)).all()


def test_traced_offsets_that_keep_the_rules_give_the_exact_answer_in_jax():
    q = jax.random.normal(jax.random.key(1), (10, 2, 16), dtype=jnp.float32)
    cu = jnp.asarray([0, 6, 6, 10], jnp.int32)
    got = _thd_jit(6)(q, cu).out
    q64 = torch.as_tensor(np.asarray(q), dtype=torch.float64)
    want, _, _ = naive_attention(q64, q64, q64, layout="thd", cu_seqlens_q=[0, 6, 6, 10], cu_seqlens_kv=[0, 6, 6, 10])
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-5, atol=1e-5)


def _padded_call(q, k, v, bias, sink, cu):
    return fja.attention(q, k, v, mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu, bias=bias,
                         softmax_type="learnable", sink=sink, return_lse=True)


def _padded_operands():
    keys = jax.random.split(jax.random.key(5), 5)
    q, k, v = (jax.random.normal(key, (2, 6, 2, 8)) for key in keys[:3])
    return q, k, v, jax.random.normal(keys[3], (1, 2, 6, 6)), jax.random.normal(keys[4], (2,))


def _padded_loss(q, k, v, bias, sink, cu):
    result = _padded_call(q, k, v, bias, sink, cu)
    return jnp.nansum(result.out * result.out) + jnp.sum(jnp.where(jnp.isfinite(result.lse), result.lse, 0.0))


@pytest.mark.parametrize("cu", [[0, 7, 9], [0, 5, 3], [2, 4, 6]], ids=["too-long", "negative", "not-from-zero"])
def test_broken_traced_offsets_give_nan_in_every_jax_output_and_gradient(cu):
    # The outputs are NaN by value; every differentiable input's gradient is NaN (offset_guard.py).
    operands, cu = _padded_operands(), jnp.asarray(cu, jnp.int32)
    result = jax.jit(_padded_call)(*operands, cu)
    assert np.isnan(np.asarray(result.out)).all() and np.isnan(np.asarray(result.lse)).all()
    grads = jax.jit(jax.grad(lambda *xs: _padded_call(*xs).out.sum(), argnums=(0, 1, 2, 3, 4)))(*operands, cu)
    for name, grad in zip("q k v bias sink".split(), grads):
        assert np.isnan(np.asarray(grad)).all(), name


def test_good_traced_offsets_give_the_same_values_and_gradients_as_concrete_ones():
    operands, cu = _padded_operands(), jnp.asarray([0, 4, 10], jnp.int32)
    concrete = jax.value_and_grad(_padded_loss, argnums=(0, 1, 2, 3, 4))(*operands, cu)
    traced = jax.jit(jax.value_and_grad(_padded_loss, argnums=(0, 1, 2, 3, 4)))(*operands, cu)
    for got, want in zip(jax.tree.leaves(traced), jax.tree.leaves(concrete)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_a_broken_item_under_vmap_leaves_the_other_items_alone():
    q, k, v, bias, sink = _padded_operands()
    cus = jnp.asarray([[0, 4, 10], [0, 7, 9]], jnp.int32)
    stacked = [jnp.stack([x, x * 0.5]) for x in (q, k, v)]
    step = jax.jit(jax.vmap(lambda q, k, v, cu: _padded_call(q, k, v, bias, sink, cu).out))
    out = np.asarray(step(*stacked, cus))
    assert np.isnan(out[1]).all()
    want = _padded_call(q, k, v, bias, sink, cus[0]).out
    np.testing.assert_allclose(out[0], np.asarray(want), rtol=1e-6, atol=1e-6)


def test_offsets_under_torch_compile_are_checked_on_the_device():
    # Compiled calls never read their offsets (trusted, as GPU offsets with both max lengths are).
    q = torch.randn(10, 2, 16, requires_grad=True)
    step = torch.compile(lambda q, cu: fat.attention(q, q, q, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=3, max_seqlen_kv=3), backend="aot_eager",
                         fullgraph=True)
    out = step(q, torch.tensor([0, 4, 10], dtype=torch.int32))
    assert torch.isnan(out).all()
    out.sum().backward()
    assert torch.isnan(q.grad).all()
    ok = step(q.detach(), torch.tensor([0, 3, 6], dtype=torch.int32))
    assert torch.isfinite(ok).all()


# ------------------------------------------------------------------ case 4: unsorted segment ids


def test_unsorted_segment_ids_raise_when_their_values_are_at_hand():
    q = jnp.ones((10, 2, 16))
    ids = jnp.asarray([1, 1, 1, 1, 0, 0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="segment_ids_q: expected non-decreasing ids.*got 1 then 0 at tokens 3 and 4"):
        fja.attention(q, q, q, layout="thd", segment_ids_q=ids, segment_ids_kv=ids, num_sequences=2)
    with pytest.raises(ValueError, match="expected ids >= 0"):
        check_segment_ids("ids", np.asarray([-1, 0, 0]))


def test_unsorted_segment_ids_give_nan_under_jit():
    q = jax.random.normal(jax.random.key(2), (10, 2, 16))
    call = jax.jit(lambda q, ids: fja.attention(q, q, q, layout="thd", segment_ids_q=ids, segment_ids_kv=ids,
                                                num_sequences=2, max_seqlen_q=10, max_seqlen_kv=10))
    assert np.isnan(np.asarray(call(q, jnp.asarray([1, 1, 1, 1, 0, 0, 0, 0, 0, 0])))).all()
    assert np.isfinite(np.asarray(call(q, jnp.asarray([0, 0, 0, 0, 1, 1, 1, 1, 1, 2])))).all()
    assert bool(segment_ids_violated(jnp.asarray([0, 2, 1])))
    assert not bool(segment_ids_violated(torch.tensor([0, 0, 1, 5])))


# ------------------------------------------------------------------ case 5: alignment, bias dtype


def test_explain_says_cudnn_copies_unaligned_tensors():
    cudnn = get_backend("cudnn")
    assert cudnn.notes(_cfg()) == []
    note = cudnn.notes(_cfg(unaligned=("q", "bias")))
    assert len(note) == 1 and "q, bias" in note[0] and "16" in note[0]
    assert "unaligned=q,bias" in _cfg(unaligned=("q", "bias")).summary()
    with pytest.raises(ValueError, match="unaligned: expected a tuple of tensor names"):
        _cfg(unaligned=["q"])


def test_explain_prints_the_notes_of_backends_that_can_run(monkeypatch):
    reference = get_backend("reference")
    monkeypatch.setattr(type(reference), "notes", lambda self, cfg: ["a note"])
    text = fusedattn.explain(_cfg(device="cpu", dtype="float32"))
    assert "note: a note" in text


def test_aligned_copy_keeps_values_and_strides():
    from fusedattn.backends.cudnn.alignment import aligned_copy

    buf = torch.randn(1 + 2 * 3 * 4 * 8).to(torch.bfloat16)
    view = buf[1:].view(2, 3, 4, 8).permute(0, 2, 1, 3)
    assert view.data_ptr() % 16
    copy = aligned_copy(view)
    assert copy.data_ptr() % 16 == 0 and copy.stride() == view.stride() and torch.equal(copy, view)
    bias = buf[1:9].view(1, 1, 1, 8).expand(2, 3, 5, 8)
    copy = aligned_copy(bias)
    assert copy.data_ptr() % 16 == 0 and copy.stride() == bias.stride() and torch.equal(copy, bias)


def test_a_bias_of_another_dtype_is_refused_like_sdpa_does():
    q = torch.randn(1, 4, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"bias: expected dtype bfloat16 like q, got dtype float32; cast it once"):
        fat.attention(q, q, q, bias=torch.zeros(1, 2, 4, 4))
    qj = jnp.ones((1, 4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"bias: expected dtype float32 like q, got dtype float16"):
        fja.attention(qj, qj, qj, bias=jnp.zeros((1, 2, 4, 4), jnp.float16))


def test_a_learnable_score_mod_term_of_another_dtype_runs_as_a_bias_in_qs_dtype():
    # The term becomes bias= (which has a gradient); a float32 table with bf16 q is cast, not refused.
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 8, 2, 16, generator=gen).bfloat16().requires_grad_(True)
    table = torch.randn(2, 15, generator=gen, requires_grad=True)
    out = fat.attention(q, q, q, score_mod=score_mods.relative_position_bias(table))
    out.float().square().sum().backward()
    assert table.grad.dtype == torch.float32 and torch.isfinite(table.grad).all() and table.grad.abs().sum() > 0


def test_a_learnable_score_mod_term_where_no_bias_can_go_is_refused_with_the_reason():
    q = torch.randn(1, 6, 2, 32)
    term = score_mods.additive_bias(torch.zeros(1, 2, 6, 6, requires_grad=True))
    with pytest.raises(ValueError, match="its added term runs as a post-scale bias.*alibi_slopes takes no bias"):
        fat.attention(q, q, q, alibi_slopes=torch.tensor([0.5, 0.25]), score_mod=term)


# ------------------------------------------------- mask_mod rewrites that changed what a call means

def _select(mask_mod):
    """The mask_mod as a float64 naive's score_mod: -1e9 where it is False (a score at most -1e8 counts as
    masked; -inf would meet ALiBi's term as NaN in the naive's own arithmetic)."""
    return lambda s, b, h, q_idx, kv_idx: torch.where(mask_mod(b, h, q_idx, kv_idx), s, -1e9)


def _against_naive(q, k, v, mask_mod, grads=True, **options):
    """fusedattn.torch.attention with mask_mod (float32) against the float64 naive with the mask as a select:
    out, LSE and, where asked, the gradients of q, k, v and of a sink."""
    leaves = [x.clone().requires_grad_(grads) for x in (q, k, v)]
    sink = options.pop("sink", None)
    wide = {name: (x.double() if torch.is_tensor(x) and x.is_floating_point() else x) for name, x in options.items()}
    sinks = [] if sink is None else [sink.clone().requires_grad_(grads)]
    got = fat.attention(*leaves, mask_mod=mask_mod, return_lse=True, **options,
                        **({"sink": sinks[0]} if sinks else {}))
    exact_leaves = [x.double().requires_grad_(grads) for x in (*leaves, *sinks)]
    out, lse, _ = naive_attention(*exact_leaves[:3], score_mod=_select(mask_mod), **wide,
                                  **({"sink": exact_leaves[3]} if sinks else {}))
    torch.testing.assert_close(got.out.double(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse.double(), lse, atol=1e-5, rtol=1e-5)
    if grads:
        weight = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        expected = torch.autograd.grad((out * weight).sum() + lse.nan_to_num(0, 0, 0).sum(), exact_leaves)
        found = torch.autograd.grad((got.out.double() * weight).sum() + got.lse.double().nan_to_num(0, 0, 0).sum(),
                                    [*leaves, *sinks])
        for name, a, b in zip(("q", "k", "v", "sink"), found, expected):
            torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


_LENGTHS = (3, 8)


# Each mask made over the call's lengths (B,) array, so the same function serves torch and JAX.
_ALIBI_MASKS = {
    "causal-sq<skv": ((4, 8), lambda lengths: lambda b, h, q_idx, kv_idx: q_idx >= kv_idx),
    "band-sq>skv": ((8, 4), lambda lengths: lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 2)),
    "kv-lengths": ((8, 8), lambda lengths: lambda b, h, q_idx, kv_idx: kv_idx < lengths[b]),  # per-sequence diagonals
    "causal-square": ((8, 8), lambda lengths: lambda b, h, q_idx, kv_idx: q_idx >= kv_idx),  # the diagonals meet
}


@pytest.mark.parametrize("name", sorted(_ALIBI_MASKS))
def test_alibi_slopes_keep_their_diagonal_when_a_mask_mod_is_rewritten(name):
    """ALiBi measures distances from the mask's diagonal; a mask_mod rewritten into a native mask with another
    diagonal (causal is top-left, 'none' bottom-right, padding per sequence) moved them: LSE off by 2.0, out
    by 0.9-1.4, in torch and JAX. Such a rewrite is now not taken; one that keeps the diagonal is."""
    (seqlen_q, seqlen_kv), make = _ALIBI_MASKS[name]
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(2, seqlen_q, 2, 8, generator=gen)
    k, v = (torch.randn(2, seqlen_kv, 2, 8, generator=gen) for _ in range(2))
    slopes = torch.tensor([0.5, 0.25])
    mask_mod = make(torch.tensor(_LENGTHS))
    _against_naive(q, k, v, mask_mod, alibi_slopes=slopes)
    got = fja.attention(*(jnp.asarray(x.numpy()) for x in (q, k, v)), alibi_slopes=jnp.asarray(slopes.numpy()),
                        mask_mod=make(jnp.asarray(_LENGTHS)), return_lse=True)
    out, lse, _ = naive_attention(q.double(), k.double(), v.double(), score_mod=_select(mask_mod),
                                  alibi_slopes=slopes.double())
    np.testing.assert_allclose(np.asarray(got.out), out.numpy(), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.lse), lse.numpy(), atol=1e-5, rtol=1e-5)
    if name == "causal-square":  # still rewritten: cuDNN's own causal mask with its ALiBi
        assert "mask=causal" in fat.explain(q, k, v, mask_mod=mask_mod, alibi_slopes=slopes)


@pytest.mark.parametrize("softmax_type", ["learnable", "off_by_one"])
def test_a_sink_keeps_its_term_in_rows_a_query_length_mask_mod_empties(softmax_type):
    """q_idx < lengths[b] was rewritten into padding, whose rows past the length have LSE -inf; rows the
    mask_mod leaves without keys keep the sink's term (log exp(sink[h]), or 0 for off_by_one)."""
    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(2, 8, 2, 8, generator=gen) for _ in range(3))
    options = {"softmax_type": softmax_type}
    if softmax_type == "learnable":
        options["sink"] = torch.tensor([0.3, -1.0])
    lengths = torch.tensor(_LENGTHS)
    _against_naive(q, k, v, lambda b, h, q_idx, kv_idx: q_idx < lengths[b], **options)
    jax_lengths = jnp.asarray(_LENGTHS)
    got = fja.attention(*(jnp.asarray(x.numpy()) for x in (q, k, v)), return_lse=True,
                        mask_mod=lambda b, h, q_idx, kv_idx: q_idx < jax_lengths[b],
                        **{name: (jnp.asarray(x.numpy()) if torch.is_tensor(x) else x) for name, x in options.items()})
    expected = 0.3 if softmax_type == "learnable" else 0.0
    np.testing.assert_allclose(np.asarray(got.lse)[0, 0, 3:], expected, atol=1e-6)


class _Banded(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.window = 4
        self.cap = 2.0

    def forward(self, q, k, v):
        return fat.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx)
                             & (q_idx - kv_idx <= self.window))


def test_a_mask_mod_follows_an_attribute_of_the_object_it_captures():
    """A closure over `self` reading self.window kept its first trace and rewrite (the object was the same):
    after `layer.window = 1` it still computed a window of 4 (off by 1.5). What a callback reads through an
    object it captures now counts by value, as a captured number does."""
    gen = torch.Generator().manual_seed(23)
    q, k, v = (torch.randn(1, 8, 1, 8, generator=gen) for _ in range(3))
    layer = _Banded()
    for window in (4, 1, 1, 4):
        layer.window = window
        out, _, _ = naive_attention(q.double(), k.double(), v.double(), mask="causal", window=(window, 0))
        torch.testing.assert_close(layer(q, k, v).double(), out, atol=1e-5, rtol=1e-5)
    config = SimpleNamespace(window=4)
    mask_mod = lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= config.window)  # noqa: E731
    for window in (4, 1):
        config.window = window
        got = fja.attention(*(jnp.asarray(x.numpy()) for x in (q, k, v)), mask_mod=mask_mod)
        out, _, _ = naive_attention(q.double(), k.double(), v.double(), mask="causal", window=(window, 0))
        np.testing.assert_allclose(np.asarray(got), out.numpy(), atol=1e-5, rtol=1e-5)


def test_a_kept_score_mod_binding_follows_an_attribute_of_the_object_it_captures(monkeypatch):
    """The native warm path kept a score_mod's binding while its callbacks read the same objects: a closure
    over `self` reading self.cap passed the first cap's scalars after `layer.cap` changed. The operator is
    stubbed: the scalars it is handed must follow the attribute."""
    from fusedattn.torch import functional

    monkeypatch.setattr(functional, "_native_plan_on", lambda cfg, name, device: 7)
    handed = []

    def operator(plan, q, k, v, sink, seed, offset, *extra):
        handed.append(list(extra[2]))
        return q.clone(), q[..., 0].float()

    monkeypatch.setattr(functional, "_operator", operator)
    layer, q = _Banded(), torch.randn(1, 8, 1, 8)

    def call():
        return fat.attention(q, q, q, mask="causal",
                             score_mod=lambda s, b, h, q_idx, kv_idx: layer.cap * score_mods.tanh(s / layer.cap))

    for cap in (2.0, 2.0, 5.0, 5.0, 0.5):
        layer.cap = cap
        call()
        assert cap in handed[-1], (cap, handed[-1])


def test_vmapped_offsets_give_shared_inputs_the_sum_of_their_items_gradients():
    """Under vmap over the offsets with q (or k, v) shared, the traced-offsets check's gradient factor ran its
    backward once per item on the cotangent already summed over the items: the shared input's gradient was
    N times the per-item sum (3.0x here, errors of 4-11). It must be the sum of the items' gradients."""
    q = jax.random.normal(jax.random.key(0), (2, 5, 4, 8))
    k = jax.random.normal(jax.random.key(1), (2, 7, 4, 8))
    v = jax.random.normal(jax.random.key(2), (2, 7, 4, 8))
    cu_q = jnp.array([[0, 5, 10], [0, 3, 8], [0, 5, 7]], jnp.int32)
    cu_kv = jnp.array([[0, 7, 14], [0, 2, 9], [0, 7, 9]], jnp.int32)

    def loss(q, k, cq, ckv):
        return jnp.sum(jnp.cos(fja.attention(q, k, v, mask="padding_causal", cu_seqlens_q=cq, cu_seqlens_kv=ckv)))

    batched = jax.grad(lambda q, k: jnp.sum(jax.vmap(loss, in_axes=(None, None, 0, 0))(q, k, cu_q, cu_kv)),
                       argnums=(0, 1))(q, k)
    for i, got in enumerate(batched):
        want = sum(jax.grad(loss, argnums=i)(q, k, cu_q[n], cu_kv[n]) for n in range(3))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_learning_tensor_read_as_a_constant_is_refused_not_left_without_its_gradient():
    """cap[0] (a captured tensor indexed by a number) is traced as a new constant: a tensor that required grad
    silently got none (cap.grad None; s + bias[0] even made an output that needs no gradient). A training call
    now says so; without grad, or with the tensor detached, it runs."""
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    cap = torch.tensor([3.0], requires_grad=True)
    for score_mod in (lambda s, b, h, q_idx, kv_idx: cap[0] * torch.tanh(s / cap[0]),
                      lambda s, b, h, q_idx, kv_idx: s + cap[0]):
        for inputs in ((q, q, q), (q.detach(),) * 3):
            with pytest.raises(ValueError, match=r"a captured tensor of shape \(1,\) requires grad, but the "
                                                 r"callback reads it where no gradient can reach it"):
                fat.attention(*inputs, score_mod=score_mod)
        with torch.no_grad():
            fat.attention(q, q, q, score_mod=score_mod)
    detached = fat.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: cap.detach()[0] * torch.tanh(s / 3))
    expected, _, _ = naive_attention(*(q.detach().double(),) * 3, score_mod=lambda s, b, h, i, j: 3 * torch.tanh(s / 3))
    torch.testing.assert_close(detached.double(), expected, atol=1e-5, rtol=1e-5)
    table = torch.tensor([0.5, -0.25], requires_grad=True)  # indexed by h: it learns (an added term)
    fat.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[h]).sum().backward()
    assert table.grad is not None and torch.isfinite(table.grad).all()


def test_jax_grad_of_a_constant_indexed_captured_array_is_refused_not_a_leaked_tracer():
    """jax.grad through c[0] in a score_mod crashed with UnexpectedTracerError (the tracer leaked into the
    attention's custom_vjp); it now gets the same refusal as torch, and the array under stop_gradient runs."""
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 8))

    def loss(cap, stop):
        cap = jax.lax.stop_gradient(cap) if stop else cap
        return fja.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: cap[0] * jnp.tanh(s / cap[0])).sum()

    with pytest.raises(ValueError, match="requires grad, but the callback reads it where no gradient can reach it"):
        jax.grad(loss)(jnp.array([3.0]), False)
    assert float(jax.grad(loss)(jnp.array([3.0]), True)[0]) == 0.0


@pytest.mark.parametrize("form", ["s + t[h] + u[q]", "t[h] - u[kv] + s", "(s - t[h]) - u[q]"])
def test_several_learnable_added_terms_learn_together(form):
    """A score_mod adding more than one learnable term was refused ("score_mod tensors get no gradient"): only a
    single added term ran as a bias. Their sum now runs as one post-scale bias, and every table learns: out,
    LSE and the gradients of q, k, v and both tables against the float64 naive."""
    def make(t, u):
        return {"s + t[h] + u[q]": lambda s, b, h, q_idx, kv_idx: s + t[h] + u[q_idx],
                "t[h] - u[kv] + s": lambda s, b, h, q_idx, kv_idx: t[h] - u[kv_idx] + s,
                "(s - t[h]) - u[q]": lambda s, b, h, q_idx, kv_idx: (s - t[h]) - u[q_idx]}[form]

    gen = torch.Generator().manual_seed(29)
    leaves = [torch.randn(2, 6, 2, 8, generator=gen) for _ in range(3)] + [torch.randn(2, generator=gen),
                                                                           torch.randn(6, generator=gen)]
    got_leaves = [x.clone().requires_grad_() for x in leaves]
    got = fat.attention(*got_leaves[:3], score_mod=make(*got_leaves[3:]), return_lse=True)
    exact_leaves = [x.double().requires_grad_() for x in leaves]
    out, lse, _ = naive_attention(*exact_leaves[:3], score_mod=make(*exact_leaves[3:]))
    torch.testing.assert_close(got.out.double(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse.double(), lse, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    found = torch.autograd.grad((got.out.double() * weight).sum() + got.lse.double().sum(), got_leaves)
    expected = torch.autograd.grad((out * weight).sum() + lse.sum(), exact_leaves)
    for name, a, b in zip(("q", "k", "v", "t", "u"), found, expected):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


def test_a_float64_call_keeps_float64_in_a_learnable_added_term():
    """A learnable added term ran as a bias computed in float32: a float64 call came back with float32 accuracy
    (out 2e-8, the table's gradient 4e-7 off; gradcheck failed). The term now follows the call's precision."""
    gen = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(2, 6, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    t = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    mod = lambda s, b, h, q_idx, kv_idx: s + t[kv_idx]  # noqa: E731
    out = fat.attention(q, k, v, score_mod=mod)
    exact, _, _ = naive_attention(q, k, v, score_mod=mod)
    assert (out - exact).abs().max() < 1e-13
    assert torch.autograd.gradcheck(lambda t_: fat.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + t_[ki]),
                                    (t,))
    with jax.enable_x64(True):
        qj, kj, vj = (jnp.asarray(x.detach().numpy()) for x in (q, k, v))
        tj = jnp.asarray(t.detach().numpy())

        def loss(t_):
            return fja.attention(qj, kj, vj, score_mod=lambda s, b, h, qi, ki: s + t_[ki]).sum()

        exact_grad = torch.autograd.grad(naive_attention(q, k, v, score_mod=mod)[0].sum(), t)[0]
        assert np.abs(np.asarray(jax.grad(loss)(tj)) - exact_grad.numpy()).max() < 1e-12


@pytest.mark.parametrize("bias_type", ["post_scale", "pre_scale"])
def test_a_learnable_added_term_learns_beside_a_bias(bias_type):
    """With bias= given too, a learnable added term was refused, with a message telling the user to pass the
    term as bias=. The two now run as one post-scale bias (the given one times the scale where it is
    pre-scale): out and every gradient, the bias's and the table's, against the float64 naive."""
    gen = torch.Generator().manual_seed(43)
    leaves = [torch.randn(2, 6, 2, 8, generator=gen) for _ in range(3)] + [torch.randn(1, 2, 1, 6, generator=gen),
                                                                           torch.randn(6, generator=gen)]

    def call(attention, q, k, v, bias, t):
        return attention(q, k, v, bias=bias, bias_type=bias_type, score_mod=lambda s, b, h, qi, ki: s - t[qi])

    got_leaves = [x.clone().requires_grad_() for x in leaves]
    got = call(fat.attention, *got_leaves)
    exact_leaves = [x.double().requires_grad_() for x in leaves]
    exact = call(lambda *a, **o: naive_attention(*a, **o)[0], *exact_leaves)
    torch.testing.assert_close(got.double(), exact, atol=1e-5, rtol=1e-5)
    weight = torch.randn(exact.shape, generator=gen, dtype=torch.float64)
    found = torch.autograd.grad((got.double() * weight).sum(), got_leaves)
    expected = torch.autograd.grad((exact * weight).sum(), exact_leaves)
    for name, a, b in zip(("q", "k", "v", "bias", "t"), found, expected):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=1e-5, msg=name)


_DOCUMENTS = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 2, 2]])
_BESIDE_MASKS = {
    "document": lambda b, h, q_idx, kv_idx: _DOCUMENTS[b, q_idx] == _DOCUMENTS[b, kv_idx],  # THD without a term
    "dilated": lambda b, h, q_idx, kv_idx: (q_idx - kv_idx) % 2 == 0,  # a select in the graph
    "causal": lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,  # a native mask
}


@pytest.mark.parametrize("mask", list(_BESIDE_MASKS))
@pytest.mark.parametrize("term", ["t[h]", "u[kv]"])
def test_a_learnable_added_term_learns_beside_a_mask_mod(mask, term):
    """A learnable added term with a mask_mod was refused: beside a mask in the graph ("score_mod tensors get no
    gradient", as the mask made the score_mod more than an added term) and beside a document mask ("layout 'thd'
    takes no bias", a layout the user never asked for). The term now runs as a bias and the mask stays a
    mask_mod (documents: in the graph): out, LSE and every gradient against the float64 naive, torch and JAX."""
    mask_mod = _BESIDE_MASKS[mask]
    gen = torch.Generator().manual_seed(47)
    leaves = [torch.randn(2, 6, 2, 8, generator=gen) for _ in range(3)] + [torch.randn(2, generator=gen),
                                                                           torch.randn(6, generator=gen)]

    def mod(t, u):
        return (lambda s, b, h, qi, ki: s + t[h]) if term == "t[h]" else (lambda s, b, h, qi, ki: s + u[ki])

    def masked(score_mod):
        return lambda s, b, h, qi, ki: torch.where(mask_mod(b, h, qi, ki), score_mod(s, b, h, qi, ki), -1e9)

    got_leaves = [x.clone().requires_grad_() for x in leaves]
    got = fat.attention(*got_leaves[:3], score_mod=mod(*got_leaves[3:]), mask_mod=mask_mod, return_lse=True)
    exact_leaves = [x.double().requires_grad_() for x in leaves]
    out, lse, _ = naive_attention(*exact_leaves[:3], score_mod=masked(mod(*exact_leaves[3:])))
    torch.testing.assert_close(got.out.double(), out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse.double(), lse, atol=1e-5, rtol=1e-5)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    found = torch.autograd.grad((got.out.double() * weight).sum() + got.lse.double().sum(), got_leaves,
                                allow_unused=True)
    expected = torch.autograd.grad((out * weight).sum() + lse.sum(), exact_leaves, allow_unused=True)
    expected = [torch.zeros_like(x) if g is None else g for g, x in zip(expected, exact_leaves)]
    for name, a, b in zip(("q", "k", "v", "t", "u"), found, expected):
        torch.testing.assert_close(torch.zeros_like(b) if a is None else a.double(), b, atol=1e-5, rtol=1e-5,
                                   msg=name)
    assert expected[3 if term == "t[h]" else 4].abs().max() > 1e-3  # the term's gradient is not trivially 0

    documents = jnp.asarray(_DOCUMENTS.numpy())
    jax_masks = {"document": lambda b, h, q_idx, kv_idx: documents[b, q_idx] == documents[b, kv_idx],
                 "dilated": _BESIDE_MASKS["dilated"], "causal": _BESIDE_MASKS["causal"]}
    q, k, v, t, u = (jnp.asarray(x.numpy()) for x in leaves)

    def loss(t, u):
        score_mod = (lambda s, b, h, qi, ki: s + t[h]) if term == "t[h]" else (lambda s, b, h, qi, ki: s + u[ki])
        got = fja.attention(q, k, v, score_mod=score_mod, mask_mod=jax_masks[mask], return_lse=True)
        return (got.out * jnp.asarray(weight.numpy(), jnp.float32)).sum() + got.lse.sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(t, u)
    for name, a, b in zip(("t", "u"), grads, expected[3:]):
        np.testing.assert_allclose(np.asarray(a, np.float64), b.numpy(), atol=2e-5, rtol=2e-5, err_msg=name)


def test_a_term_that_starts_learning_beside_a_kept_document_rewrite_learns():
    """A document call made while the table was frozen kept its THD rewrite; once the table required grad the
    repeat call was refused ("layout 'thd' takes no bias", a layout the user never asked for). Sweep 7."""
    gen = torch.Generator().manual_seed(71)
    q, k, v = (torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    table = torch.nn.Parameter(torch.randn(2, generator=gen, dtype=torch.float64), requires_grad=False)
    mask_mod = _BESIDE_MASKS["document"]

    def call():
        return fat.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + table[h], mask_mod=mask_mod,
                             return_lse=True)

    call()
    table.requires_grad_(True)
    got = call()
    out, lse, _ = naive_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: torch.where(
        mask_mod(b, h, qi, ki), s + table[h], -1e9))
    torch.testing.assert_close(got.out, out)
    torch.testing.assert_close(got.lse.double(), lse, atol=1e-6, rtol=1e-6)  # (the LSE is float32)
    found = torch.autograd.grad(got.lse.double().sum() + got.out.sum(), table)[0]
    torch.testing.assert_close(found, torch.autograd.grad(lse.sum() + out.sum(), table)[0], atol=1e-6, rtol=1e-6)


def test_keyword_only_defaults_are_read_at_every_call():
    """A mask_mod or score_mod made anew with another keyword-only default (`*, w=w`) reused the first one's
    kept rewrite or binding: out off by 3.28 (sweep 7). Each call now gives its own window and cap."""
    gen = torch.Generator().manual_seed(73)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for w in (1, 3, 0):
        mask_mod = lambda b, h, qi, ki, *, w=w: (qi - ki <= w) & (ki <= qi)  # noqa: E731
        score_mod = lambda s, b, h, qi, ki, *, c=w + 1.0: c * torch.tanh(s / c)  # noqa: E731
        got = fat.attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod)
        exact, _, _ = naive_attention(q, k, v, score_mod=_masked_by(mask_mod, score_mod))
        torch.testing.assert_close(got, exact, msg=f"w={w}")


def _masked_by(mask_mod, score_mod):
    """score_mod, then -1e9 where mask_mod is False: both as one callback of the float64 naive."""
    return lambda s, b, h, qi, ki: torch.where(mask_mod(b, h, qi, ki), score_mod(s, b, h, qi, ki), -1e9)


_CONFIG = types.ModuleType("user_config")  # a user's config module, as `import config` gives
_CONFIG.WINDOW = 1


class _BaseSizes:
    WINDOW = 1


class _Sizes(_BaseSizes):  # its WINDOW is its base's
    pass


def _window_from_module(b, h, qi, ki):
    return (qi - ki <= _CONFIG.WINDOW) & (ki <= qi)


def _window_from_class(b, h, qi, ki):
    return (qi - ki <= _Sizes.WINDOW) & (ki <= qi)


def test_attributes_of_a_users_module_or_class_are_read_at_every_call():
    """A mask_mod reading `config.WINDOW` or `Sizes.WINDOW` kept the first call's rewrite after the value
    changed (off by up to 3.2); a learning term scaled by one kept its first traced number (LSE off by 0.57).
    Modules and classes counted as fixed state (sweep 7); a user's are now read like an object's."""
    gen = torch.Generator().manual_seed(79)
    q, k, v = (torch.randn(1, 8, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    table = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)

    def scaled_term(s, b, h, qi, ki):
        return s + _CONFIG.WINDOW * table[h]

    try:
        for window in (1, 3, 0):
            _CONFIG.WINDOW = _BaseSizes.WINDOW = window
            for mask_mod in (_window_from_module, _window_from_class):
                exact, _, _ = naive_attention(q, k, v, score_mod=_masked_by(mask_mod, lambda s, b, h, qi, ki: s))
                torch.testing.assert_close(fat.attention(q, k, v, mask_mod=mask_mod), exact, msg=f"{window}")
            got = fat.attention(q, k, v, score_mod=scaled_term, return_lse=True)
            _, lse, _ = naive_attention(q, k, v, score_mod=scaled_term)
            torch.testing.assert_close(got.lse.double(), lse, atol=1e-6, rtol=1e-6, msg=f"term {window}")
    finally:
        _CONFIG.WINDOW = _BaseSizes.WINDOW = 1


def test_a_mask_beside_a_learning_term_runs_on_cudnn_with_derivative_one():
    """cuDNN builds no backward with dBias beside a score_mod derivative graph (9.19: "No valid engine
    configs"); the mask that stays beside the term's bias has derivative 1, right for a mask. A softcap
    beside a learning bias keeps its derivative, and the refusal."""
    t = torch.randn(6, requires_grad=True)
    mod = as_score_mod("test", lambda s, b, h, qi, ki: s + t[ki], mask_mod=_BESIDE_MASKS["dilated"],
                       framework="torch", device="cpu")
    assert mod.as_bias is not None and mod.beside_bias is not None and mod.beside_bias.bprop is None
    alone = as_score_mod("test", None, mask_mod=_BESIDE_MASKS["dilated"], framework="torch", device="cpu")
    assert alone.bprop is not None  # a mask_mod alone keeps its derivative

    def reasons(mod):
        recipe = bind("test", mod, batch=1, heads_q=2, seqlen_q=6, seqlen_kv=6, device="cpu", training=True,
                      like=torch.empty(1)).recipe
        cfg = _cfg(seqlen_q=6, seqlen_kv=6, score_mod_key=("k",), score_mod_recipe=recipe, is_training=True,
                   bias="post_scale", bias_shape=(1, 2, 6, 6), bias_requires_grad=True)
        return [r for r in unsupported(cfg) if "a bias that requires grad" in r]

    assert not reasons(mod.beside_bias)
    assert reasons(as_score_mod("test", lambda s, b, h, qi, ki: 3.0 * torch.tanh(s / 3.0),
                                mask_mod=_BESIDE_MASKS["dilated"], framework="torch", device="cpu"))


def test_a_callback_that_does_not_trace_is_applied_per_element_as_flex_applies_it():
    """A reduction in a score_mod (s - s.max()) ran on the whole (B, H, Sq, Skv) score matrix: ordinary
    attention, 0.85 off FlexAttention, which applies score_mod to one score at a time (every score 0 here,
    so the output is the mean of v). The reference now applies it per element too, torch and JAX."""
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(53)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))

    def centered(score, b, h, q_idx, kv_idx):
        return score - score.max()

    ours = fat.flex_attention(q, k, v, score_mod=centered)
    torch.testing.assert_close(ours, flex_attention(q, k, v, score_mod=centered))
    torch.testing.assert_close(ours, v.mean(2, keepdim=True).expand_as(ours))
    qj, kj, vj = (jnp.asarray(x.transpose(1, 2).float().numpy()) for x in (q, k, v))
    got = fja.attention(qj, kj, vj, score_mod=lambda s, b, h, qi, ki: s - jnp.max(s))
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(np.asarray(vj).mean(1, keepdims=True), got.shape),
                               atol=1e-6)


@pytest.mark.parametrize("case", ["float score", "python mask", "int mask", "index"])
def test_callbacks_returning_the_wrong_kind_get_an_error_naming_them(case):
    """They met torch's own errors (AttributeError, a TypeError of where(), a bare IndexError)."""
    q = torch.randn(1, 4, 2, 8)
    options, match = {
        "float score": ({"score_mod": lambda s, b, h, qi, ki: 0.0}, "score_mod: expected it to return a float array"),
        "python mask": ({"mask_mod": lambda b, h, qi, ki: True}, "mask_mod: expected it to return a boolean array"),
        "int mask": ({"mask_mod": lambda b, h, qi, ki: (qi >= ki).int()}, "boolean array .* got torch.int32"),
        "index": ({"mask_mod": lambda b, h, qi, ki: torch.arange(2)[ki] >= 0}, "mask_mod: an index is out of range"),
    }[case]
    with pytest.raises(ValueError, match=match):
        fat.attention(q, q, q, **options)


@pytest.mark.parametrize("sizes", [(4, 5), (5, 4), (6, 5)])
def test_jax_segment_ids_need_one_id_per_packed_token(sizes):
    """Fewer ids than tokens ran: the tokens without one became padding (out 0, off by 0.90), a key without
    one was dropped (1.34), eagerly and under jit; more named cu_seqlens_q. Now the side is named."""
    x = jax.random.normal(jax.random.key(5), (5, 2, 8))
    ids_q, ids_kv = (jnp.zeros(n, jnp.int32) for n in sizes)
    name = "segment_ids_q" if sizes[0] != 5 else "segment_ids_kv"
    for run in (lambda f: f(), lambda f: jax.jit(f)()):
        with pytest.raises(ValueError, match=f"{name}: expected one id per packed (query|key) token \\(5\\)"):
            run(lambda: fja.attention(x, x, x, layout="thd", mask="padding", segment_ids_q=ids_q,
                                      segment_ids_kv=ids_kv, num_sequences=1, max_seqlen_q=5, max_seqlen_kv=5))


def test_jax_num_sequences_without_segment_ids_is_refused_not_ignored():
    x = jax.random.normal(jax.random.key(7), (5, 2, 8))
    offsets = jnp.array([0, 2, 5], jnp.int32)
    with pytest.raises(ValueError, match="num_sequences: expected None without segment_ids_q/kv"):
        fja.attention(x, x, x, layout="thd", mask="padding", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                      num_sequences=2)


@pytest.mark.parametrize("shard_axes", [{"sequence": "data"}, "data", 42])
def test_jax_shard_axes_are_checked_whichever_backend_runs(shard_axes):
    """The reference backend (jax.numpy) ignored any shard_axes; a callback backend refused the same call."""
    x = jax.random.normal(jax.random.key(6), (2, 4, 2, 8))
    with pytest.raises(ValueError, match="shard_axes: expected a dict with keys 'batch' and/or 'heads'"):
        jax.jit(lambda x: fja.attention(x, x, x, shard_axes=shard_axes))(x)


def test_numpy_integers_are_accepted_as_windows_and_max_lengths():
    """np.int64 windows (torch) and max lengths (JAX) were refused as not ints, while NumPy scales ran."""
    q = torch.randn(1, 8, 2, 8)
    assert torch.equal(fat.attention(q, q, q, mask="causal", window=(np.int64(2), 0)),
                       fat.attention(q, q, q, mask="causal", window=(2, 0)))
    qj = jax.random.normal(jax.random.key(1), (8, 2, 8))
    offsets = jnp.array([0, 3, 8], jnp.int32)
    thd = dict(layout="thd", mask="padding", cu_seqlens_q=offsets, cu_seqlens_kv=offsets)
    np.testing.assert_array_equal(fja.attention(qj, qj, qj, max_seqlen_q=np.int64(5), max_seqlen_kv=np.int32(5), **thd),
                                  fja.attention(qj, qj, qj, max_seqlen_q=5, max_seqlen_kv=5, **thd))
    with pytest.raises(ValueError, match="window: expected"):
        fat.attention(q, q, q, mask="causal", window=(2.0, 0))  # a float stays refused


@pytest.mark.parametrize("case", ["document ids", "window bound", "q lengths with a sink", "score_mod table"])
def test_jax_grad_of_a_jitted_call_whose_callbacks_capture_its_arguments(case):
    """grad(jit(f)), where a mask_mod or score_mod captures one of f's traced arguments, crashed in XLA's
    lowering (a leaked tracer: the arrays travelled in a static argument of the custom_vjp, and the
    reference ran the user's closure over the outer trace's tracer). Now it equals jit(grad(f)), and the
    output the float64 naive."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 4, 8)), jnp.float32) for _ in range(3))
    arg, options, mod = {
        "document ids": (jnp.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 3, 3]]), {},
                         lambda a: dict(mask_mod=lambda b, h, qi, ki: a[b, qi] == a[b, ki])),
        "window bound": (jnp.array(2), {}, lambda a: dict(mask_mod=lambda b, h, qi, ki: (qi - ki <= a) & (ki <= qi))),
        "q lengths with a sink": (jnp.array([5, 2]), {"softmax_type": "off_by_one"},
                                  lambda a: dict(mask_mod=lambda b, h, qi, ki: qi < a[b])),
        "score_mod table": (jnp.asarray(rng.standard_normal(8), jnp.float32), {},
                            lambda a: dict(score_mod=lambda s, b, h, qi, ki: s + a[ki])),
    }[case]

    def loss(q_, a):
        return (fja.attention(q_, k, v, **options, **mod(a)) ** 2).sum()

    outer = jax.grad(lambda q_, a: jax.jit(lambda x, y: fja.attention(x, k, v, **options, **mod(y)))(q_, a)
                     .__pow__(2).sum())(q, arg)
    inner = jax.jit(jax.grad(loss))(q, arg)
    np.testing.assert_allclose(np.asarray(outer), np.asarray(inner), rtol=1e-5, atol=1e-6)
    torch_arg = torch.from_numpy(np.asarray(arg))
    t_options = {**options, **mod(torch_arg)}
    if "mask_mod" in t_options:  # the naive takes it as a score_mod
        keep = t_options.pop("mask_mod")
        t_options["score_mod"] = lambda s, b, h, qi, ki: torch.where(keep(b, h, qi, ki), s, -float("inf"))
    qt = torch.from_numpy(np.asarray(q)).double().requires_grad_()
    exact, _, _ = naive_attention(qt, *(torch.from_numpy(np.asarray(x)).double() for x in (k, v)), **t_options)
    exact_grad = torch.autograd.grad((exact ** 2).sum(), qt)[0]
    np.testing.assert_allclose(np.asarray(outer), exact_grad.numpy(), rtol=1e-4, atol=1e-5)


def test_jax_grad_of_vmap_over_a_captured_per_item_table():
    """grad(vmap(f)) where the score_mod captures the vmapped table crashed (UnexpectedTracerError); the
    gradient now equals the items' own, one by one."""
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 8, 4, 8)), jnp.float32) for _ in range(3))
    tables = jnp.asarray(rng.standard_normal((3, 8)), jnp.float32)

    def one(q1, t):
        return (fja.attention(q1[None], k[:1], v[:1], score_mod=lambda s, b, h, qi, ki: s + t[ki]) ** 2).sum()

    batched = jax.grad(lambda x: jax.vmap(one)(x, tables).sum())(q)
    items = jnp.stack([jax.grad(one)(q[i], tables[i]) for i in range(3)])
    np.testing.assert_allclose(np.asarray(batched), np.asarray(items), rtol=1e-5, atol=1e-6)


def test_a_max_length_without_offsets_is_refused_not_ignored():
    """max_seqlen_q on a dense call without cu_seqlens was accepted and ignored: every position attended."""
    q = torch.randn(1, 8, 2, 8)
    fat.attention(q, q, q)  # a plain call first: the plan cache must not let the next one through
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        with pytest.raises(ValueError, match=f"{name}: expected None without cu_seqlens"):
            fat.attention(q, q, q, **{name: 4})
        with pytest.raises(ValueError, match=f"{name}: expected None without cu_seqlens"):
            fja.attention(jnp.asarray(q.numpy()), jnp.asarray(q.numpy()), jnp.asarray(q.numpy()), **{name: 4})


def test_a_kept_document_rewrite_follows_its_score_mod_starting_to_read_positions():
    """A document mask beside a score_mod of h alone runs as THD; the same code made over a flag that now reads
    kv_idx recalled the kept THD rewrite (positions restart at each document): off by 1.18. It now runs the
    select, in agreement with the float64 naive."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2], [0, 0, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3]])

    def mask_mod(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    def make(by_position):
        def score_mod(s, b, h, q_idx, kv_idx):
            return s * (1.0 + 0.2 * (kv_idx if by_position else h))
        return score_mod

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    for by_position in (False, True, False):
        mod = make(by_position)
        out = fat.attention(q, k, v, score_mod=mod, mask_mod=mask_mod)
        exact, _, _ = naive_attention(q, k, v, score_mod=lambda s, b, h, qi, ki, mod=mod: torch.where(
            mask_mod(b, h, qi, ki), mod(s, b, h, qi, ki), -float("inf")))
        assert (out - exact).abs().max() < 1e-12, by_position


@pytest.mark.parametrize("case", ["h", "table"])
def test_jax_float64_jit_keeps_float64_in_traced_score_mods(case):
    """Under jax.jit a float64 call's score_mod pieces (h, captured arrays) were made float32 aux arrays for the
    reference: errors of 2e-8 to 1.6e-5 against float64. They keep float64 now, as in eager calls."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(5)
        q, k, v = (jnp.asarray(rng.standard_normal((2, 8, 4, 8))) for _ in range(3))
        table = jnp.asarray(rng.standard_normal((4, 15)) * 1000)
        mod = {"h": lambda s, b, h, qi, ki: s * (1 + 0.2 * h),
               "table": lambda s, b, h, qi, ki: s + table[h, ki - qi + 7]}[case]
        eager = fja.attention(q, k, v, score_mod=mod)
        jitted = jax.jit(lambda x: fja.attention(x, k, v, score_mod=mod))(q)
        assert float(jnp.abs(eager - jitted).max()) < 1e-12


@pytest.mark.parametrize("transform", ["grad(jit)", "grad(checkpoint)", "grad(vmap)"])
def test_jax_a_learnable_table_differentiated_outside_jit_gets_its_gradient(transform):
    """score + table[h, kv - q + M] with jax.grad taken outside jit, checkpoint or vmap: the term stayed an aux
    array (that it learns is not known when the call is traced) and its gradient came back 0 (the float64
    naive's is 2.7). The reference now differentiates its forward for such arrays (cuDNN refuses them)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        q, k, v, weight = (jnp.asarray(rng.standard_normal((2, 9, 2, 4))) for _ in range(4))
        table = jnp.asarray(rng.standard_normal((2, 17)))

        def f(t):
            return fja.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + t[h, ki - qi + 8], mask="causal")

        wrapped = {"grad(jit)": jax.jit(f), "grad(checkpoint)": jax.checkpoint(f),
                   "grad(vmap)": lambda t: jax.vmap(f)(t[None])[0]}[transform]
        got = jax.grad(lambda t: (wrapped(t) * weight).sum())(table)
    tt = torch.tensor(np.asarray(table), requires_grad=True)
    qt, kt, vt = (torch.tensor(np.asarray(x)) for x in (q, k, v))
    out, _, _ = naive_attention(qt, kt, vt, mask="causal", score_mod=lambda s, b, h, qi, ki: s + tt[h, ki - qi + 8])
    want = torch.autograd.grad((out * torch.tensor(np.asarray(weight))).sum(), tt)[0].numpy()
    assert np.abs(want).max() > 1 and np.abs(np.asarray(got) - want).max() < 1e-12


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_nan_sink_gives_nan_in_its_head_and_leaves_the_others_right(framework):
    """A NaN learnable sink logit made the row maximum NaN, then 0, and the denominator NaN, which the
    "has mass" test read as no mass: LSE -inf and an unnormalized output up to 4x the largest value of v,
    finite (sweep 9). NaN now, as a NaN in q gives; the other head matches the call with a finite sink."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 4, 2, 8)).astype(np.float32) for _ in range(3))
    nan_sink, sink = np.array([np.nan, 0.5], np.float32), np.array([0.25, 0.5], np.float32)
    if framework == "torch":
        run = lambda s: fat.attention(*(torch.from_numpy(x) for x in (q, k, v)), softmax_type="learnable",  # noqa: E731
                                      sink=torch.from_numpy(s), return_lse=True)
    else:
        run = lambda s: fja.attention(*(jnp.asarray(x) for x in (q, k, v)), softmax_type="learnable",  # noqa: E731
                                      sink=jnp.asarray(s), return_lse=True)
    got, finite = run(nan_sink), run(sink)
    out, lse = np.asarray(got.out), np.asarray(got.lse)
    assert np.isnan(out[:, :, 0]).all() and np.isnan(lse[:, 0]).all()
    np.testing.assert_array_equal(out[:, :, 1], np.asarray(finite.out)[:, :, 1])
    np.testing.assert_array_equal(lse[:, 1], np.asarray(finite.lse)[:, 1])


# ------------------------------------------------------------------ windows past every distance

@pytest.mark.parametrize("side", [2**31 - 1, 2**31, 2**32 + 1, 2**40])
@pytest.mark.parametrize("mask, window", [("causal", lambda w: (w, 0)), ("none", lambda w: (w, w)),
                                          ("causal_bottom_right", lambda w: (w, -1)), ("none", lambda w: (3, w))])
def test_a_window_wider_than_any_distance_bounds_nothing(side, mask, window):
    """A window side past every query-key distance is the unbounded side (config stores -1): it once went
    into int32 index arithmetic and wrapped (2**32 + 1 masked as a window of 1), a silent wrong answer in
    torch and in JAX with x64, and an OverflowError naming no argument in JAX without."""
    gen = torch.Generator().manual_seed(61)
    q = torch.randn(2, 5, 2, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 7, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    wide = window(side)
    bounded = tuple(-1 if w == side else w for w in wide)
    want = fat.attention(q, k, v, mask=mask, window=bounded)
    torch.testing.assert_close(fat.attention(q, k, v, mask=mask, window=wide), want, rtol=0, atol=0)
    got = fja.attention(*(jnp.asarray(x.float().numpy()) for x in (q, k, v)), mask=mask, window=wide)
    np.testing.assert_allclose(np.asarray(got), want.float().numpy(), rtol=2e-5, atol=2e-6)


# ------------------------------------------------------------------ values past each sequence's end

@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k", "v"])
def test_values_past_each_sequences_end_never_reach_the_sequence(poison, where):
    """A padded layout with a padding mask: q, k or v past each sequence's end (an uninitialised cache
    tail) holding NaN or inf once reached every row through 0 * NaN on the reference, forward and
    gradients. Now out, LSE and every gradient equal those with finite values there, torch and JAX."""
    gen = torch.Generator().manual_seed(63)
    q = torch.randn(2, 5, 2, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 6, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    cu_q, cu_kv = torch.tensor([0, 3, 8]), torch.tensor([0, 2, 8])  # lengths (3, 5) of 5, (2, 6) of 6
    lengths = {"q": (3, 5), "k": (2, 6), "v": (2, 6)}[where]
    clean = {"q": q, "k": k, "v": v}
    dirty = dict(clean)
    dirty[where] = clean[where].clone()
    for b, n in enumerate(lengths):
        dirty[where][b, n:] = poison
    options = dict(mask="padding", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, return_lse=True)
    grad = torch.randn(2, 5, 2, 8, generator=gen, dtype=torch.float64)
    results = []
    for tensors in (clean, dirty):
        leaves = {name: x.clone().requires_grad_(True) for name, x in tensors.items()}
        out, lse = fat.attention(leaves["q"], leaves["k"], leaves["v"], **options)[:2]
        (out * grad).sum().backward()
        inside = [leaves[name].grad[b, :n] for name in ("q", "k", "v")
                  for b, n in enumerate({"q": (3, 5), "k": (2, 6), "v": (2, 6)}[name])]
        results.append((out, torch.where(torch.isinf(lse), 0, lse), *inside))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    arrays = {name: jnp.asarray(x.numpy().astype(np.float32)) for name, x in dirty.items()}
    got = fja.attention(arrays["q"], arrays["k"], arrays["v"], mask="padding", cu_seqlens_q=jnp.asarray(cu_q.numpy()),
                        cu_seqlens_kv=jnp.asarray(cu_kv.numpy()))
    np.testing.assert_allclose(np.asarray(got), results[0][0].detach().float().numpy(), rtol=2e-5, atol=2e-6)
