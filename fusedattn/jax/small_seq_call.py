"""The small_seq backend from JAX: its Triton kernels (backends/small_seq/kernels.py, the file the torch
launcher uses too) run inside the XLA program through jax-triton, with no torch and no Python at run
time. The sequence tables are made in jax.numpy (int32; the kernels widen them). The scale goes as a
NumPy float32: jax-triton types a Python float as fp64, which the kernels' float32 sums would inherit.

Views: a padded call (Sq = 1) reads q as (B, H, D) and the keys as (B * Skv, Hkv, D); THD arrays are
(T, H, D) already. THD tokens outside every sequence, and keys a top-left causal call never reads,
are zeroed before the kernel (the kernels write only the rows they own there).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.backends.small_seq.blocks import plan, sees_first_key_only, sequence_tables
from fusedattn.config import AttentionConfig
from fusedattn.jax.partition import Split
from fusedattn.jax.pass_calls import backward_call, forward_call

__all__ = ["unavailable", "runs", "forward", "backward"]


TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def _jax_triton():
    """jax_triton, imported with Triton's cache directory left as it was: its import sets TRITON_CACHE_DIR
    to "" for the whole process (it compiles without Triton's file cache), after which every Triton kernel
    that torch or the small_seq torch launcher compiles fails with "Could not create or locate cache dir"."""
    before = os.environ.get(TRITON_CACHE_ENV)
    try:
        _tf32_constant_for_jax_triton()
        import jax_triton
    finally:
        if before is None:
            os.environ.pop(TRITON_CACHE_ENV, None)
        else:
            os.environ[TRITON_CACHE_ENV] = before
    return jax_triton


def _tf32_constant_for_jax_triton() -> None:
    """jax-triton 0.4 imports TMA_TF32 from Triton's NVIDIA driver, which Triton 3.6 (the version this
    library pins) does not define: the import fails and jax-triton puts stubs in place of the whole NVIDIA
    backend, so every launch fails. The constant is the CUDA tensor-map type of TF32 rounding, used only by
    TMA descriptors (the kernels here have none)."""
    try:
        import triton.backends.nvidia.driver as nvidia_driver
    except ImportError:
        return
    if not hasattr(nvidia_driver, "TMA_TF32"):
        nvidia_driver.TMA_TF32 = 11  # CU_TENSOR_MAP_DATA_TYPE_TFLOAT32


@functools.cache
def unavailable() -> str | None:
    """Why the kernels cannot run through jax-triton here (None: they can)."""
    try:
        jax_triton = _jax_triton()
    except ImportError as error:  # jax-triton raises ImportError on a JAX without GPU support, too
        return f"jax-triton is not importable ({error}); pip install jax-triton"
    lib = getattr(jax_triton, "triton_lib", None)
    stub = getattr(lib, "_Stub", None)
    if stub is not None and getattr(getattr(lib, "cb", None), "GPUTarget", None) is stub:
        import triton

        return (f"jax-triton {getattr(jax_triton, '__version__', '?')} could not load Triton {triton.__version__}'s "
                "NVIDIA backend (it put stubs in its place); install a jax-triton release made for this Triton")
    return None


def runs(cfg: AttentionConfig) -> bool:
    """Whether this call launches through jax-triton: a GPU call where it imports (Triton's CPU
    interpreter, for tests, goes through torch)."""
    return cfg.device == "cuda" and unavailable() is None


def _rows(x):
    """A contiguous (N, H, D) view of a padded (B, S, H, D) array, or a THD one as it is."""
    return x.reshape(-1, *x.shape[-2:])


def _strides(x) -> tuple[int, int]:
    """(token, head) strides of a contiguous (N, H, D) array, in elements."""
    return x.shape[1] * x.shape[2], x.shape[2]


def _tables(cfg: AttentionConfig, named: dict) -> tuple:
    cu_seqlens = {side: named.get(f"cu_seqlens_{side}") for side in ("q", "kv", "q_padded", "kv_padded")}
    return sequence_tables(cfg, cu_seqlens, lambda n: jnp.arange(n, dtype=jnp.int32),
                           lambda x: x.astype(jnp.int32))


def _kernel(cfg: AttentionConfig, backward: bool):
    """(kernel, launch keywords) of the plan for this call."""
    from fusedattn.backends.small_seq.kernels import kernel_of

    chosen = plan(cfg.gqa_group, cfg.seqlen_kv, cfg.head_dim_qk, backward=backward)
    kernel, meta = kernel_of(chosen, backward, interpret=False)
    return kernel, {"num_warps": chosen.num_warps, "grid": (cfg.batch * cfg.heads_kv,), "GROUP": cfg.gqa_group,
                    "HEAD_DIM": cfg.head_dim_qk, "PADDED": not cfg.layout.is_ragged, **meta}


def _launch(kernel, launch: dict, arguments, results, zeroed) -> tuple:
    """The kernel's results: one program per (sequence, KV head); a config has both."""
    return tuple(_jax_triton().triton_call(*arguments, kernel=kernel, out_shape=results, zeroed_outputs=zeroed,
                                        **launch))


def _forward_pass(cfg: AttentionConfig, named: dict, _aux: dict) -> tuple:
    q, k, v = (_rows(named[name]) for name in ("q", "k", "v"))
    ragged = cfg.layout.is_ragged
    kernel, launch = _kernel(cfg, backward=False)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:2], jnp.float32))
    out, lse = _launch(kernel, launch, (q, k, v, *_tables(cfg, named), *_strides(q), *_strides(k), *_strides(v),
                                        *_strides(q), np.float32(cfg.scale), cfg.heads_kv),
                       results, (0, 1) if ragged else ())
    if not ragged:
        out, lse = out[:, None], lse[..., None]  # (B, 1, Hq, D), (B, Hq, 1)
    return out, lse, jnp.zeros((0,), jnp.float32)


def _backward_pass(cfg: AttentionConfig, named: dict, _aux: dict, out, lse, grad_out, grad_lse, wanted) -> dict:
    q, k, v, do = (_rows(x) for x in (named["q"], named["k"], named["v"], grad_out))
    rows = q.shape[:2]
    lse = lse.reshape(rows)
    dlse = None if grad_lse is None else grad_lse.reshape(rows).astype(jnp.float32)
    kernel, launch = _kernel(cfg, backward=True)
    ragged = cfg.layout.is_ragged
    zeroed = tuple(i for i in (0, 1, 2) if ragged or (i and sees_first_key_only(cfg)))
    results = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
    grads = _launch(kernel, {**launch, "HAS_DLSE": dlse is not None},
                    (q, k, v, do.astype(q.dtype), lse, lse if dlse is None else dlse, *_tables(cfg, named),
                     *_strides(q), *_strides(k), *_strides(v), *_strides(q), *_strides(q), *_strides(k),
                     *_strides(v), np.float32(cfg.scale), cfg.heads_kv, cfg.seqlen_kv),
                    results, zeroed)
    return {name: grad.reshape(named[name].shape) for name, grad in zip(("q", "k", "v"), grads) if name in wanted}


def forward(cfg: AttentionConfig, score_mod, arrays, split: Split | None = None) -> tuple:
    """(out, lse, max_logit) of the small_seq forward, as JAX arrays (max_logit empty: not supported)."""
    return forward_call(cfg, score_mod, arrays, split, _forward_pass)


def backward(cfg: AttentionConfig, score_mod, arrays, out, lse, grad_out, grad_lse=None,
             split: Split | None = None) -> dict:
    """{name: gradient} of q, k, v; grad_out None means zero, grad_lse None means none."""
    return backward_call(cfg, score_mod, arrays, out, lse, grad_out, grad_lse, split, _backward_pass)
