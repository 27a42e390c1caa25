"""Flax linen modules: init, apply and grad on the CPU (reference backend), against the functional API."""

from __future__ import annotations

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("flax")
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fusedattn.jax as fj  # noqa: E402

B, S, E, H, D = 2, 6, 16, 4, 8


def rand(seed, *shape):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def test_dot_product_attention_is_the_functional_call_and_owns_the_sink():
    q, k, v = rand(1, B, S, H, D), rand(2, B, S, 2, D), rand(3, B, S, 2, D)
    module = fj.DotProductAttention(mask="causal", softmax_type="learnable", num_heads=H)
    params = module.init(jax.random.key(0), q, k, v)
    assert params["params"]["sink"].shape == (H,)
    sink = jnp.linspace(-1.0, 1.0, H)
    out = module.apply({"params": {"sink": sink}}, q, k, v)
    close(out, fj.attention(q, k, v, mask="causal", softmax_type="learnable", sink=sink))
    grads = jax.grad(lambda p: module.apply(p, q, k, v).sum())({"params": {"sink": sink}})
    assert np.abs(np.asarray(grads["params"]["sink"])).sum() > 0


def test_dropout_follows_deterministic_and_the_dropout_rng():
    q, k, v = rand(4, B, S, H, D), rand(5, B, S, H, D), rand(6, B, S, H, D)
    module = fj.DotProductAttention(dropout_p=0.5)
    params = module.init(jax.random.key(0), q, k, v)
    plain = module.apply(params, q, k, v)  # deterministic=True by default: no dropout
    close(plain, fj.attention(q, k, v))
    one = module.apply(params, q, k, v, deterministic=False, rngs={"dropout": jax.random.key(7)})
    again = module.apply(params, q, k, v, deterministic=False, rngs={"dropout": jax.random.key(7)})
    other = module.apply(params, q, k, v, deterministic=False, rngs={"dropout": jax.random.key(8)})
    close(one, again)
    assert not np.allclose(np.asarray(one), np.asarray(plain)) and not np.allclose(np.asarray(one), np.asarray(other))


def _split_fused(params, heads, kv_heads):
    """The unfused module's parameters holding the same weights as a fused QKV projection."""
    kernel = params["params"]["qkv"]["kernel"]
    q_end, k_end = heads * D, heads * D + kv_heads * D
    inner = {"query": {"kernel": kernel[:, :q_end]}, "key": {"kernel": kernel[:, q_end:k_end]},
             "value": {"kernel": kernel[:, k_end:]}, "out": params["params"]["out"]}
    return {"params": inner}


@pytest.mark.parametrize("kv_heads", [H, 2, 1], ids=["mha_bs3hd", "gqa_bshd_bs2hd", "mqa"])
def test_fused_qkv_projection_equals_separate_projections(kv_heads):
    x = rand(9, B, S, E)
    fused = fj.MultiHeadAttention(num_heads=H, head_dim=D, num_kv_heads=kv_heads, mask="causal")
    separate = fj.MultiHeadAttention(num_heads=H, head_dim=D, num_kv_heads=kv_heads, mask="causal", fused_qkv=False)
    params = fused.init(jax.random.key(1), x)
    out = fused.apply(params, x)
    assert out.shape == (B, S, E)
    close(out, separate.apply(_split_fused(params, H, kv_heads), x))
    grads = jax.grad(lambda p: (fused.apply(p, x) ** 2).sum())(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_cross_attention_projects_the_kv_input():
    x, memory = rand(10, B, S, E), rand(11, B, 9, E)
    module = fj.MultiHeadAttention(num_heads=H, head_dim=D, num_kv_heads=2, mask="none")
    params = module.init(jax.random.key(2), x, memory)
    assert set(params["params"]) == {"query", "key", "value", "out"}
    assert module.apply(params, x, memory).shape == (B, S, E)


@pytest.mark.parametrize("layernorm", ["pre", "post"])
def test_transformer_layer_trains(layernorm):
    x, target = rand(12, B, S, E), rand(13, B, S, E)
    layer = fj.TransformerLayer(hidden_size=E, num_heads=H, num_kv_heads=2, layernorm=layernorm,
                                attention_dropout=0.1, hidden_dropout=0.1)
    params = layer.init(jax.random.key(3), x)

    @jax.jit
    def step(params, key):
        def loss(p):
            out = layer.apply(p, x, deterministic=False, rngs={"dropout": key})
            return ((out - target) ** 2).mean()

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)

    losses = []
    for i in range(30):
        value, params = step(params, jax.random.key(100 + i))
        losses.append(float(value))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("make,match", [
    (lambda: fj.MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=3),
     "MultiHeadAttention: num_kv_heads: expected a divisor"),
    (lambda: fj.TransformerLayer(hidden_size=E, num_heads=4, layernorm="middle"),
     "TransformerLayer: layernorm: expected 'pre'"),
    (lambda: fj.TransformerLayer(hidden_size=E + 1, num_heads=4),
     "TransformerLayer: hidden_size: expected a multiple of num_heads=4"),
    (lambda: fj.DotProductAttention(softmax_type="learnable"), "DotProductAttention: num_heads"),
])
def test_bad_module_settings_raise_clear_errors_when_constructed(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_input_not_matching_the_module_raises_when_called():
    layer = fj.TransformerLayer(hidden_size=E + 4, num_heads=4)  # valid settings, wrong input width
    with pytest.raises(ValueError, match="expected a last axis of hidden_size"):
        layer.init(jax.random.key(0), rand(14, B, S, E))


def test_a_modules_mask_or_layout_is_overridden_only_by_a_value_not_by_an_empty_string():
    """mask="" (or layout="") fell back to the module's; they are bad values, refused as attention refuses them."""
    module = fj.DotProductAttention(mask="causal")
    x = jnp.ones((1, 4, 2, 8))
    params = module.init(jax.random.key(0), x, x, x)
    for name in ("mask", "layout"):
        with pytest.raises(ValueError, match=f"{name}: expected one of .*got ''"):
            module.apply(params, x, x, x, **{name: ""})
