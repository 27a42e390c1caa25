"""Regression tests for the wrong results of issue 12 ("never silently wrong"), the CPU parts.

Each case once returned plausible wrong numbers (or crashed with an internal message); each test
shows the call now either gives the right answer, NaN where the values could not be checked, a
refusal with the reason, or a ValueError naming the argument.
"""

from __future__ import annotations

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
