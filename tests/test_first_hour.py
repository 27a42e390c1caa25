"""Stumbles of a first hour with fusedattn, each pinned: ALiBi slopes from standard_alibi_slopes,
and modules that check their arguments when made, under their own argument names.

(The command-line stumbles are in test_cli.py.)"""

from __future__ import annotations

import numpy as np
import pytest
from needs_torch import requires_torch

import fusedattn
from fusedattn.arguments import host_slopes

H = 4
STANDARD = fusedattn.standard_alibi_slopes(H)
# Every form a user may hold slopes in, before any framework is involved.
HOST_FORMS = {"list": STANDARD, "tuple": tuple(STANDARD), "numpy": np.array(STANDARD),
              "numpy64": np.array(STANDARD, dtype=np.float64)}


# --------------------------------------------------------------------------- ALiBi slopes

def test_standard_slopes_are_a_plain_list_of_floats():
    assert isinstance(STANDARD, list) and all(isinstance(s, float) for s in STANDARD)
    assert STANDARD == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]


@pytest.mark.parametrize("form", HOST_FORMS)
def test_host_slopes_take_the_precision_of_the_call(form):
    values = host_slopes("alibi_slopes", HOST_FORMS[form], "bfloat16")
    assert values.dtype == np.float32 and values.shape == (H,)
    np.testing.assert_array_equal(values, np.float32(STANDARD))
    for q_dtype in ("float64", None):  # a float64 call's, and the default: every digit kept
        values = host_slopes("alibi_slopes", HOST_FORMS[form], *([q_dtype] if q_dtype else []))
        assert values.dtype == np.float64
        np.testing.assert_array_equal(values, np.float64(STANDARD))


# Slopes that float32 rounds: a float64 call given them as a list must not carry float32's error.
ODD_SLOPES = [0.3, 0.7, 1.1, 0.13]
ODD_FORMS = {"list": ODD_SLOPES, "tuple": tuple(ODD_SLOPES), "numpy64": np.array(ODD_SLOPES)}


def test_host_slopes_leave_none_to_the_frontend():
    assert host_slopes("alibi_slopes", None) is None


@requires_torch("gives host_slopes a torch tensor")
def test_host_slopes_leave_tensors_to_the_frontend():
    import torch

    assert host_slopes("alibi_slopes", torch.tensor(STANDARD)) is None


@pytest.mark.parametrize("value, match", [
    ([], r"expected \(Hq,\) or \(B, Hq\) real numbers, got shape \(0,\)"),
    ([[[0.5]]], r"got shape \(1, 1, 1\)"),
    (["a", "b"], "expected \\(Hq,\\) or \\(B, Hq\\) real numbers, got \\['a', 'b'\\]"),
    ([[0.5, 0.25], [0.5]], "real numbers"),
    ([0.5, float("nan")], "expected finite slopes"),
])
def test_bad_host_slopes_name_the_argument(value, match):
    with pytest.raises(ValueError, match=f"^DotProductAttention: alibi_slopes: .*{match}"):
        host_slopes("DotProductAttention: alibi_slopes", value)


torch_frontend = requires_torch("the torch frontend")


def _torch_qkv():
    import torch

    torch.manual_seed(0)
    return torch, torch.randn(2, 8, H, 16)


def _torch_expected(torch, q):
    return fusedattn.torch.attention(q, q, q, alibi_slopes=torch.tensor(STANDARD))


@torch_frontend
@pytest.mark.parametrize("form", HOST_FORMS)
def test_torch_module_takes_standard_slopes(form):
    torch, q = _torch_qkv()
    import fusedattn.torch as ft

    out = ft.DotProductAttention()(q, q, q, alibi_slopes=HOST_FORMS[form])
    torch.testing.assert_close(out, _torch_expected(torch, q))


@torch_frontend
@pytest.mark.parametrize("form", HOST_FORMS)
def test_torch_attention_takes_standard_slopes(form):
    torch, q = _torch_qkv()
    torch.testing.assert_close(fusedattn.torch.attention(q, q, q, alibi_slopes=HOST_FORMS[form]),
                               _torch_expected(torch, q))


@torch_frontend
def test_torch_score_mod_alibi_takes_standard_slopes():
    torch, q = _torch_qkv()
    from fusedattn import score_mods

    out = fusedattn.torch.attention(q, q, q, score_mod=score_mods.alibi(STANDARD))
    expected = fusedattn.torch.attention(q, q, q, score_mod=score_mods.alibi(torch.tensor(STANDARD)))
    torch.testing.assert_close(out, expected)


def _jax_qkv():
    jax = pytest.importorskip("jax")
    import fusedattn.jax  # noqa: F401 (the tests call it as fusedattn.jax)
    return jax, jax.random.normal(jax.random.key(0), (2, 8, H, 16))


def _jax_expected(q):
    import jax.numpy as jnp

    return fusedattn.jax.attention(q, q, q, alibi_slopes=jnp.asarray(STANDARD, jnp.float32))


@pytest.mark.parametrize("form", HOST_FORMS)
def test_flax_module_takes_standard_slopes(form):
    pytest.importorskip("flax")
    jax, q = _jax_qkv()
    import fusedattn.jax as fj

    module = fj.DotProductAttention()
    params = module.init(jax.random.key(1), q, q, q, alibi_slopes=HOST_FORMS[form])
    out = module.apply(params, q, q, q, alibi_slopes=HOST_FORMS[form])
    np.testing.assert_allclose(np.asarray(out), np.asarray(_jax_expected(q)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", ["list", "tuple"])
def test_jax_attention_takes_standard_slopes(form):
    jax, q = _jax_qkv()
    out = fusedattn.jax.attention(q, q, q, alibi_slopes=HOST_FORMS[form])
    np.testing.assert_allclose(np.asarray(out), np.asarray(_jax_expected(q)), rtol=1e-6, atol=1e-6)


def test_jax_score_mod_alibi_takes_standard_slopes():
    jax, q = _jax_qkv()
    import jax.numpy as jnp

    from fusedattn import score_mods

    out = fusedattn.jax.attention(q, q, q, score_mod=score_mods.alibi(STANDARD))
    expected = fusedattn.jax.attention(q, q, q, score_mod=score_mods.alibi(jnp.asarray(STANDARD)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- torch.nn module arguments

@torch_frontend
@pytest.mark.parametrize("kwargs, match", [
    ({"num_heads": 0}, "num_heads: expected an int >= 1 (or None), got 0"),
    ({"num_heads": -2}, "num_heads: expected an int >= 1 (or None), got -2"),
    ({"num_heads": 4.0}, "num_heads: expected an int >= 1 (or None), got 4.0"),
    ({"softmax_type": "learnable"}, "num_heads: expected an int >= 1 for softmax_type='learnable'"),
    ({"dropout_p": 1.0}, "dropout_p: expected a float in [0, 1), got 1.0"),
    ({"dropout_p": -0.1}, "dropout_p: expected a float in [0, 1), got -0.1"),
    ({"dropout_p": True}, "dropout_p: expected a float in [0, 1), got True"),
    ({"mask": "casual"}, "mask: expected one of 'none', 'causal'"),
    ({"layout": "bhsd3"}, "layout: expected one of 'bshd'"),
    ({"softmax_type": "sparse"}, "softmax_type: expected one of 'vanilla'"),
    ({"window": (128,)}, "window: expected (left, right), two integers >= -1"),
    ({"window": (-2, 0)}, "window: expected (left, right), two integers >= -1"),
    ({"scale": 0.0}, "scale: expected a finite float > 0"),
    ({"backend": "flash"}, "backend: expected None or one of small_seq, cudnn, triton, reference, got 'flash'"),
])
def test_torch_module_refuses_bad_arguments_when_made(kwargs, match):
    import fusedattn.torch as ft

    with pytest.raises(ValueError) as error:
        ft.DotProductAttention(**kwargs)
    assert str(error.value).startswith("DotProductAttention: ")
    assert match in str(error.value)


@torch_frontend
def test_torch_module_keeps_good_arguments():
    import fusedattn.torch as ft

    module = ft.DotProductAttention(8, mask="causal", window=[64, 0], softmax_type="learnable", dropout_p=0.1)
    assert (module.mask, module.window, module.dropout_p) == ("causal", (64, 0), 0.1)
    assert module.sink.shape == (8,)


# --------------------------------------------------------------------------- Flax module arguments

def _flax():
    pytest.importorskip("jax")
    pytest.importorskip("flax")
    import fusedattn.jax as fj

    return fj


@pytest.mark.parametrize("make, message", [
    (lambda fj: fj.TransformerLayer(hidden_size=100, num_heads=16),
     "TransformerLayer: hidden_size: expected a multiple of num_heads=16 (head_dim is hidden_size // num_heads), "
     "got 100; change one, or pass head_dim"),
    (lambda fj: fj.TransformerLayer(hidden_size=0, num_heads=4), "TransformerLayer: hidden_size: expected an int >= 1"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=-4), "TransformerLayer: num_heads: expected an int >= 1"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, head_dim=0),
     "TransformerLayer: head_dim: expected an int >= 1 (or None), got 0"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, num_kv_heads=3),
     "TransformerLayer: num_kv_heads: expected a divisor of num_heads=4, got 3"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, mlp_hidden_size=0),
     "TransformerLayer: mlp_hidden_size: expected an int >= 1"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, attention_dropout=1.0),
     "TransformerLayer: attention_dropout: expected a float in [0, 1), got 1.0"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, hidden_dropout=-0.5),
     "TransformerLayer: hidden_dropout: expected a float in [0, 1), got -0.5"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, mask="casual"),
     "TransformerLayer: mask: expected one of 'none', 'causal'"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, window=(4, 4, 4)),
     "TransformerLayer: window: expected (left, right)"),
    (lambda fj: fj.TransformerLayer(hidden_size=64, num_heads=4, backend="flash"),
     "TransformerLayer: backend: expected None or one of"),
    (lambda fj: fj.MultiHeadAttention(num_heads=4, head_dim=0), "MultiHeadAttention: head_dim: expected an int >= 1"),
    (lambda fj: fj.MultiHeadAttention(num_heads=4, head_dim=8, num_kv_heads=0),
     "MultiHeadAttention: num_kv_heads: expected an int >= 1 (or None), got 0"),
    (lambda fj: fj.MultiHeadAttention(num_heads=4, head_dim=8, dropout_p=2),
     "MultiHeadAttention: dropout_p: expected a float in [0, 1), got 2"),
    (lambda fj: fj.MultiHeadAttention(num_heads=4, head_dim=8, softmax_type="sparse"),
     "MultiHeadAttention: softmax_type: expected one of 'vanilla'"),
    (lambda fj: fj.DotProductAttention(num_heads=0), "DotProductAttention: num_heads: expected an int >= 1"),
    (lambda fj: fj.DotProductAttention(layout="bhsd3"), "DotProductAttention: layout: expected one of 'bshd'"),
    (lambda fj: fj.DotProductAttention(dropout_p=1.5), "DotProductAttention: dropout_p: expected a float in [0, 1)"),
    (lambda fj: fj.DotProductAttention(scale=-1.0), "DotProductAttention: scale: expected a finite float > 0"),
])
def test_flax_modules_refuse_bad_arguments_when_made(make, message):
    fj = _flax()
    with pytest.raises(ValueError) as error:
        make(fj)
    assert message in str(error.value)


def test_flax_modules_still_init_apply_and_clone():
    fj = _flax()
    import jax

    layer = fj.TransformerLayer(hidden_size=32, num_heads=4, num_kv_heads=2, attention_dropout=0.1)
    x = jax.random.normal(jax.random.key(0), (2, 6, 32))
    params = layer.init(jax.random.key(1), x)
    assert layer.apply(params, x).shape == (2, 6, 32)
    assert layer.clone(num_heads=8).num_heads == 8
    with pytest.raises(ValueError, match="TransformerLayer: num_kv_heads: expected a divisor of num_heads=2"):
        layer.clone(num_heads=2, num_kv_heads=4)
    explicit = fj.TransformerLayer(hidden_size=100, num_heads=16, head_dim=8)  # head_dim given: no divisibility
    assert explicit.init(jax.random.key(2), jax.random.normal(jax.random.key(3), (1, 4, 100)))


@torch_frontend
@pytest.mark.parametrize("form", ODD_FORMS)
def test_torch_float64_call_keeps_host_slopes_float64(form):
    import torch

    import fusedattn.torch as ft

    q, k, v = torch.randn(3, 2, 8, H, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    want = ft.attention(q, k, v, alibi_slopes=torch.tensor(ODD_SLOPES, dtype=torch.float64))
    rounded = ft.attention(q, k, v, alibi_slopes=torch.tensor(ODD_SLOPES, dtype=torch.float32))
    assert not torch.equal(want, rounded)  # the check below can tell the precisions apart
    torch.testing.assert_close(ft.attention(q, k, v, alibi_slopes=ODD_FORMS[form]), want, rtol=0, atol=0)
    torch.testing.assert_close(ft.DotProductAttention()(q, k, v, alibi_slopes=ODD_FORMS[form]), want,
                               rtol=0, atol=0)


@pytest.mark.parametrize("form", ODD_FORMS)
def test_jax_float64_call_keeps_host_slopes_float64(form, x64):
    jax, _ = _jax_qkv()
    import jax.numpy as jnp

    import fusedattn.jax as fj

    q, k, v = jax.random.normal(jax.random.key(3), (3, 2, 8, H, 16), jnp.float64)
    want = fj.attention(q, k, v, alibi_slopes=jnp.asarray(ODD_SLOPES, jnp.float64))
    rounded = fj.attention(q, k, v, alibi_slopes=jnp.asarray(ODD_SLOPES, jnp.float32))
    assert not np.array_equal(want, rounded)
    np.testing.assert_array_equal(fj.attention(q, k, v, alibi_slopes=ODD_FORMS[form]), want)


def test_jax_takes_numpy_arrays_with_a_score_mod_and_segment_ids():
    """NumPy q/k/v with a score_mod, and NumPy segment ids, run as their JAX arrays do (both were refused
    with a message that named neither the function nor the argument)."""
    jax, _ = _jax_qkv()
    import jax.numpy as jnp

    import fusedattn.jax as fj

    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((3, 2, 8, H, 16), dtype=np.float32)
    def score_mod(s, b, h, q_idx, kv_idx):
        return s * 0.5 + np.float32(0.25) * h

    want = fj.attention(*map(jnp.asarray, (q, k, v)), score_mod=score_mod)
    np.testing.assert_array_equal(fj.attention(q, k, v, score_mod=score_mod), want)
    ids = np.array([0, 0, 0, 1, 1, 1, 1, 1], np.int32)
    packed = {"layout": "thd", "num_sequences": 2}
    want = fj.attention(q[0], k[0], v[0], segment_ids_q=jnp.asarray(ids), segment_ids_kv=jnp.asarray(ids),
                        **packed)
    np.testing.assert_array_equal(fj.attention(q[0], k[0], v[0], segment_ids_q=ids, segment_ids_kv=ids, **packed),
                                  want)
