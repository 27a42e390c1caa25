"""small_seq on a GPU at full size against the reference: forward and every gradient, ragged
key lengths, GQA/MQA, every head dim, padded layouts, and a batch of a million sequences."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402

pytestmark = pytest.mark.gpu


def _cu(lengths: torch.Tensor) -> torch.Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device="cuda")
    cu[1:] = lengths.cumsum(0)
    return cu


def _thd(batch, heads_q, heads_kv, head_dim, max_keys, dtype=torch.bfloat16, seed=0, empty_every=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(1, max_keys + 1, (batch,), generator=gen, device="cuda")
    if empty_every:
        lengths[::empty_every] = 0
    total = int(lengths.sum())
    q = torch.randn(batch, heads_q, head_dim, generator=gen, device="cuda").to(dtype)
    k = torch.randn(total, heads_kv, head_dim, generator=gen, device="cuda").to(dtype)
    v = torch.randn(total, heads_kv, head_dim, generator=gen, device="cuda").to(dtype)
    options = dict(layout="thd", mask="padding", cu_seqlens_q=_cu(torch.ones_like(lengths)),
                   cu_seqlens_kv=_cu(lengths), max_seqlen_q=1, max_seqlen_kv=max_keys)
    return (q, k, v), options


def _run(backend, tensors, options, grad_seed=1):
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    result = fat.attention(*leaves, backend=backend, return_lse=True, **options)
    gen = torch.Generator(device="cuda").manual_seed(grad_seed)
    grad = torch.randn(result.out.shape, generator=gen, device="cuda")
    grads = torch.autograd.grad(result.out.float(), leaves, grad)
    return result, grads


def _check(tensors, options):
    fused, fused_grads = _run("small_seq", tensors, options)
    wide = [x.double() for x in tensors]
    exact, exact_grads = _run("reference", wide, options)
    same, same_grads = _run("reference", tensors, options)
    for name, got, want, ref in [("out", fused.out, exact.out, same.out), *zip(("dq", "dk", "dv"), fused_grads,
                                                                             exact_grads, same_grads)]:
        err = (got.double() - want).abs().max().item()
        ref_err = (ref.double() - want).abs().max().item()
        limit = 2.0 * ref_err + 2e-3 * max(want.abs().max().item(), 1.0)
        assert err <= limit, f"{name}: small_seq error {err:.3e} > {limit:.3e} (reference's own {ref_err:.3e})"
    finite = torch.isfinite(exact.lse)
    assert torch.equal(torch.isfinite(fused.lse), finite)
    torch.testing.assert_close(fused.lse[finite], exact.lse[finite].float(), atol=1e-3, rtol=1e-3)


def test_the_benchmark_shape_at_full_size():
    _check(*_thd(30720, 16, 16, 128, 16, seed=1, empty_every=997))


@pytest.mark.parametrize("heads_q,heads_kv", [(16, 1), (16, 4), (8, 8)], ids=["mqa", "gqa", "mha"])
@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_heads_and_dims(heads_q, heads_kv, head_dim):
    _check(*_thd(2048, heads_q, heads_kv, head_dim, 16, seed=head_dim + heads_kv))


def test_fp16():
    _check(*_thd(4096, 8, 2, 128, 16, dtype=torch.float16, seed=3))


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_padded_bshd_with_one_query(mask):
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(4096, 1, 8, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(4096, 12, 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(4096, 12, 2, 128, generator=gen, device="cuda").to(torch.bfloat16)
    options = {"mask": mask}
    if mask == "padding":
        lengths = torch.randint(0, 13, (4096,), generator=gen, device="cuda")
        options.update(cu_seqlens_q=_cu(torch.ones_like(lengths)), cu_seqlens_kv=_cu(lengths))
    _check((q, k, v), options)


def test_a_million_sequences_run():
    # 2**20 sequences of up to 4 keys, 8 heads: far past any one grid dimension of 65535.
    tensors, options = _thd(2**20, 8, 8, 64, 4, seed=5)
    out = fat.attention(*tensors, backend="small_seq", **options)
    sample = torch.arange(0, 2**20, 4099, device="cuda")
    starts = options["cu_seqlens_kv"][:-1].long()
    lengths = options["cu_seqlens_kv"][1:].long() - starts
    q, k, v = tensors
    for b in sample.tolist()[:64]:
        keys = slice(int(starts[b]), int(starts[b] + lengths[b]))
        s = torch.einsum("hd,khd->hk", q[b].float(), k[keys].float()) * 64**-0.5
        want = torch.einsum("hk,khd->hd", s.softmax(-1), v[keys].float())
        torch.testing.assert_close(out[b].float(), want, atol=2e-2, rtol=2e-2)


def test_selection_picks_small_seq_for_its_shapes(ran):
    tensors, options = _thd(1024, 16, 16, 128, 16, seed=6)
    fat.attention(*tensors, **options)
    assert ran[-1][0] == "small_seq"
    mha, options = _thd(1024, 16, 16, 128, 64, seed=7)  # one query head per KV head, D <= 128: up to 64 keys
    fat.attention(*mha, **options)
    assert ran[-1][0] == "small_seq"
    longer, options = _thd(1024, 16, 16, 128, 80, seed=7)
    fat.attention(*longer, **options)
    assert ran[-1][0] != "small_seq"
    grouped, options = _thd(1024, 16, 4, 128, 40, seed=7)
    fat.attention(*grouped, **options)
    assert ran[-1][0] != "small_seq"
    with pytest.raises(fusedattn.NoBackendError, match="Skv=40 > 16"):
        fat.small_seq_attention(*grouped, **options)


@pytest.mark.parametrize("head_dim,max_keys", [(64, 33), (128, 64)])
def test_longer_keys_with_one_query_head_per_kv_head(head_dim, max_keys):
    """The MHA limit of 64 keys (measured faster than every peer up to there): against float64."""
    _check(*_thd(8192, 16, 16, head_dim, max_keys, seed=head_dim + max_keys, empty_every=101))


def test_jax_calls_run_the_kernels_on_the_gpu_and_match_the_reference():
    """small_seq from JAX on a GPU: the kernels run through jax-triton where it imports, else through
    torch's buffer callbacks on XLA's stream (forward, every gradient, the LSE), under jit, against the
    float32 reference computed by JAX."""
    jax = pytest.importorskip("jax")
    import numpy as np

    import fusedattn.jax as fj

    if jax.default_backend() != "gpu":
        pytest.skip("JAX sees no GPU")
    jnp = jax.numpy
    batch, heads_q, heads_kv, dim = 4096, 8, 2, 128
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 17, batch)
    cu_kv = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    cu_q = jnp.arange(batch + 1, dtype=jnp.int32)
    total = int(lengths.sum())
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
               for shape in ((batch, heads_q, dim), (total, heads_kv, dim), (total, heads_kv, dim)))
    options = dict(layout="thd", mask="padding", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=1,
                   max_seqlen_kv=16, return_lse=True)
    g = jnp.asarray(rng.standard_normal((batch, heads_q, dim)), jnp.float32)

    def run(backend, q, k, v):
        def loss(q, k, v):
            result = fj.attention(q, k, v, backend=backend, **options)
            lse = jnp.where(jnp.isfinite(result.lse), result.lse, 0.0)  # empty sequences: -inf
            return (result.out.astype(jnp.float32) * g).sum() + lse.sum(), result
        (_, result), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return result.out, result.lse, grads

    out, lse, grads = jax.jit(lambda *x: run("small_seq", *x))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse, want_grads = jax.jit(lambda *x: run("reference", *x))(*f32)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want_out), atol=2e-2, rtol=2e-2)
    finite = np.isfinite(np.asarray(want_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), finite)
    np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=1e-2, rtol=1e-3)
    for name, got, want in zip("qkv", grads, want_grads):
        scale = float(np.abs(np.asarray(want)).max())
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2 * max(scale, 1.0),
                                   err_msg=f"d{name}")
