"""The small_seq Triton kernels under TRITON_INTERPRET=1 (on the CPU) against the reference,
forward and every gradient: ragged key lengths, GQA/MQA, head dims, padded layouts, packed
kv, gaps, empty sequences; plus selection and the backend's reasons."""

from __future__ import annotations

import os

import numpy as np
import pytest
from needs_torch import import_torch

torch = import_torch("Triton interpreter runs of the small_seq kernels go through torch (JAX's by buffer callbacks)")
pytest.importorskip("triton")

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.small_seq import ENV_ON_CPU, MAX_SEQLEN_KV, MAX_SEQLEN_KV_MHA  # noqa: E402
from fusedattn.backends.small_seq.blocks import plan  # noqa: E402


@pytest.fixture(autouse=True)
def interpreter(monkeypatch, fresh_selection):
    """Triton's interpreter runs the kernels on the CPU; conftest turns it on before triton loads.
    CPU calls may then select small_seq: fresh_selection forgets decisions made before, and ours after."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in Triton's interpreter on CPU machines (tests/gpu has the GPU tests)")
    monkeypatch.setenv(ENV_ON_CPU, "1")


def cu(lengths, starts=None):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] if starts is None else starts,
                        dtype=torch.int32)


def rand(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_()


def run(backend, tensors, with_lse_loss=False, **options):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    result = fat.attention(*leaves, backend=backend, return_lse=True, **options)
    weights = torch.linspace(-1, 1, result.out.numel()).reshape(result.out.shape)
    loss = (result.out.float() * weights).sum()
    if with_lse_loss:
        loss = loss + torch.where(torch.isfinite(result.lse), result.lse, 0.0).sum() * 0.5
    return result, torch.autograd.grad(loss, leaves)


def check(tensors, *, with_lse_loss=False, **options):
    """small_seq against the reference (which computes in float32 from the same inputs)."""
    fused, fused_grads = run("small_seq", tensors, with_lse_loss, **options)
    ref, ref_grads = run("reference", tensors, with_lse_loss, **options)
    tol = 2e-2 if tensors[0].dtype == torch.bfloat16 else 4e-3
    torch.testing.assert_close(fused.out.float(), ref.out.float(), atol=tol, rtol=tol)
    finite = torch.isfinite(ref.lse)
    assert torch.equal(torch.isfinite(fused.lse), finite), "rows without keys: LSE -inf in both"
    torch.testing.assert_close(fused.lse[finite], ref.lse[finite], atol=1e-3, rtol=1e-3)
    for name, got, want in zip("qkv", fused_grads, ref_grads):
        scale = max(want.float().abs().max().item(), 1.0)
        torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol, msg=f"d{name}")
    return fused


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_thd_ragged_key_lengths(heads_q, heads_kv):
    lens_kv = [3, 16, 1, 0, 7, 2]
    total = sum(lens_kv)
    tensors = (rand(len(lens_kv), heads_q, 64, seed=1), rand(total, heads_kv, 64, seed=2),
               rand(total, heads_kv, 64, seed=3))
    out = check(tensors, layout="thd", mask="padding", cu_seqlens_q=cu([1] * len(lens_kv)),
                cu_seqlens_kv=cu(lens_kv))
    assert (out.out[3] == 0).all(), "a sequence without keys gives output 0"


@pytest.mark.parametrize("lens_kv,head_dim", [([33, 64, 17, 0], 64), ([64, 40], 128)])
def test_longer_keys_with_one_query_head_per_kv_head(lens_kv, head_dim):
    """MHA with D <= 128 takes up to MAX_SEQLEN_KV_MHA keys (BLOCK_N 64 tiles, ragged lengths)."""
    total = sum(lens_kv)
    tensors = (rand(len(lens_kv), 2, head_dim, seed=29), rand(total, 2, head_dim, seed=30),
               rand(total, 2, head_dim, seed=31))
    check(tensors, layout="thd", mask="padding", cu_seqlens_q=cu([1] * len(lens_kv)), cu_seqlens_kv=cu(lens_kv))


@pytest.mark.parametrize("head_dim,dtype", [(128, torch.float16), (256, torch.bfloat16), (512, torch.float16)])
def test_head_dims(head_dim, dtype):
    lens_kv = [5, 16, 2]
    total = sum(lens_kv)
    tensors = (rand(3, 2, head_dim, dtype=dtype, seed=4), rand(total, 1, head_dim, dtype=dtype, seed=5),
               rand(total, 1, head_dim, dtype=dtype, seed=6))
    check(tensors, layout="thd", mask="padding", cu_seqlens_q=cu([1, 1, 1]), cu_seqlens_kv=cu(lens_kv))


def test_packed_segments_with_gaps_empty_queries_and_trailing_tokens():
    # Four segments; the second has no query; tokens sit at padded offsets with gaps, and
    # the tensors run past the last segment.
    lens_q, lens_kv = [1, 0, 1, 1], [4, 3, 0, 16]
    starts_q, starts_kv = [0, 2, 3, 5, 6], [1, 7, 12, 13, 29]
    tensors = (rand(7, 4, 64, seed=7), rand(32, 2, 64, seed=8), rand(32, 2, 64, seed=9))
    check(tensors, layout="thd", mask="padding", cu_seqlens_q=cu(lens_q), cu_seqlens_kv=cu(lens_kv),
          cu_seqlens_q_padded=cu(None, starts_q), cu_seqlens_kv_padded=cu(None, starts_kv))
    tail = (rand(4, 4, 64, seed=10), rand(12, 4, 64, seed=11), rand(12, 4, 64, seed=12))  # tokens past the end
    out = check(tail, layout="thd", mask="padding", cu_seqlens_q=cu([1, 1]), cu_seqlens_kv=cu([5, 4]))
    assert (out.out[2:] == 0).all() and (out.lse[2:] == 0).all()


def test_packed_kv():
    lens_kv = [6, 1, 9]
    tensors = (rand(3, 4, 64, seed=13), rand(sum(lens_kv), 2, 2, 64, seed=14))
    check(tensors, layout="thd_t2hd", mask="padding", cu_seqlens_q=cu([1, 1, 1]), cu_seqlens_kv=cu(lens_kv))


@pytest.mark.parametrize("mask", ["none", "causal_bottom_right", "causal"])
def test_padded_bshd_with_one_query(mask):
    tensors = (rand(3, 1, 4, 64, seed=15), rand(3, 9, 2, 64, seed=16), rand(3, 9, 2, 64, seed=17))
    check(tensors, mask=mask)  # causal (top-left) with one query: it sees key 0 only


def test_padded_bshd_with_padding_masks():
    tensors = (rand(3, 1, 4, 64, seed=18), rand(3, 9, 2, 64, seed=19), rand(3, 9, 2, 64, seed=20))
    out = check(tensors, mask="padding", cu_seqlens_q=cu([1, 1, 0]), cu_seqlens_kv=cu([9, 0, 4]))
    assert (out.out[1:] == 0).all() and (out.lse[1:] == float("-inf")).all()
    check(tensors, mask="padding_causal", cu_seqlens_q=cu([1, 1, 0]), cu_seqlens_kv=cu([9, 0, 4]))


def test_gradient_through_the_lse():
    lens_kv = [4, 11]
    tensors = (rand(2, 2, 64, seed=21), rand(15, 2, 64, seed=22), rand(15, 2, 64, seed=23))
    check(tensors, with_lse_loss=True, layout="thd", mask="padding", cu_seqlens_q=cu([1, 1]),
          cu_seqlens_kv=cu(lens_kv), scale=0.3)


def test_selection_picks_small_seq_and_says_why_not(ran):
    lens = cu([1, 1])
    q, k, v = rand(2, 4, 64, seed=24), rand(20, 4, 64, seed=25), rand(20, 4, 64, seed=26)
    fat.attention(q, k, v, layout="thd", mask="padding", cu_seqlens_q=lens, cu_seqlens_kv=cu([3, 16]))
    assert ran[0][0] == "small_seq"
    long_keys = cu([3, MAX_SEQLEN_KV_MHA + 1])
    k_long, v_long = rand(68, 4, 64, seed=27), rand(68, 4, 64, seed=28)
    with pytest.raises(fusedattn.NoBackendError, match=f"Skv={MAX_SEQLEN_KV_MHA + 1} > {MAX_SEQLEN_KV_MHA}"):
        fat.small_seq_attention(q, k_long, v_long, layout="thd", mask="padding", cu_seqlens_q=lens,
                                cu_seqlens_kv=long_keys)
    grouped = cu([3, MAX_SEQLEN_KV + 1])  # with grouped heads the limit stays at 16
    with pytest.raises(fusedattn.NoBackendError, match=f"Skv={MAX_SEQLEN_KV + 1} > {MAX_SEQLEN_KV}"):
        fat.small_seq_attention(q, k[:, :2], v[:, :2], layout="thd", mask="padding", cu_seqlens_q=lens,
                                cu_seqlens_kv=grouped)
    for options, needle in [(dict(dropout_p=0.1), "dropout_p=0.1"), (dict(softmax_type="off_by_one"), "softmax"),
                            (dict(window=(2, 0)), "left window")]:
        with pytest.raises(fusedattn.NoBackendError, match=needle):
            fat.small_seq_attention(q, k, v, layout="thd", mask="padding", cu_seqlens_q=lens,
                                    cu_seqlens_kv=cu([3, 16]), **options)
    with pytest.raises(ValueError, match="backend: expected None or 'small_seq'"):
        fat.small_seq_attention(q, k, v, backend="cudnn")


def test_kernel_plans_follow_the_measurements():
    assert plan(1, 16, 128, backward=False).kernel == "dot" and plan(1, 16, 128, backward=True).kernel == "reduce"
    assert plan(1, 16, 512, backward=False) == ("reduce", 2, {"BLOCK_N": 16, "BLOCK_D": 512})
    assert plan(1, 3, 64, backward=False) == ("reduce", 1, {"BLOCK_N": 4, "BLOCK_D": 64})
    for group in (2, 8, 16):  # shared KV heads: the heads are the rows of tensor-core products
        chosen = plan(group, 5, 256, backward=True)
        assert chosen.kernel == "dot" and chosen.meta == {"BLOCK_G": 16, "BLOCK_N": 16, "BLOCK_D": 256}


@pytest.mark.parametrize("heads_q,heads_kv,keys,head_dim", [(4, 4, 12, 64), (4, 4, 3, 128), (4, 1, 9, 64)])
def test_each_kernel_form_matches_the_reference_in_float16(heads_q, heads_kv, keys, head_dim):
    # Triton's interpreter has no bfloat16 products: the tensor-core form is checked in float16 here.
    lens_kv = [keys, 1, keys - 1]
    total = sum(lens_kv)
    f16 = torch.float16
    tensors = (rand(3, heads_q, head_dim, dtype=f16, seed=30), rand(total, heads_kv, head_dim, dtype=f16, seed=31),
               rand(total, heads_kv, head_dim, dtype=f16, seed=32))
    check(tensors, layout="thd", mask="padding", cu_seqlens_q=cu([1, 1, 1]), cu_seqlens_kv=cu(lens_kv))


def test_jax_calls_run_the_kernels_through_buffer_callbacks(ran):
    """JAX -> buffer_callback -> torch views of XLA's buffers -> the kernels, under jit, grad and vmap."""
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    jnp = jax.numpy
    lens = [3, 16, 1, 0, 7]
    cu_kv = jnp.asarray(cu(lens).numpy())
    cu_q = jnp.arange(len(lens) + 1, dtype=jnp.int32)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (5, 4, 64), jnp.bfloat16)
    k = jax.random.normal(keys[1], (27, 2, 64), jnp.bfloat16)
    v = jax.random.normal(keys[2], (27, 2, 64), jnp.bfloat16)
    options = dict(layout="thd", mask="padding", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=1,
                   max_seqlen_kv=16)

    def loss(q, k, v, backend):
        return (fj.attention(q, k, v, backend=backend, **options).astype(jnp.float32) ** 2).sum()

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    got, want = grad(q, k, v, "small_seq"), grad(q, k, v, "reference")
    for g, w in zip(got, want):
        scale = float(jnp.abs(w.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), atol=2e-2 * scale, rtol=2e-2)
    fj.attention(q, k, v, **options)
    assert ran[-1][0] == "small_seq", "selected for JAX calls too"
    stacked = jnp.stack([q, q * 0.5])
    batched = jax.vmap(lambda q: fj.attention(q, k, v, backend="small_seq", **options))(stacked)
    np.testing.assert_allclose(np.asarray(batched[1], np.float32),
                               np.asarray(fj.attention(q * 0.5, k, v, **options), np.float32), atol=1e-6)


def test_jax_padded_bshd_and_a_gradient_through_the_lse():
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    jnp = jax.numpy
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (3, 1, 4, 64), jnp.float16)
    k = jax.random.normal(keys[1], (3, 9, 2, 64), jnp.float16)
    v = jax.random.normal(keys[2], (3, 9, 2, 64), jnp.float16)
    options = dict(mask="padding", cu_seqlens_q=jnp.asarray([0, 1, 2, 2], jnp.int32),
                   cu_seqlens_kv=jnp.asarray([0, 9, 9, 13], jnp.int32), return_lse=True)

    def loss(q, k, v, backend):
        result = fj.attention(q, k, v, backend=backend, **options)
        lse = jnp.where(jnp.isfinite(result.lse), result.lse, 0.0)
        return (result.out.astype(jnp.float32) ** 2).sum() + 0.5 * lse.sum()

    for backend_grads in zip(*(jax.grad(loss, argnums=(0, 1, 2))(q, k, v, b) for b in ("small_seq", "reference"))):
        got, want = (np.asarray(x, np.float32) for x in backend_grads)
        np.testing.assert_allclose(got, want, atol=4e-3 * max(np.abs(want).max(), 1.0), rtol=4e-3)
    result = fj.small_seq_attention(q, k, v, **options)
    assert (np.asarray(result.out[1:], np.float32) == 0).all(), "empty sequences give 0"


def test_torch_compile_fullgraph_runs_the_kernels_through_the_custom_ops(ran):
    tensors = (rand(6, 1, 4, 64, dtype=torch.float16, seed=40), rand(6, 9, 2, 64, dtype=torch.float16, seed=41),
               rand(6, 9, 2, 64, dtype=torch.float16, seed=42))
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def step(q, k, v):
        return fat.attention(q, k, v, backend="small_seq").float().square().sum()

    loss = torch.compile(step, backend="aot_eager", fullgraph=True)(*leaves)
    grads = torch.autograd.grad(loss, leaves)
    assert {name for name, _, _ in ran} == {"small_seq"}
    wide = [t.detach().double().requires_grad_() for t in tensors]
    want = fat.attention(*wide, backend="reference").square().sum()
    want_grads = torch.autograd.grad(want, wide)
    torch.testing.assert_close(loss.double(), want, rtol=2e-3, atol=2e-3)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_top_left_causal_gives_zero_gradient_to_the_keys_after_the_first(layout):
    # Found by the fuzzer: the kernel writes dK/dV of key 0 only, and the rest came from torch.empty.
    poison = torch.full((4096,), float("nan"), dtype=torch.float16)  # leave NaN in the allocator's free memory
    del poison
    if layout == "thd":
        q = rand(2, 2, 64, dtype=torch.float16, seed=1).requires_grad_(True)
        k, v = (rand(12, 2, 64, dtype=torch.float16, seed=s).requires_grad_(True) for s in (2, 3))
        options = dict(layout="thd", mask="padding_causal", cu_seqlens_q=cu([1, 1]), cu_seqlens_kv=cu([4, 8]))
    else:
        q = rand(2, 1, 2, 64, dtype=torch.float16, seed=1).requires_grad_(True)
        k, v = (rand(2, 6, 2, 64, dtype=torch.float16, seed=s).requires_grad_(True) for s in (2, 3))
        options = dict(mask="causal")
    out = fat.attention(q, k, v, backend="small_seq", **options)
    dk, dv = torch.autograd.grad(out.float().sum(), (k, v))
    leaves = [x.detach().float().requires_grad_(True) for x in (q, k, v)]
    ref = fat.attention(*leaves, backend="reference", **options)
    ref_dk, ref_dv = torch.autograd.grad(ref.sum(), leaves[1:])
    torch.testing.assert_close(dk.float(), ref_dk, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(dv.float(), ref_dv, atol=2e-3, rtol=2e-3)
