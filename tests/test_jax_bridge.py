"""The JAX bridge's choices, on the CPU: the reference backend routed through torch (as cuDNN is on
a GPU) shows which config each pass runs, and `shard_axes` is checked with clear errors."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from needs_torch import import_torch  # noqa: E402

import_torch("the bridge runs the reference backend through torch (buffer callbacks)")

import fusedattn.jax as fj  # noqa: E402
from fusedattn.backends import get_backend  # noqa: E402
from fusedattn.jax.partition import find_split  # noqa: E402


@pytest.fixture
def bridged(monkeypatch):
    """The reference backend behind the bridge, with the config of every pass it runs."""
    backend = get_backend("reference")
    monkeypatch.setattr(backend, "array_framework", "torch")
    runs = []
    forward, backward = backend.forward_into, backend.backward_into

    def forward_spy(cfg, *args):
        runs.append(("forward", cfg))
        return forward(cfg, *args)

    def backward_spy(cfg, *args):
        runs.append(("backward", cfg))
        return backward(cfg, *args)

    monkeypatch.setattr(backend, "forward_into", forward_spy)
    monkeypatch.setattr(backend, "backward_into", backward_spy)
    return runs


def _qkv():
    keys = jax.random.split(jax.random.key(3), 3)
    return [jax.random.normal(key, (2, 16, 4, 8)) for key in keys]


def test_a_forward_nothing_differentiates_runs_without_training(bridged):
    q, k, v = _qkv()
    want = fj.attention(q, k, v, mask="causal", backend="reference")
    bridged.clear()
    out = jax.jit(lambda *x: fj.attention(*x, mask="causal", backend="reference"))(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    assert [(phase, cfg.is_training) for phase, cfg in bridged] == [("forward", False)]


def test_gradients_lse_and_dropout_keep_the_training_config(bridged):
    q, k, v = _qkv()
    jax.grad(lambda q: fj.attention(q, k, v, backend="reference").sum())(q)
    assert [(phase, cfg.is_training) for phase, cfg in bridged] == [("forward", True), ("backward", True)]
    for options in ({"return_lse": True}, {"dropout_p": 0.1, "dropout_seed": 1}):
        bridged.clear()
        jax.jit(lambda *x, o=options: fj.attention(*x, backend="reference", **o))(q, k, v)
        assert [cfg.is_training for _, cfg in bridged] == [True], options


def test_an_unused_lse_has_no_gradient_and_a_used_one_has(bridged):
    """symbolic zeros: with return_lse, differentiating only out passes no lse cotangent."""
    q, k, v = _qkv()
    out_only = jax.grad(lambda q: fj.attention(q, k, v, return_lse=True, backend="reference").out.sum())(q)
    with_lse = jax.grad(lambda q: fj.attention(q, k, v, return_lse=True, backend="reference").lse.sum())(q)
    assert np.abs(np.asarray(out_only)).max() > 0 and np.abs(np.asarray(with_lse)).max() > 0
    assert not np.allclose(out_only, with_lse)


def test_shard_axes_errors_name_the_problem():
    from fusedattn.config import AttentionConfig, Layout

    cfg = AttentionConfig(dtype="float32", layout=Layout.BSHD, batch=2, seqlen_q=16, seqlen_kv=16, heads_q=4,
                          heads_kv=4, head_dim_qk=8, head_dim_v=8, framework="jax")
    q = jnp.zeros((2, 16, 4, 8))
    with pytest.raises(ValueError, match="shard_axes: expected a dict with keys 'batch' and/or 'heads'"):
        find_split("api", cfg, q, "BSHD", {"data": "batch"})
    with pytest.raises(ValueError, match="shard_axes: expected a mesh set with jax.set_mesh"):
        find_split("api", cfg, q, "BSHD", {"batch": "data"})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"expected axes of the mesh \('data',\), got \['model'\]"):
            find_split("api", cfg, q, "BSHD", {"heads": "model"})
        assert find_split("api", cfg, q, "BSHD", {"batch": "data"}) is None  # one device: nothing to split
    assert find_split("api", cfg, q, "BSHD") is None  # an unsharded array
