"""Run as a script by test_jax_without_torch.py: JAX's cuDNN and small_seq calls (and vmap of them) in
a process where importing torch raises, each feature against JAX's own reference backend (float32
inputs: the exact answer; the I/O dtype: the reference's own rounding), forward, LSE and every gradient.
Prints one line per case and exits 1 on the first failure."""

from __future__ import annotations

import sys

import block_torch  # noqa: F401 (first: torch cannot be imported after it)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from exact_rule import assert_close_to_exact  # noqa: E402

import fusedattn.jax as fj  # noqa: E402
from fusedattn import score_mods as sm  # noqa: E402

B, S, H, D = 2, 256, 4, 64


def normal(seed, shape, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * scale


def run(backend, arrays, options, dtype, cotangent, jit=False):
    """[out, lse, *gradients] as float64 NumPy arrays."""
    names = tuple(arrays)
    cast = {n: jnp.asarray(x, jnp.float32 if n == "sink" else dtype) for n, x in arrays.items()}

    def attend(*xs):
        result = fj.attention(**dict(zip(names, xs)), **options, backend=backend, return_lse=True)
        return result.out, result.lse

    def step(*xs):
        out, pullback, lse = jax.vjp(attend, *xs, has_aux=True)
        return (out, lse, *pullback(jnp.asarray(cotangent, out.dtype)))

    results = (jax.jit(step) if jit else step)(*cast.values())
    return [np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in results]


def check(name, arrays, options, dtype=jnp.bfloat16, backend="cudnn"):
    probe = jax.eval_shape(lambda: fj.attention(**{n: jnp.asarray(x) for n, x in arrays.items()}, **options,
                                                backend="reference"))
    cotangent = normal(99, probe.shape)
    got = run(backend, arrays, options, dtype, cotangent, jit=True)
    same = run("reference", arrays, options, dtype, cotangent)
    exact = run("reference", arrays, options, jnp.float32, cotangent)
    labels = ["out", "lse", *("d" + n for n in arrays)]
    for label, g, s, e in zip(labels, got, same, exact):
        finite = np.isfinite(e)
        assert (np.isfinite(g) == finite).all() if label != "lse" else True, f"{name} {label}: non-finite values"
        if label == "lse":
            np.testing.assert_allclose(g[finite], e[finite], atol=2e-2, rtol=2e-3, err_msg=f"{name} lse")
            continue
        assert_close_to_exact(f"{name} {label} ({backend})", g[finite], s[finite], e[finite],
                              reduction=label in ("dbias", "dsink"))
    print(f"ok {name}", flush=True)


def check_vmap(backend, arrays, options, items=3):
    """jax.vmap over every array (each item its own data) of the forward and its gradients, against the
    same call item by item: equal up to the kernels' own run-to-run differences."""
    rng = np.random.default_rng(len(arrays))
    stacked = {n: jnp.asarray(x[None] + 0.1 * rng.standard_normal((items, *x.shape)), jnp.bfloat16)
               for n, x in arrays.items()}

    def step(*xs):
        def attend(*xs):
            return fj.attention(**dict(zip(stacked, xs)), **options, backend=backend).astype(jnp.float32)

        out, pullback = jax.vjp(attend, *xs)
        return (out, *pullback(jnp.cos(out)))

    together = jax.jit(jax.vmap(step))(*stacked.values())
    for i in range(items):
        alone = jax.jit(step)(*(x[i] for x in stacked.values()))
        for label, got, want in zip(["out", *("d" + n for n in stacked)], together, alone):
            got, want = np.asarray(got[i], np.float32), np.asarray(want, np.float32)
            limit = 2e-2 * max(np.abs(want).max(), 1.0)
            assert np.abs(got - want).max() <= limit, f"vmap {backend} {label} item {i}"
    print(f"ok vmap {backend} {'+'.join(stacked)}", flush=True)


def qkv(seed, sq=S, skv=S, hkv=H):
    return {"q": normal(seed, (B, sq, H, D)), "k": normal(seed + 1, (B, skv, hkv, D)),
            "v": normal(seed + 2, (B, skv, hkv, D))}


def cumulative(lengths, gap=0):
    return jnp.asarray(np.concatenate([[0], np.cumsum(np.asarray(lengths) + gap)]), jnp.int32)


def main():
    check("causal", qkv(1), {"mask": "causal"})
    check("gqa-window", qkv(2, hkv=2), {"mask": "causal", "window": (64, 0)})
    check("bias-1HSS", {**qkv(3), "bias": normal(4, (1, H, S, S))}, {})
    check("bias-pre_scale-B11S", {**qkv(5), "bias": normal(6, (B, 1, 1, S))}, {"bias_type": "pre_scale"})
    check("sink-learnable", {**qkv(7), "sink": normal(8, (H,))}, {"mask": "causal", "softmax_type": "learnable"})
    check("sink-off_by_one", qkv(9), {"softmax_type": "off_by_one"})
    lengths = ([200, 37], [256, 90])
    check("padding", qkv(10), {"mask": "padding_causal", "cu_seqlens_q": cumulative(lengths[0]),
                               "cu_seqlens_kv": cumulative(lengths[1])})
    lens = [100, 37, 128, 5]
    tokens = sum(lens) + 8 * len(lens)
    check("thd-gaps", {"q": normal(11, (tokens, H, D)), "k": normal(12, (tokens, H, D)),
                       "v": normal(13, (tokens, H, D))},
          {"layout": "thd", "mask": "padding_causal", "cu_seqlens_q": cumulative(lens),
           "cu_seqlens_kv": cumulative(lens), "cu_seqlens_q_padded": cumulative(lens, 8),
           "cu_seqlens_kv_padded": cumulative(lens, 8)})
    check("thd-one-token", {"q": normal(33, (10, H, D)), "k": normal(34, (14, H, D)), "v": normal(35, (14, H, D))},
          {"layout": "thd", "mask": "padding_causal", "cu_seqlens_q": cumulative([1, 7, 1, 1]),
           "cu_seqlens_kv": cumulative([1, 9, 0, 4])})
    check("bottom_right-Sq>Skv", qkv(14, sq=S, skv=160), {"mask": "causal_bottom_right"})
    check("softcap", qkv(15), {"mask": "causal", "score_mod": sm.softcap(20.0)})
    check("flex-softcap", qkv(16), {"score_mod": lambda s, b, h, q, k: 30.0 * jnp.tanh(s / 30.0)})
    check("alibi-flex", qkv(17), {"mask": "causal", "score_mod": sm.alibi(jnp.asarray(
        np.geomspace(0.5, 0.01, H), jnp.float32))})
    check("score_mod-padding", qkv(18), {"mask": "padding", "score_mod": sm.softcap(25.0),
                                         "cu_seqlens_q": cumulative(lengths[0]),
                                         "cu_seqlens_kv": cumulative(lengths[1])})
    small = {"q": normal(20, (96, 1, H, D)), "k": normal(21, (96, 16, 1, D)), "v": normal(22, (96, 16, 1, D))}
    check("small_seq-mqa", small, {}, backend="small_seq")
    check("small_seq-padding", {**small, "k": small["k"].repeat(H, 2), "v": small["v"].repeat(H, 2)},
          {"mask": "padding", "cu_seqlens_q": cumulative([1] * 96), "cu_seqlens_kv": cumulative(
              np.arange(96) % 17)}, backend="small_seq")
    lens_kv = [3, 0, 16, 9]
    check("small_seq-thd", {"q": normal(23, (4, H, D)), "k": normal(24, (28, H, D)), "v": normal(25, (28, H, D))},
          {"layout": "thd", "mask": "padding", "cu_seqlens_q": cumulative([1] * 4),
           "cu_seqlens_kv": cumulative(lens_kv), "max_seqlen_q": 1, "max_seqlen_kv": 16}, backend="small_seq")
    check_vmap("cudnn", qkv(26), {"mask": "causal"})
    check_vmap("cudnn", {**qkv(27), "bias": normal(28, (1, H, S, S))}, {})
    check_vmap("small_seq", {n: x[:32] for n, x in small.items()}, {})
    # max_logit (forward only) and dropout (its own mask: finite, reproducible, other seed other output)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in qkv(19).values())
    result = jax.jit(lambda: fj.attention(q, k, v, mask="causal", return_max_logit=True, backend="cudnn"))()
    want = fj.attention(*(x.astype(jnp.float32) for x in (q, k, v)), mask="causal", return_max_logit=True,
                        backend="reference")
    np.testing.assert_allclose(np.asarray(result.max_logit), np.asarray(want.max_logit), atol=5e-2, rtol=1e-2)
    print("ok max_logit", flush=True)
    drop = jax.jit(lambda key: fj.attention(q, k, v, dropout_p=0.2, dropout_rng=key, backend="cudnn"))
    first, again, other = drop(jax.random.key(1)), drop(jax.random.key(1)), drop(jax.random.key(2))
    assert np.isfinite(np.asarray(first, np.float32)).all()
    assert (np.asarray(first) == np.asarray(again)).all() and not (np.asarray(first) == np.asarray(other)).all()
    grads = jax.jit(jax.grad(lambda q: fj.attention(q, k, v, dropout_p=0.2, dropout_rng=jax.random.key(1),
                                                    backend="cudnn").astype(jnp.float32).sum()))(q)
    assert np.isfinite(np.asarray(grads, np.float32)).all()
    print("ok dropout", flush=True)
    check_traced_offsets(q, k, v)
    assert "torch" not in sys.modules, "torch was imported"
    print("ALL OK")


def check_traced_offsets(q, k, v):
    """Offsets traced under jit: good ones give the concrete call's bits; broken ones NaN in the output and
    in every gradient (fusedattn/jax/offset_guard.py), on cuDNN's native call."""
    def attend(q, k, v, cu):
        return fj.attention(q, k, v, mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu, backend="cudnn")

    good = cumulative([200, 37])
    want = np.asarray(attend(q, k, v, good))
    got = np.asarray(jax.jit(attend)(q, k, v, jnp.asarray(good)))
    assert (got.view(np.uint16) == want.view(np.uint16)).all(), "traced offsets changed the bits"
    broken = jnp.asarray(cumulative([300, 37]))  # longer than S
    assert np.isnan(np.asarray(jax.jit(attend)(q, k, v, broken), np.float32)).all()
    loss = lambda q, k, v, cu: attend(q, k, v, cu).astype(jnp.float32).sum()  # noqa: E731
    for grad in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, broken):
        assert np.isnan(np.asarray(grad, np.float32)).all(), "a gradient of a broken call is not NaN"
    print("ok traced offsets", flush=True)


if __name__ == "__main__":
    main()
