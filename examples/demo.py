"""fusedattn demo: one attention call per framework, the selection explanation, and the error
against a float64 computation of the same call."""

from __future__ import annotations

import numpy as np
import torch

import fusedattn
import fusedattn.torch as fat
from fusedattn import score_mods


def float64_attention(q, k, v, scale):
    """Causal GQA attention in float64 numpy, written out plainly."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", weights, v)


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, 8, 32, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 64, 2, 32, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 64, 2, 32, generator=gen, dtype=torch.bfloat16, requires_grad=True)

    result = fat.attention(q, k, v, mask="causal", return_lse=True)
    result.out.float().square().mean().backward()

    cfg = fusedattn.AttentionConfig(dtype="bfloat16", layout="bshd", batch=2, seqlen_q=64, seqlen_kv=64,
                                    heads_q=8, heads_kv=2, head_dim_qk=32, head_dim_v=32, mask="causal",
                                    is_training=True)
    print("== torch: fusedattn.torch.attention(q, k, v, mask='causal'), bf16, GQA 8:2 ==")
    print(fusedattn.explain(cfg))
    exact = float64_attention(*(x.detach().double().numpy() for x in (q, k, v)), scale=32**-0.5)
    error = np.abs(result.out.detach().double().numpy() - exact).max()
    rounding = np.abs(torch.from_numpy(exact).bfloat16().double().numpy() - exact).max()
    print(f"max |out - float64| = {error:.2e}; rounding the exact answer to bf16 alone costs {rounding:.2e}")
    print(f"lse shape {tuple(result.lse.shape)}; grad q norm {q.grad.float().norm():.3f}")

    # score_mod: a built-in and a callback of cuDNN graph ops; on this CPU the reference runs them.
    def distance_penalty(graph, score, tensors):
        rows, cols = score_mods.row_index(graph, score), score_mods.col_index(graph, score)
        return graph.sub(a=score, b=graph.mul(a=graph.abs(input=graph.sub(a=rows, b=cols)), b=tensors["rate"]))

    capped = fat.attention(q, k, v, mask="causal", score_mod=score_mods.softcap(5.0))
    penalised = fat.attention(q, k, v, mask="causal", score_mod=distance_penalty, score_mod_tensors={"rate": 0.1})
    print(f"\n== score_mod: softcap(5.0) moves the output by {(capped - result.out).abs().max():.2e}, "
          f"a distance penalty by {(penalised - result.out).abs().max():.2e} ==")

    try:
        import jax
        import jax.numpy as jnp

        import fusedattn.jax as fja
    except ImportError:
        print("\n(JAX not installed: skipping the JAX half)")
        return
    qj, kj, vj = (jnp.asarray(x.detach().float().numpy()) for x in (q, k, v))
    out_j = jax.jit(lambda q, k, v: fja.attention(q, k, v, mask="causal"))(qj, kj, vj)
    exact32 = float64_attention(*(np.asarray(x, np.float64) for x in (qj, kj, vj)), scale=32**-0.5)
    print("\n== jax: fusedattn.jax.attention under jax.jit, float32 ==")
    print(f"max |out - float64| = {np.abs(np.asarray(out_j) - exact32).max():.2e}")
    grad = jax.grad(lambda q: fja.attention(q, kj, vj, mask="causal").sum())(qj)
    print(f"jax.grad works: grad q shape {grad.shape}")
    print("\nA call no backend can run names every reason:")
    try:
        fat.attention(q, k, v, mask="causal", backend="cudnn")
    except fusedattn.NoBackendError as error:
        print(error)


if __name__ == "__main__":
    main()
