"""Tensors a score_mod reads other than as an added term (score * w[h], a learnable softcap per head) that
require grad: the reference backend gives them their gradient, by its framework's autodiff through its
forward (torch, and JAX under grad, jit(grad) and grad(jit)); backends without one say why. Out and every
gradient against a float64 attention written here, over the steps of a loop that updates them in place."""

from __future__ import annotations

import numpy as np
import pytest
from needs_torch import requires_torch

torch_frontend = requires_torch("the torch frontend")

B, SQ, SKV, H, D = 2, 5, 7, 3, 8

FORMS = {  # name: the score_mod of a (H,) tensor w, in torch and jax.numpy alike (_torch_form/_jax_form: the same)
    "score * w[h]": lambda w: lambda s, b, h, qi, ki: s * w[h],
    "w[h] * tanh(score / w[h])": lambda w: lambda s, b, h, qi, ki: w[h] * _tanh(s / w[h]),
    "score * w[h] + w[h] * (kv - q)": lambda w: lambda s, b, h, qi, ki: s * w[h] + w[h] * (ki - qi),
}


def _tanh(x):
    from fusedattn import score_mods as sm

    return sm.tanh(x)


def _exact_loss(q, k, v, w, grad, form, xp):
    """sum(grad * attention) in float64 with the modified scores, in `xp` (torch or jax.numpy)."""
    scores = xp.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
    if xp.__name__ == "torch":
        import torch

        modified = _torch_form(form)(scores, w)
        out = torch.einsum("bhqk,bkhd->bqhd", modified.softmax(-1), v)
    else:
        import jax

        modified = _jax_form(form)(scores, w)
        out = xp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(modified, axis=-1), v)
    return (out * grad).sum(), out


def _torch_form(form):
    import torch

    return {"score * w[h]": lambda s, w: s * w[None, :, None, None],
            "w[h] * tanh(score / w[h])": lambda s, w: w[None, :, None, None] * torch.tanh(s / w[None, :, None, None]),
            "score * w[h] + w[h] * (kv - q)": lambda s, w: s * w[None, :, None, None] + w[None, :, None, None]
            * (torch.arange(SKV)[None, :] - torch.arange(SQ)[:, None])}[form]


def _jax_form(form):
    import jax.numpy as jnp

    return {"score * w[h]": lambda s, w: s * w[None, :, None, None],
            "w[h] * tanh(score / w[h])": lambda s, w: w[None, :, None, None] * jnp.tanh(s / w[None, :, None, None]),
            "score * w[h] + w[h] * (kv - q)": lambda s, w: s * w[None, :, None, None] + w[None, :, None, None]
            * (jnp.arange(SKV)[None, :] - jnp.arange(SQ)[:, None])}[form]


@torch_frontend
@pytest.mark.parametrize("form", list(FORMS))
def test_torch_reference_gives_the_tensors_their_gradient_over_a_loop(form):
    import torch

    import fusedattn.torch as fat

    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, SQ, H, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, SKV, H, D, generator=gen, dtype=torch.float64) for _ in range(2))
    w = (0.5 + torch.rand(H, generator=gen, dtype=torch.float64)).requires_grad_(True)
    grad = torch.randn(B, SQ, H, D, generator=gen, dtype=torch.float64)
    mod = FORMS[form](w)
    for _step in range(3):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = fat.attention(*leaves, score_mod=mod)
        (out * grad).sum().backward()
        exact = [x.detach().clone().requires_grad_(True) for x in (q, k, v, w)]
        loss, want = _exact_loss(*exact, grad, form, torch)
        loss.backward()
        torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
        for got, ref in zip((*(x.grad for x in leaves), w.grad), (x.grad for x in exact)):
            torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-10)
        with torch.no_grad():  # an optimizer's in-place step: the next call reads the new values
            w.sub_(0.1 * w.grad)
        w.grad = None


@pytest.mark.parametrize("form", list(FORMS))
def test_jax_reference_gives_the_arrays_their_gradient_under_every_transform(form):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fusedattn.jax as fja

    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(3), 5)
        q = jax.random.normal(keys[0], (B, SQ, H, D), jnp.float64)
        k, v = (jax.random.normal(key, (B, SKV, H, D), jnp.float64) for key in keys[1:3])
        w = 0.5 + jax.random.uniform(keys[3], (H,), jnp.float64)
        grad = jax.random.normal(keys[4], (B, SQ, H, D), jnp.float64)

        def loss(q, k, v, w):
            return (fja.attention(q, k, v, score_mod=FORMS[form](w)) * grad).sum()

        want = jax.grad(lambda *x: _exact_loss(*x, grad, form, jnp)[0], argnums=(0, 1, 2, 3))(q, k, v, w)
        for name, transform in (("grad", lambda f: jax.grad(f, argnums=(0, 1, 2, 3))),
                                ("jit(grad)", lambda f: jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))),
                                ("grad(jit)", lambda f: jax.grad(jax.jit(f), argnums=(0, 1, 2, 3)))):
            for got, ref in zip(transform(loss)(q, k, v, w), want):
                np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-9, atol=1e-10, err_msg=name)


@torch_frontend
def test_a_backend_without_their_gradient_says_why():
    """cuDNN (and every backend but the reference) refuses such a call with the reason, so forcing it fails
    clearly and auto-selection moves on; the reference accepts it."""
    import torch

    import fusedattn.torch as fat
    from fusedattn.backends import get_backend

    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    w = torch.rand(2, requires_grad=True)
    text = str(fat.explain(q, q, q, score_mod=lambda s, b, h, i, j: s * w[h]))
    assert "score_mod tensors that require grad" in text and "get no gradient on cudnn" in text, text
    with pytest.raises(Exception, match="get no gradient on cudnn"):
        fat.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * w[h], backend="cudnn")
    assert get_backend("reference").score_mod_gradient and not get_backend("cudnn").score_mod_gradient
    w.requires_grad_(False)  # frozen: every backend may run it again
    assert "get no gradient" not in str(fat.explain(q, q, q, score_mod=lambda s, b, h, i, j: s * w[h]))


def test_jax_params_dict_entry_learns_as_the_array_itself():
    """A callback that reads one entry of a params dict (p['w'][h]) gets the same gradients as one that reads
    the array directly, although the dict also holds differentiated arrays the callback never touches."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fusedattn.jax as fja

    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(5), 4)
        q = jax.random.normal(keys[0], (B, SQ, H, D), jnp.float64)
        w = 0.5 + jax.random.uniform(keys[1], (H,), jnp.float64)
        other = jax.random.normal(keys[2], (4, 4), jnp.float64)
        grad = jax.random.normal(keys[3], (B, SQ, H, D), jnp.float64)

        def through_dict(params, q):
            return (fja.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * params["w"][h]) * grad).sum()

        def direct(w, q):
            return (fja.attention(q, q, q, score_mod=lambda s, b, h, i, j: s * w[h]) * grad).sum()

        want_w, want_q = jax.grad(direct, argnums=(0, 1))(w, q)
        for transform in (jax.grad, lambda f, **kw: jax.jit(jax.grad(f, **kw))):
            got, got_q = transform(through_dict, argnums=(0, 1))({"w": w, "other": other}, q)
            np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want_w), rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(np.asarray(got_q), np.asarray(want_q), rtol=1e-12, atol=1e-12)
            assert not np.asarray(got["other"]).any()


def test_jax_table_made_from_numpy_inside_the_callback_runs_under_jit():
    """jnp.asarray(numpy_table)[h] inside a callback: a constant of the trace, read with traced positions
    under jit as in eager mode."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fusedattn.jax as fja

    table = np.linspace(-1.0, 1.0, H).astype(np.float32)
    q = jax.random.normal(jax.random.key(6), (B, SQ, H, D), jnp.float32)

    def run(q):
        return fja.attention(q, q, q, score_mod=lambda s, b, h, i, j: s + jnp.asarray(table)[h])

    eager, jitted = run(q), jax.jit(run)(q)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, q) * D ** -0.5 + table[None, :, None, None]
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), q)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(want), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(want), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_jax_half_precision_tables_are_traced_and_learn(dtype):
    """A bfloat16 table captured by a score_mod (relative_position_bias, alibi, s + t[h, kv_idx]) was not traced:
    NumPy's floating test says no to ml_dtypes' bfloat16, and the grad was refused as 'read where no gradient
    can reach it'. Now each half dtype learns as float16 did, within its rounding of the float32 gradient."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    import fusedattn.jax as fja
    from fusedattn import score_mods

    half = getattr(jnp, dtype)
    keys = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(keys[0], (1, 5, 2, 8))
    table = jax.random.normal(keys[1], (2, 9))
    cotangent = jax.random.normal(keys[2], (1, 5, 2, 8))
    mods = {"relative_position_bias": lambda t: score_mods.relative_position_bias(t),
            "capture": lambda t: (lambda s, b, h, q_idx, kv_idx: s + t[h, kv_idx])}
    for name, make in mods.items():
        def loss(q, t, make=make):
            return (fja.attention(q, q, q, score_mod=make(t)).astype(jnp.float32) * cotangent).sum()

        want = jax.grad(loss, argnums=1)(q.astype(half).astype(jnp.float32), table.astype(half).astype(jnp.float32))
        for transform in (jax.grad, lambda f, argnums: jax.jit(jax.grad(f, argnums=argnums))):
            got = transform(loss, argnums=1)(q.astype(half), table.astype(half))
            assert got.dtype == half, name
            scale = float(jnp.abs(want).max())
            np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=0.05 * scale, err_msg=name)
