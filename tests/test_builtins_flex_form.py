"""The built-ins written once in flex form: each agrees with its definition written out in float64
(tests/naive.py, the formulas below), in torch and in JAX, forward and every gradient; their masks run
as the backends' own masks (explain shows mask= and window=); a mask stays a mask wherever compose puts
it; a built-in goes with a mask_mod; and one made anew at each call traces nothing new."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from naive import naive_attention

import fusedattn
import fusedattn.jax as fj
import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.score_mods import flex

B, S, H, D = 2, 11, 4, 8  # odd lengths: no tile is whole
GEN = torch.Generator().manual_seed(35)
SLOPES = torch.rand(H, generator=GEN, dtype=torch.float64) + 0.1
BATCH_SLOPES = torch.rand(B, H, generator=GEN, dtype=torch.float64) + 0.1
TABLE = torch.randn(H, 7, generator=GEN, dtype=torch.float64)
IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3], [0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]])
HOST_SLOPES = fusedattn.standard_alibi_slopes(H)


def _where(keep, s):
    return torch.where(torch.as_tensor(keep), s, torch.tensor(-torch.inf, dtype=s.dtype))


# name -> (the built-in, its definition on scalars of one (b, h, q_idx, kv_idx))
DEFINITIONS = {
    "softcap": (lambda: sm.softcap(1.5), lambda s, b, h, i, j: 1.5 * torch.tanh(s / 1.5)),
    "clamp": (lambda: sm.clamp(-0.5, 0.75), lambda s, b, h, i, j: s.clamp(-0.5, 0.75)),
    "causal": (sm.causal, lambda s, b, h, i, j: _where(j <= i, s)),
    "sliding_window": (lambda: sm.sliding_window(3, 1), lambda s, b, h, i, j: _where((i - j >= -1) & (i - j <= 3), s)),
    "window_left_only": (lambda: sm.sliding_window(2, -1), lambda s, b, h, i, j: _where(i - j <= 2, s)),
    "window_right_only": (lambda: sm.sliding_window(-1, 2), lambda s, b, h, i, j: _where(j - i <= 2, s)),
    "alibi": (lambda: sm.alibi(SLOPES.float()), lambda s, b, h, i, j: s - SLOPES.float()[h].double() * abs(i - j)),
    "alibi_batched": (lambda: sm.alibi(BATCH_SLOPES.float()),
                      lambda s, b, h, i, j: s - BATCH_SLOPES.float()[b, h].double() * abs(i - j)),
    "alibi_host_slopes": (lambda: sm.alibi(HOST_SLOPES),
                          lambda s, b, h, i, j: s - torch.tensor(HOST_SLOPES, dtype=torch.float32)[h].double()
                          * abs(i - j)),
    "relative_position_bias": (lambda: sm.relative_position_bias(TABLE),
                               lambda s, b, h, i, j: s + TABLE[h, (j - i).clamp(-3, 3) + 3]),
    "document_mask": (lambda: sm.document_mask(IDS), lambda s, b, h, i, j: _where(IDS[b, i] == IDS[b, j], s)),
    "softcap_then_causal": (lambda: sm.compose(sm.softcap(1.5), sm.causal()),
                            lambda s, b, h, i, j: _where(j <= i, 1.5 * torch.tanh(s / 1.5))),
    "causal_then_softcap": (lambda: sm.compose(sm.causal(), sm.softcap(1.5)),  # the mask stays a mask
                            lambda s, b, h, i, j: _where(j <= i, 1.5 * torch.tanh(s / 1.5))),
    "alibi_window_softcap": (lambda: sm.compose(sm.alibi(SLOPES.float()), sm.sliding_window(4, 0), sm.softcap(2.0)),
                             lambda s, b, h, i, j: _where((i - j >= 0) & (i - j <= 4),
                                                          2.0 * torch.tanh((s - SLOPES.float()[h].double()
                                                                            * abs(i - j)) / 2.0))),
}


def _inputs(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, S, H, D, generator=gen, dtype=torch.float64) * 1.5 for _ in range(3)]


def _want(leaves, definition):
    leaves = [x.detach().clone().requires_grad_(True) for x in leaves]
    out, _, _ = naive_attention(*leaves, score_mod=definition)
    return leaves, out


def _cotangent(out):
    return torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_torch_matches_the_definition_forward_and_gradients(name):
    make, definition = DEFINITIONS[name]
    leaves, want = _want(_inputs(1), definition)
    want_grads = torch.autograd.grad(want, leaves, _cotangent(want))
    mine = [x.detach().clone().requires_grad_(True) for x in leaves]
    out = fat.attention(*mine, score_mod=make())
    torch.testing.assert_close(out, want)
    for got, expected in zip(torch.autograd.grad(out, mine, _cotangent(out)), want_grads):
        torch.testing.assert_close(got, expected)


def _to_jax(name: str, mod):
    """The same built-in over JAX arrays (its tensors converted; numbers and host slopes as they are)."""
    swap = {"alibi": lambda: sm.alibi(jnp.asarray(SLOPES.float().numpy())),
            "alibi_batched": lambda: sm.alibi(jnp.asarray(BATCH_SLOPES.float().numpy())),
            "relative_position_bias": lambda: sm.relative_position_bias(jnp.asarray(TABLE.numpy())),
            "document_mask": lambda: sm.document_mask(jnp.asarray(IDS.numpy())),
            "alibi_window_softcap": lambda: sm.compose(sm.alibi(jnp.asarray(SLOPES.float().numpy())),
                                                       sm.sliding_window(4, 0), sm.softcap(2.0))}
    return swap[name]() if name in swap else mod


@pytest.mark.parametrize("name", list(DEFINITIONS))
def test_jax_matches_the_definition_forward_and_gradients(name):
    make, definition = DEFINITIONS[name]
    leaves, want = _want(_inputs(2), definition)
    want_grads = torch.autograd.grad(want, leaves, _cotangent(want))
    mod = _to_jax(name, make())
    with jax.enable_x64(True):
        arrays = [jnp.asarray(x.detach().numpy()) for x in leaves]
        cotangent = jnp.asarray(_cotangent(want).numpy())

        def loss(q, k, v):
            return jnp.sum(fj.attention(q, k, v, score_mod=mod) * cotangent)

        out = fj.attention(*arrays, score_mod=mod)
        grads = jax.grad(loss, argnums=(0, 1, 2))(*arrays)
    np.testing.assert_allclose(np.asarray(out), want.detach().numpy(), rtol=1e-6, atol=1e-7)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), expected.numpy(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mod, shown", [
    (sm.causal(), "mask=causal"), (sm.sliding_window(3, 0), "window=(3, 0)"),
    (sm.compose(sm.softcap(2.0), sm.causal()), "mask=causal"),
    (sm.compose(sm.causal(), sm.alibi(torch.rand(H))), "mask=causal"),
], ids=["causal", "window", "softcap-then-causal", "causal-then-alibi"])
def test_masks_run_as_the_backends_own(mod, shown):
    q = torch.randn(B, 64, H, D)
    config = fat.explain(q, q, q, score_mod=mod).splitlines()[0]
    assert shown in config, config
    assert "mask=none" not in config


def test_a_built_in_goes_with_a_mask_mod_and_both_apply():
    leaves = _inputs(3)
    got = fat.attention(*leaves, score_mod=sm.softcap(1.5), mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    want = fat.attention(*leaves, score_mod=sm.compose(sm.softcap(1.5), sm.causal()))
    torch.testing.assert_close(got, want)
    masked_twice = fat.attention(*leaves, score_mod=sm.sliding_window(2, 0),
                                 mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    torch.testing.assert_close(masked_twice, fat.attention(*leaves, score_mod=sm.sliding_window(2, 0)))


def test_built_ins_made_anew_at_each_call_trace_nothing_new(monkeypatch):
    traced = []
    real = flex._trace_now
    monkeypatch.setattr(flex, "_trace_now", lambda *args: traced.append(args) or real(*args))
    leaves = _inputs(4)
    slopes = torch.rand(H)
    for _ in range(3):
        fat.attention(*leaves, score_mod=sm.compose(sm.alibi(slopes), sm.softcap(2.0), sm.causal()))
        fat.attention(*leaves, score_mod=sm.softcap(3.0))
    assert len(traced) == 2, traced


def test_a_built_ins_function_is_a_flex_function_anywhere():
    """The functions a built-in is made of run as they are: here on torch numbers, as FlexAttention
    would call them, and on JAX arrays."""
    score_mod, mask_mod = sm.compose(sm.alibi([0.5, 0.25]), sm.softcap(2.0), sm.causal()).flex
    s, b, h, i, j = torch.tensor(1.0), torch.tensor(0), torch.tensor(1), torch.tensor(5), torch.tensor(2)
    assert float(score_mod(s, b, h, i, j)) == pytest.approx(2.0 * np.tanh((1.0 - 0.25 * 3) / 2.0))
    assert bool(mask_mod(b, h, i, j)) and not bool(mask_mod(b, h, j, i))
    assert float(score_mod(jnp.float32(1.0), jnp.int32(0), jnp.int32(1), jnp.int32(5), jnp.int32(2))) == \
        pytest.approx(2.0 * np.tanh((1.0 - 0.25 * 3) / 2.0), rel=1e-6)


def test_a_built_ins_numbers_are_its_own():
    with pytest.raises(TypeError):
        sm.softcap(2.0).tensors["cap"] = 3.0


_LIMIT = [5]


def _below_limit(b, h, q_idx, kv_idx):  # reads a global list that the test changes between calls
    return q_idx < _LIMIT[0]


def test_what_a_built_ins_function_reads_is_fixed_but_a_joined_mask_mod_of_yours_is_not():
    from fusedattn.score_mods.builtins import flex_keywords

    composed = sm.compose(sm.alibi(torch.rand(H)), sm.softcap(2.0), sm.sliding_window(3, 0))
    assert all(flex.fixed_reads(fn) for fn in composed.flex)
    joined = flex_keywords({"score_mod": sm.causal(), "mask_mod": _below_limit})["mask_mod"]
    assert not flex.fixed_reads(joined)
    leaves = _inputs(5)
    first = fat.attention(*leaves, score_mod=sm.causal(), mask_mod=_below_limit)
    _LIMIT[0] = 8
    try:
        second = fat.attention(*leaves, score_mod=sm.causal(), mask_mod=_below_limit)
    finally:
        _LIMIT[0] = 5
    want = fat.attention(*leaves, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx < 8) & (kv_idx <= q_idx))
    torch.testing.assert_close(second, want)
    assert not torch.allclose(first, second)
