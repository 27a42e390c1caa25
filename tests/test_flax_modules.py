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


def test_a_call_keyword_the_module_left_none_is_taken_as_flax_linen_merge_param_takes_it():
    """scale=, window= at call time raised Python's "got multiple values for keyword argument" (sweep 13)."""
    q, k, v = rand(15, B, S, H, D), rand(16, B, S, 2, D), rand(17, B, S, 2, D)
    module = fj.DotProductAttention(mask="causal")
    params = module.init(jax.random.key(0), q, k, v)
    close(module.apply(params, q, k, v, scale=0.5, window=(1, 0)),
          fj.attention(q, k, v, mask="causal", scale=0.5, window=(1, 0)))
    close(fj.DotProductAttention(scale=0.5).apply({}, q, k, v, scale=None), fj.attention(q, k, v, scale=0.5))
    x = rand(18, B, S, E)
    mha = fj.MultiHeadAttention(num_heads=H, head_dim=D)
    params = mha.init(jax.random.key(1), x)
    assert not np.allclose(np.asarray(mha.apply(params, x, scale=0.05)), np.asarray(mha.apply(params, x)))


@pytest.mark.parametrize("make, keywords, match", [
    (lambda: fj.DotProductAttention(scale=0.5), {"scale": 0.25},
     r"DotProductAttention: scale: expected it once, on the module or at call time, got scale=0.5 on the module "
     r"and scale=0.25 at call time; leave the module's scale None"),
    (lambda: fj.DotProductAttention(window=(2, 0)), {"window": (1, 1)},
     r"DotProductAttention: window: expected it once"),
    (lambda: fj.DotProductAttention(), {"softmax_type": "off_by_one"},
     r"DotProductAttention: softmax_type: expected no softmax_type at call time \(the module sets it: "
     r"DotProductAttention\(softmax_type=...\)\), got softmax_type='off_by_one'"),
    (lambda: fj.DotProductAttention(), {"dropout_p": 0.1}, r"DotProductAttention: dropout_p: expected no dropout_p"),
    (lambda: fj.DotProductAttention(), {"sink": jnp.zeros(H)},
     r"sink: expected no sink at call time .*'sink' parameter.*got sink=jax.Array of shape \(4,\), dtype float32"),
    (lambda: fj.DotProductAttention(), {"dropout_rng": jax.random.key(0)}, r"dropout_rng: .*rngs=\{'dropout': key\}"),
], ids=["scale-twice", "window-twice", "softmax_type", "dropout_p", "sink", "dropout_rng"])
def test_a_call_keyword_the_module_holds_raises_a_type_error_naming_it(make, keywords, match):
    q = rand(19, B, S, H, D)
    with pytest.raises(TypeError, match=match):
        make().apply({}, q, q, q, **keywords)


@pytest.mark.parametrize("make, keywords, match", [
    (lambda: fj.MultiHeadAttention(num_heads=H, head_dim=D, window=(2, 0)), {"window": (1, 0)},
     r"MultiHeadAttention: window: expected it once"),
    (lambda: fj.MultiHeadAttention(num_heads=H, head_dim=D), {"layout": "bshd"},
     r"MultiHeadAttention: layout: expected no layout at call time \(the module sets it: 'bs3hd' or 'bshd_bs2hd'"),
    (lambda: fj.MultiHeadAttention(num_heads=H, head_dim=D), {"softmax_type": "off_by_one"},
     r"MultiHeadAttention: softmax_type: .*MultiHeadAttention\(softmax_type=...\)"),
], ids=["window-twice", "layout", "softmax_type"])
def test_multi_head_attention_names_its_own_fields_given_at_call_time(make, keywords, match):
    with pytest.raises(TypeError, match=match):
        make().init(jax.random.key(0), rand(20, B, S, E), **keywords)


@pytest.mark.parametrize("args, match", [
    (lambda: (rand(21, S, E),), r"MultiHeadAttention: x: expected a 3-D array \(B, S, E\), got shape \(6, 16\)"),
    (lambda: (rand(22, 1, B, S, E),), r"x: expected a 3-D array \(B, S, E\), got shape \(1, 2, 6, 16\)"),
    (lambda: (rand(23, B, S, E), rand(24, 1, 9, E)),
     r"MultiHeadAttention: kv_input: expected a 3-D array \(B, Skv, E_kv\) with x's batch B=2, got shape \(1, 9, 16\)"),
    (lambda: (rand(25, B, S, E), rand(26, 9, E)), r"kv_input: expected a 3-D array .* got shape \(9, 16\)"),
], ids=["x-2d", "x-4d", "kv-batch", "kv-2d"])
def test_multi_head_attention_input_shapes_are_checked_by_name(args, match):
    """A 2-D x or a kv_input of another batch gave a bare reshape error (sweep 13)."""
    module = fj.MultiHeadAttention(num_heads=H, head_dim=D, mask="none")
    with pytest.raises(ValueError, match=match):
        module.init(jax.random.key(0), *args())
