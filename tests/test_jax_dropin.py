"""fusedattn.jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla").

Same inputs, same arguments: float32 forward (tight), bfloat16 forward (error against a float32
jax.nn run within a small multiple of jax.nn's own bfloat16 error), gradients of query, key,
value and bias under jax.jit; jax.nn's input errors are ours too. Also the JAX frontend's errors
for torch tensors and bad dropout keys (named, never printed).
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from needs_torch import requires_torch  # noqa: E402

import fusedattn.jax as fj  # noqa: E402
from fusedattn.jax import dropin  # noqa: E402

B, N, H = 2, 4, 8


def _lengths(*values):
    return jnp.array(values, jnp.int32)


def _mask(shape, seed=7, p=0.6):
    m = np.array(jax.random.bernoulli(jax.random.key(seed), p, shape))
    m[..., 0, :] = False  # one fully masked row (where the shape has rows)
    return jnp.asarray(m)


def _bias(shape, seed=8):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


# (id, T, S, K, keywords); bias/mask are shapes filled in by _case (keyword "bias"/"mask").
CASES = [
    ("plain-T<S", 3, 5, N, {}),
    ("plain-T>S-scale", 6, 4, N, {"scale": 0.3}),
    ("gqa", 4, 5, 2, {}),
    ("mqa-causal-T<S", 3, 6, 1, {"is_causal": True}),
    ("causal-T>S", 6, 4, 2, {"is_causal": True}),
    ("bias-BNTS", 3, 5, 2, {"bias": (B, N, 3, 5)}),
    ("bias-1NTS", 3, 5, N, {"bias": (1, N, 3, 5)}),
    ("bias-TS", 4, 5, 2, {"bias": (4, 5)}),
    ("bias-11T1", 4, 5, N, {"bias": (1, 1, 4, 1)}),
    ("mask-B1TS", 3, 5, N, {"mask": (B, 1, 3, 5)}),
    ("mask-1NTS-gqa", 5, 3, 2, {"mask": (1, N, 5, 3)}),
    ("mask-11T1", 4, 5, N, {"mask": (1, 1, 4, 1)}),
    ("mask-bias-causal", 5, 4, 2, {"mask": (B, 1, 5, 4), "bias": (1, N, 5, 4), "is_causal": True}),
    ("kv-lengths-zero", 3, 5, N, {"key_value_seq_lengths": (0, 3)}),
    ("lengths-causal", 4, 6, N, {"query_seq_lengths": (3, 0), "key_value_seq_lengths": (2, 6), "is_causal": True}),
    ("lengths-window", 5, 4, N, {"query_seq_lengths": (4, 2), "key_value_seq_lengths": (3, 4),
                                 "local_window_size": (1, 2)}),
    ("lengths-mask", 4, 4, N, {"key_value_seq_lengths": (1, 4), "mask": (B, N, 4, 4)}),
    ("window-int-T<S", 3, 6, N, {"local_window_size": 1}),
    ("window-int-T>S", 7, 4, 2, {"local_window_size": 1}),
    ("window-left-T>S", 6, 4, N, {"local_window_size": (2, 0)}),
    ("window-causal", 5, 5, N, {"local_window_size": (1, 3), "is_causal": True}),
    ("window-negative", 4, 6, N, {"local_window_size": (-1, 3)}),
    ("window-bias", 4, 5, N, {"local_window_size": (2, 1), "bias": (B, N, 4, 5)}),
]


def _case(t, s, k, options, dtype=jnp.float32, three_d=False):
    keys = jax.random.split(jax.random.key(t * 100 + s * 10 + k), 3)
    batch = () if three_d else (B,)
    q = jax.random.normal(keys[0], (*batch, t, N, H), jnp.float32).astype(dtype)
    kk = jax.random.normal(keys[1], (*batch, s, k, H), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (*batch, s, k, H), jnp.float32).astype(dtype)
    kwargs = dict(options)
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kwargs:
            kwargs[name] = _lengths(*kwargs[name])
    if "mask" in kwargs:
        kwargs["mask"] = _mask(kwargs["mask"])
    if "bias" in kwargs:
        kwargs["bias"] = _bias(kwargs["bias"]).astype(dtype)
    return q, kk, v, kwargs


def _both(q, k, v, kwargs):
    ours = fj.dot_product_attention(q, k, v, **kwargs)
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    return ours, theirs


def _jax_nn(*args, **kwargs):
    return jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)


GRAD_CASES = {"gqa", "causal-T>S", "bias-1NTS", "bias-11T1", "mask-bias-causal", "lengths-causal", "lengths-window",
              "window-int-T>S", "window-negative", "window-bias"}


@pytest.mark.parametrize("t, s, k, options", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_float32_forward_and_gradients(request, t, s, k, options):
    q, kk, v, kwargs = _case(t, s, k, options)
    # Under jit, arguments closed over (concrete): eager JAX compiles every op on CPU.
    ours, theirs = jax.jit(lambda *a: (fj.dot_product_attention(*a, **kwargs), _jax_nn(*a, **kwargs)))(q, kk, v)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    if request.node.callspec.id not in GRAD_CASES:
        return

    bias = kwargs.pop("bias", None)
    cotangent = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def grads(fn, *args):
        def loss(q, k, v, bias):
            out = fn(q, k, v, bias, **kwargs) if bias is not None else fn(q, k, v, **kwargs)
            return jnp.sum(out * cotangent)
        return jax.grad(loss, argnums=argnums)(*args)

    # One compiled program for both: JAX compiles slowly on CPU.
    ours, theirs = jax.jit(lambda *a: (grads(fj.dot_product_attention, *a), grads(_jax_nn, *a)))(q, kk, v, bias)
    for name, a, b in zip("q k v bias".split(), ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=f"gradient of {name}")


BF16_CASES = [c for c in CASES if c[0] in ("gqa", "mask-bias-causal", "lengths-causal", "window-bias")]


@pytest.mark.parametrize("t, s, k, options", [c[1:] for c in BF16_CASES], ids=[c[0] for c in BF16_CASES])
def test_bfloat16_forward(t, s, k, options):
    q, kk, v, kwargs = _case(t, s, k, options, dtype=jnp.bfloat16)
    ours, theirs = _both(q, kk, v, kwargs)
    assert ours.dtype == theirs.dtype == jnp.bfloat16
    up = {n: x.astype(jnp.float32) if n == "bias" else x for n, x in kwargs.items()}
    truth = jax.nn.dot_product_attention(*(x.astype(jnp.float32) for x in (q, kk, v)), implementation="xla", **up)
    ours_err = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - truth)))
    theirs_err = float(jnp.max(jnp.abs(theirs.astype(jnp.float32) - truth)))
    assert ours_err <= 2 * theirs_err + 1e-2, (ours_err, theirs_err)


def test_three_d_form_under_jit():
    q, k, v, kwargs = _case(5, 4, 2, {"is_causal": True, "local_window_size": 2}, three_d=True)
    kwargs["bias"] = _bias((N, 5, 4))
    ours = jax.jit(lambda *a: fj.dot_product_attention(*a, **kwargs))(q, k, v)
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    assert ours.shape == q.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_traced_lengths_and_mask_under_jit():
    q, k, v, kwargs = _case(4, 6, 2, {"key_value_seq_lengths": (0, 5), "query_seq_lengths": (4, 3),
                                      "mask": (B, 1, 4, 6), "local_window_size": (1, 1)})
    ours = jax.jit(lambda q, k, v, kv, ql, m: fj.dot_product_attention(
        q, k, v, mask=m, key_value_seq_lengths=kv, query_seq_lengths=ql, local_window_size=(1, 1)))(
        q, k, v, kwargs["key_value_seq_lengths"], kwargs["query_seq_lengths"], kwargs["mask"])
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_fully_masked_rows_give_the_mean_of_value_as_jax_nn():
    q, k, v, kwargs = _case(3, 5, N, {"mask": (B, 1, 3, 5)})
    ours, theirs = _both(q, k, v, kwargs)
    np.testing.assert_allclose(ours[:, 0], jnp.broadcast_to(v.mean(axis=1), ours[:, 0].shape), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def _spy(monkeypatch):
    seen = {}
    original = dropin.attention

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(dropin, "attention", spy)
    return seen


@pytest.mark.parametrize("t, s, options, mask, window, has_bias", [
    (4, 6, {"is_causal": True}, "causal", None, False),
    (6, 4, {"is_causal": True, "local_window_size": (2, 5)}, "causal", (2, 0), False),
    (6, 4, {"local_window_size": (2, 0)}, "causal", (2, 0), False),
    (3, 6, {"local_window_size": (1, 4)}, "none", (4, 1), False),  # bottom-right: shifted by S - T = 3
    (4, 4, {"key_value_seq_lengths": (1, 4), "is_causal": True}, "padding_causal", None, False),
    (4, 4, {"key_value_seq_lengths": (1, 4), "local_window_size": 1}, "padding", None, True),
    (6, 4, {"local_window_size": 1}, "none", None, True),  # bottom-right would need left = -1
], ids=["causal", "causal-window", "right0-is-causal", "window-bottom-right", "padding-causal",
        "padding-window-as-bias", "window-as-bias"])
def test_translation_uses_native_masks(monkeypatch, ran, t, s, options, mask, window, has_bias):
    seen = _spy(monkeypatch)
    q, k, v, kwargs = _case(t, s, N, options)
    ours, theirs = _both(q, k, v, kwargs)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert (seen["mask"], seen["window"], seen["bias"] is not None) == (mask, window, has_bias)
    assert {name for name, _, _ in ran} == {"reference"}


def test_implementation(monkeypatch):
    seen = _spy(monkeypatch)
    q, k, v, _ = _case(3, 3, N, {})
    fj.dot_product_attention(q, k, v, implementation="xla")
    assert seen["backend"] == "reference"
    fj.dot_product_attention(q, k, v)
    assert seen["backend"] is None
    with pytest.raises(ValueError, match="cudnn"):  # forced, and no GPU here: its reasons raise
        fj.dot_product_attention(q, k, v, implementation="cudnn")
    assert seen["backend"] == "cudnn"
    with pytest.raises(ValueError, match="implementation: expected None, 'xla' or 'cudnn', got 'flash'"):
        fj.dot_product_attention(q, k, v, implementation="flash")
    with pytest.raises(ValueError):
        jax.nn.dot_product_attention(q, k, v, implementation="flash")


def _bad_inputs():
    x = jnp.zeros((B, 4, N, H))
    kv3 = jnp.zeros((B, 4, 3, H))
    return {
        "heads-not-multiple": ((x, kv3, kv3), {}),
        "query-rank-5": ((x[None], x, x), {}),
        "key-rank-5": ((x, x[None], x[None]), {}),
        "value-shape": ((x, x, x[:, :3]), {}),
        "value-dtype": ((x, x, x.astype(jnp.bfloat16)), {}),
        "head-dim": ((x[..., :4], x, x), {}),
        "batch": ((x[:1], x, x), {}),
        "mask-dtype": ((x, x, x), {"mask": jnp.ones((4, 4), jnp.float32)}),
        "mask-rank-5": ((x, x, x), {"mask": jnp.ones((1, 1, 1, 4, 4), bool)}),
        "bias-rank-5": ((x, x, x), {"bias": jnp.ones((1, 1, 1, 4, 4))}),
        "lengths-dtype": ((x, x, x), {"key_value_seq_lengths": jnp.array([1.0, 2.0])}),
        "lengths-shape": ((x, x, x), {"query_seq_lengths": jnp.array([1, 2, 3], jnp.int32)}),
    }


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_errors_as_jax_nn(name):
    args, kwargs = _bad_inputs()[name]
    with pytest.raises(ValueError):
        jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)
    with pytest.raises(ValueError, match="fusedattn.jax.dot_product_attention: "):
        fj.dot_product_attention(*args, **kwargs)


@pytest.mark.parametrize("scale", [0.0, -0.5, float("nan")])
def test_a_scale_that_is_not_positive_is_refused_in_the_drop_ins_name(scale):
    """jax.nn takes it; fusedattn refuses it (its docstring says so), naming dot_product_attention, not the
    attention call inside."""
    x = jax.random.normal(jax.random.key(2), (B, 4, N, H))
    with pytest.raises(ValueError, match=r"fusedattn.jax.dot_product_attention: scale: expected a finite float > 0"):
        fj.dot_product_attention(x, x, x, scale=scale)


def test_bias_heads_neither_one_nor_n():
    x = jnp.zeros((B, 4, N, H))
    with pytest.raises(ValueError, match=r"bias: expected a shape broadcastable to \(B, N, T, S\)"):
        fj.dot_product_attention(x, x, x, bias=jnp.zeros((1, 3, 4, 4)))


gives_a_torch_tensor = requires_torch("gives the JAX frontend a torch tensor")


@gives_a_torch_tensor
def test_torch_tensors_are_named_not_printed():
    import torch

    x = jnp.zeros((1, 4, 2, 8))
    t = torch.ones(1, 4, 2, 8)
    with pytest.raises(ValueError) as info:
        fj.attention(t, x, x)
    assert str(info.value).startswith("fusedattn.jax.attention: q: expected a JAX array, got torch.Tensor")
    assert "tensor(" not in str(info.value) and "1., 1." not in str(info.value)
    with pytest.raises(ValueError, match="fusedattn.jax.attention: v: expected a JAX array, got torch.Tensor"):
        fj.attention(x, x, t)
    with pytest.raises(ValueError, match="fusedattn.jax.dot_product_attention: key: expected a JAX array, "
                                         "got torch.Tensor"):
        fj.dot_product_attention(x, t, x)


@pytest.mark.parametrize("rng, got", [
    (123, "got int"),
    ("key", "got str"),
    (np.ones((2,), np.float32), "got numpy.ndarray of shape (2,), dtype float32"),
    (jnp.ones((3, 4)), "got jax.Array of shape (3, 4), dtype float32"),
    (jax.random.split(jax.random.key(0), 3), "got jax.Array of shape (3,), dtype key<fry>"),
    pytest.param("torch", "got torch.Tensor", marks=gives_a_torch_tensor),
], ids=["int", "str", "numpy-float", "float-array", "batched-keys", "torch"])
def test_bad_dropout_rng_is_named_not_printed(rng, got):
    if isinstance(rng, str) and rng == "torch":
        import torch

        rng = torch.ones(2)
    x = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError) as info:
        fj.attention(x, x, x, dropout_p=0.1, dropout_rng=rng)
    message = str(info.value)
    assert message.startswith("fusedattn.jax.attention: dropout_rng: expected a jax.random key "
                              "(jax.random.key(...), or a legacy jax.random.PRNGKey), ")
    assert message.endswith(got), message
    assert len(message) < 200


def test_good_dropout_rngs_still_run():
    x = jnp.ones((1, 4, 2, 8))
    for rng in (jax.random.key(1), jax.random.PRNGKey(1)):
        assert fj.attention(x, x, x, dropout_p=0.1, dropout_rng=rng).shape == x.shape


@pytest.mark.parametrize("options, rank", [({}, 4), ({}, 3), ({"is_causal": True}, 4),
                                           ({"local_window_size": (1, 0)}, 4),
                                           ({"key_value_seq_lengths": [0, 3], "query_seq_lengths": [2, 3]}, 4),
                                           ({"mask": "row 1 of batch 0 masked"}, 4)], ids=str)
def test_return_residual_is_jax_nns_log_sum_exp(options, rank):
    """return_residual gives jax.nn's (B, T, N) log-sum-exp, its masked logit in rows without keys."""
    q = jax.random.normal(jax.random.key(0), (2, 3, 4, 8))
    k = jax.random.normal(jax.random.key(1), (2, 5, 2, 8))
    options = dict(options)
    if "mask" in options:
        options["mask"] = jnp.ones((1, 1, 3, 5), bool).at[0, 0, 1].set(False)
    options = {name: jnp.asarray(x, jnp.int32) if isinstance(x, list) else x for name, x in options.items()}
    if rank == 3:
        q, k = q[0], k[0]
    want_out, want = jax.nn.dot_product_attention(q, k, k, return_residual=True, **options)
    out, residual = fj.dot_product_attention(q, k, k, return_residual=True, **options)
    assert residual.shape == want.shape and residual.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(residual), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_the_residual_passes_no_gradient_as_jax_nns():
    """jax.nn stops the residual's gradient; a loss that reads it gave other gradients through the drop-in."""
    q = jax.random.normal(jax.random.key(0), (1, 3, 2, 8))
    k = jax.random.normal(jax.random.key(1), (1, 5, 2, 8))

    def loss(fn):
        def of(q, k):
            out, residual = fn(q, k, k, return_residual=True)
            return (out ** 2).sum() + 3.0 * residual.sum()
        return jax.grad(of, argnums=(0, 1))

    for got, want in zip(loss(fj.dot_product_attention)(q, k), loss(jax.nn.dot_product_attention)(q, k)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_shape, kv_shape", [((0, 4, 2, 8), (0, 5, 2, 8)), ((2, 0, 2, 8), (2, 5, 2, 8)),
                                               ((2, 4, 0, 8), (2, 5, 0, 8))])
def test_empty_batches_queries_and_heads_answer_an_empty_array(q_shape, kv_shape):
    """They raised ("batch: expected an integer >= 1"); jax.nn answers an empty array (with no heads it divides
    by zero itself)."""
    q, k = jnp.ones(q_shape), jnp.ones(kv_shape)
    out, residual = fj.dot_product_attention(q, k, k, return_residual=True)
    assert out.shape == q_shape and residual.shape == q_shape[:-1]
    assert jax.grad(lambda q: fj.dot_product_attention(q, k, k).sum())(q).shape == q_shape


@pytest.mark.parametrize("mask, num_sequences", [("none", 2), ("causal", 2), ("padding", 1), ("padding", 2)])
def test_segment_ids_on_a_padded_layout_are_refused_by_name(mask, num_sequences):
    """They were taken for cu_seqlens: errors about cu_seqlens the call never passed, or with mask='padding'
    and num_sequences=B a run that read the ids as per-row lengths (sweep 9)."""
    import fusedattn.jax as fj

    q = jnp.ones((2, 5, 4, 8), jnp.float32)
    ids = jnp.asarray([0, 0, 0, 1, 1], jnp.int32)
    with pytest.raises(ValueError, match=r"segment_ids_q/kv: expected None for layout 'bshd'.*packed layout"):
        fj.attention(q, q, q, mask=mask, segment_ids_q=ids, segment_ids_kv=ids, num_sequences=num_sequences)


def test_local_window_size_takes_numpy_and_jax_integer_scalars_as_jax_nn():
    """(np.int32(2), np.int32(1)) was refused as 'not a pair of ints'; jax.nn takes it (sweep 13)."""
    q, k, v, _ = _case(5, 6, N, {})
    want = _jax_nn(q, k, v, local_window_size=(2, 1))
    for window in ((np.int32(2), np.int32(1)), [np.int64(2), jnp.int32(1)], (jnp.asarray(2), 1)):
        np.testing.assert_allclose(fj.dot_product_attention(q, k, v, local_window_size=window), want,
                                   rtol=1e-5, atol=1e-5, err_msg=repr(window))
    np.testing.assert_allclose(fj.dot_product_attention(q, k, v, local_window_size=np.int64(1)),
                               _jax_nn(q, k, v, local_window_size=1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [True, np.bool_(True), (True, 1), 2.0, (np.float32(2), 1), (1, jnp.float32(1)),
                                    (1, 2, 3), (2,), jnp.asarray([2, 1])], ids=repr)
def test_local_window_size_refuses_floats_bools_and_other_shapes_by_name(window):
    q, k, v, _ = _case(3, 3, N, {})
    with pytest.raises(ValueError, match=r"local_window_size: expected an int or a \(left, right\) pair of ints "
                                         r"\(Python or NumPy integers, or concrete JAX integer scalars\), got "):
        fj.dot_product_attention(q, k, v, local_window_size=window)


def test_a_traced_local_window_size_is_refused_by_name():
    q, k, v, _ = _case(3, 3, N, {})
    with pytest.raises(ValueError, match=r"local_window_size: expected a value known when tracing .* static"):
        jax.jit(lambda w: fj.dot_product_attention(q, k, v, local_window_size=(w, 1)))(jnp.int32(1))


def test_rows_without_keys_take_the_mean_of_value_in_float64_for_float64_inputs():
    """The mean was taken in float32: errors of 1e-8 where float64 gives 1e-16 (sweep 13)."""
    with jax.enable_x64(True):
        q, k, v = (jax.random.normal(jax.random.key(i), (2, 4, 2, 8), jnp.float64) for i in range(3))
        out = fj.dot_product_attention(q, k, v, key_value_seq_lengths=_lengths(0, 4))
        assert out.dtype == jnp.float64
        exact = np.asarray(v, np.float64)[0].mean(axis=0)  # (K, H): every query of batch 0
        np.testing.assert_allclose(np.asarray(out[0]), np.broadcast_to(exact, out[0].shape), rtol=0, atol=1e-14)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bfloat16", "float16"])
def test_the_residual_has_the_inputs_dtype_as_jax_nns(dtype):
    """It was float32 for every input dtype; jax.nn casts its log-sum-exp to the inputs' dtype (sweep 13)."""
    q = jax.random.normal(jax.random.key(0), (2, 3, 4, 8)).astype(dtype)
    k = jax.random.normal(jax.random.key(1), (2, 5, 2, 8)).astype(dtype)
    options = {"key_value_seq_lengths": _lengths(0, 3)}  # batch 0 sees no key: jax.nn's masked logit, cast
    _, want = jax.nn.dot_product_attention(q, k, k, return_residual=True, **options)
    _, residual = fj.dot_product_attention(q, k, k, return_residual=True, **options)
    assert residual.dtype == want.dtype == dtype
    np.testing.assert_allclose(np.asarray(residual, np.float32), np.asarray(want, np.float32), rtol=1e-2)
    _, empty = fj.dot_product_attention(q[:, :0], k, k, return_residual=True)
    assert empty.dtype == dtype


def test_a_concrete_array_scale_runs_as_jax_nn_takes_it():
    """scale=1 / jnp.sqrt(d) is how JAX code writes it; a traced scale (jit) is refused by name."""
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 6, 3, 8)) for i in range(3))
    want = fj.dot_product_attention(q, k, v, scale=float(1 / np.sqrt(8.0)))
    np.testing.assert_allclose(fj.dot_product_attention(q, k, v, scale=1 / jnp.sqrt(8.0)), want, rtol=1e-6)
    np.testing.assert_allclose(want, jax.nn.dot_product_attention(q, k, v, scale=1 / jnp.sqrt(8.0)), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(ValueError, match=r"dot_product_attention: scale: expected a number known when the call "
                                         r"is traced .* got a traced array"):
        jax.jit(lambda s: fj.dot_product_attention(q, k, v, scale=s))(0.3)
