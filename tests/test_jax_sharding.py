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
""")


def test_batch_and_head_sharding_run_shard_local_and_sequence_sharding_is_refused():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == ["batch", "shard-local", "heads", "shard-local", "both", "shard-local",
                                     "sequence-sharded:", "clear", "error",
                                     "jit-sequence-sharded:", "clear", "error"], result.stdout
