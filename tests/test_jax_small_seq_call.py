"""small_seq from JAX through jax-triton (fusedattn/jax/small_seq_call.py), on the CPU.

jax-triton only imports with a GPU JAX, so a stand-in takes its place: it hands the very arguments
jax-triton would get to the kernel in Triton's interpreter (through torch tensors, inside a
pure_callback), with outputs poisoned with NaN unless zeroed. That checks what the JAX launcher
owns: argument order against the kernels' signatures, views and strides, the sequence tables, the
zeroed outputs, shapes and the gradients' routing, against the reference backend under jit and grad.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch: the stand-in runs the kernels in Triton's interpreter")
jax = pytest.importorskip("jax")
pytest.importorskip("triton")

import jax.numpy as jnp  # noqa: E402

import fusedattn.jax as fj  # noqa: E402
from fusedattn.backends.small_seq import ENV_ON_CPU  # noqa: E402
from fusedattn.jax import small_seq_call  # noqa: E402


def _fake_triton_call(calls):
    def triton_call(*args, kernel, out_shape, grid, num_warps, zeroed_outputs=(), **meta):
        if "INTERPRET" in meta:  # what the GPU compiles as bfloat16/float16 products, the interpreter runs in float32
            meta["INTERPRET"] = True
        def is_array(a):  # as jax-triton tells them apart: a NumPy float32 is a scalar
            return hasattr(a, "shape") and not isinstance(a, np.generic)

        assert not any(isinstance(a, float) for a in args), "a Python float would be fp64 in jax-triton"
        arrays = [a for a in args if is_array(a)]

        def host(*values):  # runs when the program runs: `calls` counts launches, not traces
            calls.append(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel.__name__)
            values = iter(values)
            tensors = [torch.from_numpy(np.array(next(values))) if is_array(a)
                       else a.item() if isinstance(a, np.generic) else a for a in args]
            outs = [torch.zeros(s.shape, dtype=getattr(torch, np.dtype(s.dtype).name)) if i in zeroed_outputs
                    else torch.full(s.shape, float("nan"), dtype=getattr(torch, np.dtype(s.dtype).name))
                    for i, s in enumerate(out_shape)]
            kernel[grid](*tensors, *outs, num_warps=num_warps, **meta)
            return tuple(o.numpy() for o in outs)

        return jax.pure_callback(host, tuple(out_shape), *arrays)

    return triton_call


@pytest.fixture
def launches(monkeypatch, fresh_selection):
    """The kernels launched through the jax-triton stand-in, by name, as they run."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in Triton's interpreter on CPU machines (tests/gpu has the GPU tests)")
    monkeypatch.setenv(ENV_ON_CPU, "1")
    calls = []
    monkeypatch.setitem(sys.modules, "jax_triton", types.SimpleNamespace(triton_call=_fake_triton_call(calls)))
    monkeypatch.setattr(small_seq_call, "runs", lambda cfg: True)
    return calls


def _random(shape, seed, dtype=jnp.float16):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


def _loss_and_grads(backend, q, k, v, options):
    weights = None

    def loss(q, k, v):
        nonlocal weights
        result = fj.attention(q, k, v, backend=backend, return_lse=True, **options)
        out = result.out.astype(jnp.float32)
        weights = jnp.linspace(-1.0, 1.0, out.size).reshape(out.shape)
        lse = jnp.where(jnp.isfinite(result.lse), result.lse, 0.0)
        return (out * weights).sum() + 0.5 * lse.sum(), result

    (_, result), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return result, grads


def _check(q, k, v, **options):
    fused, fused_grads = _loss_and_grads("small_seq", q, k, v, options)
    ref, ref_grads = _loss_and_grads("reference", q, k, v, options)
    np.testing.assert_allclose(np.asarray(fused.out, np.float32), np.asarray(ref.out, np.float32), atol=4e-3,
                               rtol=4e-3)
    assert np.array_equal(np.isfinite(fused.lse), np.isfinite(ref.lse)), "rows without keys: LSE -inf in both"
    finite = np.isfinite(np.asarray(ref.lse))
    np.testing.assert_allclose(np.asarray(fused.lse)[finite], np.asarray(ref.lse)[finite], atol=1e-3, rtol=1e-3)
    for name, got, want in zip("qkv", fused_grads, ref_grads):
        want = np.asarray(want, np.float32)
        scale = max(float(np.abs(want).max()), 1.0)
        np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=4e-3 * scale, rtol=4e-3, err_msg=f"d{name}")
    return fused, fused_grads


@pytest.mark.parametrize("heads_q,heads_kv", [(4, 4), (4, 1)], ids=["mha", "mqa"])
def test_thd_with_gaps_empty_sequences_and_an_lse_gradient(launches, heads_q, heads_kv):
    lens_kv = [3, 16, 0, 7]
    starts_kv = [0, 5, 23, 24, 34]  # gaps after sequences 0, 1 and 3
    cu_q = jnp.asarray([0, 1, 2, 3, 4], jnp.int32)
    cu_kv = jnp.asarray(np.concatenate([[0], np.cumsum(lens_kv)]), jnp.int32)
    q = _random((4, heads_q, 64), 1)
    k, v = _random((34, heads_kv, 64), 2), _random((34, heads_kv, 64), 3)
    fused, grads = _check(q, k, v, layout="thd", mask="padding", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                          cu_seqlens_q_padded=cu_q, cu_seqlens_kv_padded=jnp.asarray(starts_kv, jnp.int32),
                          max_seqlen_q=1, max_seqlen_kv=16)
    assert {"small_seq_forward", "small_seq_forward_dot"} & set(launches), launches
    assert {"small_seq_backward", "small_seq_backward_dot"} & set(launches), launches
    assert not np.asarray(fused.out[2]).any(), "a sequence without keys gives output 0"
    gaps = np.r_[3:5, 21:23, 31:34]
    assert not np.asarray(grads[1])[gaps].any() and not np.asarray(grads[2])[gaps].any(), "gap tokens: zero"


@pytest.mark.parametrize("mask", ["no_mask", "padding"])
def test_padded_bshd_with_grouped_heads(launches, mask):
    batch, keys = 3, 9
    options = {}
    if mask == "padding":
        options = dict(mask="padding", cu_seqlens_q=jnp.asarray([0, 1, 2, 3], jnp.int32),
                       cu_seqlens_kv=jnp.asarray([0, 9, 13, 14], jnp.int32))
    q = _random((batch, 1, 4, 64), 4)
    k, v = _random((batch, keys, 2, 64), 5), _random((batch, keys, 2, 64), 6)
    _check(q, k, v, **options)
    assert len(launches) == 2, launches


def test_top_left_causal_zeroes_the_keys_after_the_first(launches):
    q = _random((2, 1, 2, 32), 7)
    k, v = _random((2, 5, 2, 32), 8), _random((2, 5, 2, 32), 9)
    _, grads = _check(q, k, v, mask="causal")
    assert not np.asarray(grads[1])[:, 1:].any() and np.asarray(grads[1])[:, 0].any()


def test_sequences_without_tokens(launches):
    """Zero-token arrays: empty results of the right shapes (XLA may skip a launch without outputs)."""
    empty = jnp.asarray([0, 0, 0], jnp.int32)
    q, k, v = _random((0, 2, 32), 10), _random((0, 2, 32), 11), _random((0, 2, 32), 12)
    out = fj.attention(q, k, v, backend="small_seq", layout="thd", mask="padding", cu_seqlens_q=empty,
                       cu_seqlens_kv=empty, max_seqlen_q=1, max_seqlen_kv=1)
    grads = jax.grad(lambda q, k, v: fj.attention(q, k, v, backend="small_seq", layout="thd", mask="padding",
                                                  cu_seqlens_q=empty, cu_seqlens_kv=empty, max_seqlen_q=1,
                                                  max_seqlen_kv=1).sum(), argnums=(0, 1, 2))(q, k, v)
    assert out.shape == (0, 2, 32) and [g.shape for g in grads] == [(0, 2, 32)] * 3


def test_jax_triton_is_used_only_on_a_gpu_where_it_imports(monkeypatch):
    cfg = types.SimpleNamespace(device="cpu")
    assert not small_seq_call.runs(cfg), "the CPU interpreter path goes through torch"
    monkeypatch.setattr(small_seq_call, "unavailable", lambda: "jax-triton is not importable")
    assert not small_seq_call.runs(types.SimpleNamespace(device="cuda"))


def _per_item(fn, *batched):
    return [fn(*(x[i] for x in batched)) for i in range(batched[0].shape[0])]


def test_vmap_folds_the_items_into_the_batch(launches):
    """vmap over q, k, v and the sequence lengths of a padded call: one launch a pass, each item's
    results and gradients as if called alone."""
    items, batch, keys = 3, 2, 7
    q = _random((items, batch, 1, 4, 32), 13)
    k, v = _random((items, batch, keys, 2, 32), 14), _random((items, batch, keys, 2, 32), 15)
    lengths = np.array([[7, 3], [0, 5], [2, 7]])
    cu = jnp.asarray(np.concatenate([np.zeros((items, 1), int), np.cumsum(lengths, 1)], 1), jnp.int32)
    ones = jnp.asarray(np.arange(batch + 1), jnp.int32)

    def attend(q, k, v, cu_kv):
        return fj.attention(q, k, v, backend="small_seq", mask="padding", cu_seqlens_q=ones, cu_seqlens_kv=cu_kv)

    def loss(q, k, v, cu_kv):
        return (attend(q, k, v, cu_kv).astype(jnp.float32) ** 2).sum()

    out = jax.jit(jax.vmap(attend))(q, k, v, cu)
    assert len(launches) == 1, launches
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v, cu)
    assert len(launches) == 3, launches  # the forward again (it saves the LSE), and the backward
    alone = _per_item(attend, q, k, v, cu)
    alone_grads = _per_item(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, cu)
    np.testing.assert_array_equal(np.asarray(out), np.stack([np.asarray(x) for x in alone]))
    for i, item_grads in enumerate(alone_grads):
        for got, want in zip(grads, item_grads):
            np.testing.assert_allclose(np.asarray(got[i], np.float32), np.asarray(want, np.float32), atol=1e-3)


def test_vmap_of_shared_keys_broadcasts_them_and_thd_runs_item_by_item(launches):
    q = _random((3, 2, 1, 2, 32), 16)
    k, v = _random((2, 5, 2, 32), 17), _random((2, 5, 2, 32), 18)
    out = jax.vmap(lambda q: fj.attention(q, k, v, backend="small_seq"))(q)
    assert len(launches) == 1
    np.testing.assert_array_equal(np.asarray(out[2]), np.asarray(fj.attention(q[2], k, v, backend="small_seq")))
    cu = jnp.asarray([0, 1, 2], jnp.int32)
    thd = jax.vmap(lambda q: fj.attention(q, k.reshape(10, 2, 32), v.reshape(10, 2, 32), backend="small_seq",
                                          layout="thd", mask="padding", cu_seqlens_q=cu,
                                          cu_seqlens_kv=jnp.asarray([0, 5, 10], jnp.int32), max_seqlen_q=1,
                                          max_seqlen_kv=5))(q[:, :, 0])
    np.testing.assert_allclose(np.asarray(thd, np.float32), np.asarray(out[:, :, 0], np.float32), atol=1e-3)


@pytest.mark.parametrize("before", [None, "/somewhere/triton-cache"])
def test_importing_jax_triton_leaves_the_triton_cache_dir_as_it_was(tmp_path, monkeypatch, before):
    """jax-triton's import sets TRITON_CACHE_DIR to "" for the process, after which every Triton kernel torch
    compiles fails ("Could not create or locate cache dir"): the launcher puts the variable back."""
    package = tmp_path / "jax_triton"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nos.environ['TRITON_CACHE_DIR'] = ''\nIMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    if before is None:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("TRITON_CACHE_DIR", before)
    assert small_seq_call._jax_triton().IMPORTED
    assert os.environ.get("TRITON_CACHE_DIR") == before


def test_jax_triton_finds_the_tf32_constant_it_imports_from_triton():
    """jax-triton 0.4 imports TMA_TF32 from Triton's NVIDIA driver, which Triton 3.6 lacks: the import failed
    and jax-triton stubbed the whole NVIDIA backend ('_Stub' object has no attribute 'backend' at the first
    launch, H100, torch blocked or not). The launcher defines it before importing jax-triton."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    small_seq_call._tf32_constant_for_jax_triton()
    from triton.backends.nvidia.driver import TMA_TF32  # noqa: F401  (what jax-triton imports)

    assert isinstance(driver.TMA_TF32, int)


def test_a_jax_triton_that_stubbed_its_nvidia_backend_is_unavailable_with_the_reason(tmp_path, monkeypatch):
    package = tmp_path / "jax_triton"
    package.mkdir()
    (package / "__init__.py").write_text("from jax_triton import triton_lib\n__version__ = '0.0-test'\n")
    (package / "triton_lib.py").write_text(
        "import types\nclass _Stub:\n    pass\ncb = types.SimpleNamespace(GPUTarget=_Stub)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.delitem(sys.modules, "jax_triton.triton_lib", raising=False)
    reason = small_seq_call.unavailable.__wrapped__()
    assert reason is not None and "jax-triton 0.0-test could not load Triton" in reason and "stubs" in reason
