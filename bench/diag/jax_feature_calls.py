"""Per-call time of jitted JAX attention with features beyond q/k/v (issue 14's rows, a first cut):
back-to-back calls of one jitted step, median of 7 loops, at B4 H16 S1024 D128 bf16. Ours (native
custom calls) beside jax.nn.dot_product_attention(implementation="cudnn") where it can express the
call. Writes JSON to --out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

import fusedattn.jax as fj
from fusedattn import score_mods as sm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its timing loop
from bench_jax import timed_ms  # noqa: E402  (median per-call ms of back-to-back loops)

B, H, S, D = 4, 16, 1024, 128


def timed_us(step, args) -> float:
    jax.block_until_ready(step(*args))
    return timed_ms(step, args, 7, 50) * 1e3


def steps(fn):
    forward = jax.jit(fn)

    def loss(q, k, v):
        return fn(q, k, v).astype(jnp.float32).sum()

    both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return {"fwd": forward, "fwd+bwd": both}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="jax-feature-calls.json")
    args = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16) for key in keys[:3])
    bias = jax.random.normal(keys[3], (1, H, S, S), jnp.bfloat16)
    sink = jax.random.normal(keys[4], (H,), jnp.float32)
    lengths = jnp.asarray([1024, 700, 512, 999], jnp.int32)
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(lengths)]).astype(jnp.int32)
    rows = {
        "plain-causal": (lambda q, k, v: fj.attention(q, k, v, mask="causal", backend="cudnn"),
                         lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")),
        "bias-1HSS": (lambda q, k, v: fj.attention(q, k, v, bias=bias, backend="cudnn"),
                      lambda q, k, v: jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="cudnn")),
        "padding-lengths": (lambda q, k, v: fj.attention(q, k, v, mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                         backend="cudnn"),
                            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lengths,
                                                                         key_value_seq_lengths=lengths,
                                                                         implementation="cudnn")),
        "window-256": (lambda q, k, v: fj.attention(q, k, v, mask="causal", window=(256, 0), backend="cudnn"),
                       lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(256, 0),
                                                                    implementation="cudnn")),
        "sink-learnable": (lambda q, k, v: fj.attention(q, k, v, mask="causal", sink=sink, softmax_type="learnable",
                                                        backend="cudnn"), None),
        "softcap": (lambda q, k, v: fj.attention(q, k, v, mask="causal", score_mod=sm.softcap(30.0), backend="cudnn"),
                    None),
    }
    results = []
    for name, (ours, peer) in rows.items():
        for mode, step in steps(ours).items():
            row = {"row": name, "mode": mode, "ours_us": timed_us(step, (q, k, v))}
            if peer is not None:
                try:
                    row["jax_nn_cudnn_us"] = timed_us(steps(peer)[mode], (q, k, v))
                    row["ratio"] = row["jax_nn_cudnn_us"] / row["ours_us"]
                except Exception as error:  # jax.nn declines some combinations
                    row["jax_nn_cudnn"] = f"{type(error).__name__}: {str(error)[:200]}"
            print(json.dumps(row), flush=True)
            results.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": [B, H, S, D],
                   "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
