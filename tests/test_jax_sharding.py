"""JAX sharding on 4 forced host devices (a subprocess: the device count is fixed when JAX starts):
batch- and head-sharded inputs run shard-local (no collective in the compiled program, forward
and gradients), and a sequence-sharded input gets a clear error, eagerly and under jit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from needs_torch import requires_torch

pytest.importorskip("jax")

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import fusedattn.jax as fj

    assert len(jax.devices()) == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    B, S, H, HKV, D = 4, 8, 4, 2, 16
    q = jax.random.normal(jax.random.key(0), (B, S, H, D))
    k = jax.random.normal(jax.random.key(1), (B, S, HKV, D))
    v = jax.random.normal(jax.random.key(2), (B, S, HKV, D))

    def f(q, k, v):
        return fj.attention(q, k, v, mask="causal")

    def loss(q, k, v):
        return (f(q, k, v) ** 2).sum()

    want, want_grads = f(q, k, v), jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")
    for name, spec in [("batch", P("data")), ("heads", P(None, None, "model")), ("both", P("data", None, "model"))]:
        sh = NamedSharding(mesh, spec)
        forward = jax.jit(f, in_shardings=(sh, sh, sh), out_shardings=sh)
        backward = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), in_shardings=(sh, sh, sh))
        for label, fn in (("forward", forward), ("gradients", backward)):
            hlo = fn.lower(q, k, v).compile().as_text()
            found = [c for c in COLLECTIVES if c in hlo]
            assert not found, f"{name}-sharded {label}: {found} in the compiled program"
        np.testing.assert_allclose(forward(q, k, v), want, rtol=1e-5, atol=1e-5)
        for got, ref in zip(backward(q, k, v), want_grads):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
        print(name, "shard-local")

    seq = NamedSharding(mesh, P(None, "data"))
    try:
        fj.attention(*(jax.device_put(x, seq) for x in (q, k, v)), mask="causal")
    except ValueError as error:
        assert "sequence axis (S of BSHD) sharded over mesh axis 'data'" in str(error), error
        assert "context parallelism" in str(error), error
        print("sequence-sharded: clear error")
    else:
        raise AssertionError("a sequence-sharded input ran without an error")

    # Inside jit the sharding is seen when XLA partitions the program.
    try:
        jax.jit(f, in_shardings=(seq, seq, seq))(q, k, v)
    except Exception as error:  # XLA wraps the ValueError of the partitioning callback
        assert "sequence axis (S of BSHD) sharded over mesh axis 'data'" in str(error), error
        print("jit-sequence-sharded: clear error")
    else:
        raise AssertionError("a sequence-sharded input ran under jit without an error")

    # vmap of a jitted call: the identity op is batched, the vmapped axis checked as a batch axis.
    items = jnp.stack([q, 2 * q])
    vmapped = jax.vmap(jax.jit(f), in_axes=(0, None, None))
    np.testing.assert_allclose(vmapped(jax.device_put(items, NamedSharding(mesh, P("data"))), k, v),
                               jnp.stack([f(q, k, v), f(2 * q, k, v)]), rtol=1e-5, atol=1e-5)
    try:
        jax.jit(vmapped, in_shardings=(NamedSharding(mesh, P(None, None, "data")), seq, seq))(items, k, v)
    except Exception as error:
        assert "sequence axis (S of VBSHD) sharded over mesh axis 'data'" in str(error), error
        print("vmap-sequence-sharded: clear error")
    else:
        raise AssertionError("a sequence-sharded input ran under vmap(jit) without an error")
""")


def test_batch_and_head_sharding_run_shard_local_and_sequence_sharding_is_refused():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["batch", "shard-local", "heads", "shard-local", "both", "shard-local",
                                     "sequence-sharded:", "clear", "error",
                                     "jit-sequence-sharded:", "clear", "error",
                                     "vmap-sequence-sharded:", "clear", "error"], result.stdout


# The bridge path (buffer callbacks run once per shard inside a shard_map, fusedattn/jax/partition.py),
# run on the CPU by routing the reference backend through torch: what cuDNN does on GPUs.
BRIDGE_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import fusedattn.jax as fj
    from fusedattn.backends import get_backend

    get_backend("reference").array_framework = "torch"  # JAX calls now go through the bridge
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "model"))
    B, S, H, HKV, D = 4, 8, 4, 2, 16
    keys = iter(jax.random.split(jax.random.key(0), 12))
    q = jax.random.normal(next(keys), (B, S, H, D))
    k = jax.random.normal(next(keys), (B, S, HKV, D))
    v = jax.random.normal(next(keys), (B, S, HKV, D))
    bias = jax.random.normal(next(keys), (1, H, S, S))
    sink = jax.random.normal(next(keys), (H,))
    GATHERS = ("all-gather", "all-to-all", "collective-permute", "reduce-scatter")

    def f(q, k, v, bias, sink):
        return fj.attention(q, k, v, mask="causal", bias=bias, softmax_type="learnable", sink=sink,
                            backend="reference", shard_axes=axes)

    def loss(*args):
        return (f(*args) ** 2).sum()

    axes, args = None, (q, k, v, bias, sink)
    want, want_grads = f(*args), jax.grad(loss, argnums=tuple(range(5)))(*args)
    for name, spec, axes in [("batch", P("data"), dict(batch="data")),
                             ("heads", P(None, None, "model"), dict(heads="model")),
                             ("both", P("data", None, "model"), dict(batch="data", heads="model"))]:
        f = lambda q, k, v, bias, sink, axes=axes: fj.attention(q, k, v, mask="causal", bias=bias, sink=sink,
                                                                softmax_type="learnable", backend="reference",
                                                                shard_axes=axes)
        sh, rep = NamedSharding(mesh, spec), NamedSharding(mesh, P())
        shardings = (sh, sh, sh, rep, rep)
        forward = jax.jit(f, in_shardings=shardings, out_shardings=sh)
        backward = jax.jit(jax.grad(loss, argnums=tuple(range(5))), in_shardings=shardings)
        with jax.set_mesh(mesh):
            for label, fn in (("forward", forward), ("gradients", backward)):
                hlo = fn.lower(*args).compile().as_text()
                assert hlo.count("xla_buffer_python_cpu_callback") >= 1, "the bridge did not run"
                found = [c for c in GATHERS if c in hlo]
                assert not found, f"{name}-sharded {label}: {found} in the compiled program"
                if label == "forward":
                    assert "all-reduce" not in hlo, f"{name}-sharded forward: all-reduce in the compiled program"
            np.testing.assert_allclose(forward(*args), want, rtol=1e-5, atol=1e-5)
            for arg, got, ref in zip(("q", "k", "v", "bias", "sink"), backward(*args), want_grads):
                np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5, err_msg=f"{name}: d{arg}")
        print(name, "shard-local")

    # Without a declared split, a sharded input under jit would be gathered: a clear error.
    f = lambda q, k, v, bias, sink: fj.attention(q, k, v, mask="causal", bias=bias, softmax_type="learnable",
                                                 sink=sink, backend="reference")
    try:
        jax.jit(f, in_shardings=(sh, sh, sh, rep, rep))(*args)
    except Exception as error:
        assert "XLA would gather" in str(error) and "shard_axes" in str(error), error
        print("undeclared clear error")
    else:
        raise AssertionError("a sharded input ran through the bridge without a split")

    # Eager calls on sharded arrays find the split from the arrays themselves.
    placed = [jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))) for x in (q, k, v)]
    replicated = [jax.device_put(x, NamedSharding(mesh, P())) for x in (bias, sink)]
    np.testing.assert_allclose(f(*placed, *replicated), want, rtol=1e-5, atol=1e-5)
    print("eager shard-local")

    # Packed sequences shard over heads.
    cu = jnp.asarray([0, 3, 8, 13], jnp.int32)
    qt, kt, vt = (jax.random.normal(next(keys), (13, 4, D)) for _ in range(3))
    thd = lambda q, k, v, axes=None: fj.attention(q, k, v, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                  max_seqlen_q=5, max_seqlen_kv=5, mask="padding_causal",
                                                  backend="reference", shard_axes=axes)
    sh = NamedSharding(mesh, P(None, "model"))
    with jax.set_mesh(mesh):
        got = jax.jit(lambda *x: thd(*x, axes={"heads": "model"}), in_shardings=(sh, sh, sh))(qt, kt, vt)
    np.testing.assert_allclose(got, thd(qt, kt, vt), rtol=1e-5, atol=1e-5)
    print("thd-heads shard-local")

    # Each batch shard draws its own dropout mask: equal rows on two shards give different outputs.
    same = [jnp.concatenate([x[:2], x[:2]]) for x in (q, k, v)]
    drop = lambda q, k, v: fj.attention(q, k, v, dropout_p=0.5, dropout_seed=7, backend="reference",
                                        shard_axes={"batch": "data"})
    with jax.set_mesh(mesh):
        out = jax.jit(drop, in_shardings=(NamedSharding(mesh, P("data")),) * 3)(*same)
    assert not np.allclose(out[:2], out[2:]), "both batch shards drew the same dropout mask"
    print("dropout per-shard")

    # An aux tensor spanning a sharded axis cannot be split: a clear error; over the other axis it runs.
    scale = jax.random.normal(next(keys), (1, H, 1, 1))
    mod = lambda q, axes=None: fj.attention(q, k, v, backend="reference", score_mod_tensors={"w": scale},
                                            score_mod=lambda g, s, t: g.mul(a=s, b=t["w"]), shard_axes=axes)
    try:
        with jax.set_mesh(mesh):
            jax.jit(lambda q: mod(q, {"heads": "model"}))(q)
    except ValueError as error:
        assert "spans the sharded batch or head axis" in str(error), error
        print("aux-heads clear error")
    else:
        raise AssertionError("an aux tensor over a sharded head axis ran")
    with jax.set_mesh(mesh):
        out = jax.jit(lambda q: mod(q, {"batch": "data"}), in_shardings=(NamedSharding(mesh, P("data")),))(q)
    np.testing.assert_allclose(out, mod(q), rtol=1e-5, atol=1e-5)
    print("aux-batch shard-local")
""")


@requires_torch("the bridge runs the reference backend through torch (buffer callbacks)")
def test_bridge_calls_run_per_shard_with_summed_broadcast_gradients_and_per_shard_dropout():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", BRIDGE_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["batch", "shard-local", "heads", "shard-local", "both", "shard-local",
                                     "undeclared", "clear", "error", "eager", "shard-local",
                                     "thd-heads", "shard-local", "dropout", "per-shard", "aux-heads", "clear",
                                     "error", "aux-batch", "shard-local"], result.stdout
