"""Running a torch-implemented backend (Triton kernels) inside a JAX program.

Each pass is one `jax.experimental.buffer_callback`: XLA hands over its input and output
buffers, torch views them through DLPack (no copies of the inputs), the backend runs on
XLA's stream, and its results are copied into XLA's output buffers. Output shapes come
from the config alone, so tracing never runs a kernel. On the CPU the same path runs
(Triton's interpreter), which is how the CPU tests cover it.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from fusedattn.backends.base import ARRAY_NAMES, DIFFERENTIABLE, AttentionInputs, AttentionOutputs
from fusedattn.config import AttentionConfig

__all__ = ["forward", "backward"]


def _torch_stream(ctx):
    """XLA's stream as torch's current stream (GPU), or nothing to do (CPU)."""
    import torch

    try:
        stream = ctx.stream
    except Exception:  # a CPU computation has no stream ("XLA FFI GPU context is not available")
        return contextlib.nullcontext()
    if not stream or not torch.cuda.is_available():
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.ExternalStream(stream))


def _views(buffers):
    import torch

    return [torch.from_dlpack(b) for b in buffers]


def _fill(targets, results) -> None:
    for target, result in zip(_views(targets), results):
        if target.numel():
            target.copy_(result.reshape(target.shape))


def _present(arrays) -> tuple[list[int], list]:
    index = [i for i, x in enumerate(arrays) if x is not None]
    return index, [arrays[i] for i in index]


def _inputs(index, tensors, score_mod) -> AttentionInputs:
    values = [None] * len(ARRAY_NAMES)
    for i, tensor in zip(index, tensors):
        values[i] = tensor
    return AttentionInputs(**dict(zip(ARRAY_NAMES, values)), score_mod=score_mod)


def output_shapes(cfg: AttentionConfig, q) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(out, lse, max_logit) of a call, from the config and the unpacked q."""
    out = jax.ShapeDtypeStruct(tuple(q.shape[:-1]) + (cfg.head_dim_v,), jnp.dtype(cfg.out_dtype))
    lse_shape = (q.shape[0], cfg.heads_q) if cfg.layout.is_ragged else (cfg.batch, cfg.heads_q, cfg.seqlen_q)
    max_logit = (cfg.heads_q,) if cfg.return_max_logit else (0,)
    return (out, jax.ShapeDtypeStruct(lse_shape, jnp.float32), jax.ShapeDtypeStruct(max_logit, jnp.float32))


def forward(cfg: AttentionConfig, backend, score_mod, arrays) -> tuple:
    index, present = _present(arrays)

    def run(ctx, outs, *buffers):
        with _torch_stream(ctx):
            result, _ = backend.forward(cfg, _inputs(index, _views(buffers), score_mod))
            _fill(outs, result)

    shapes = output_shapes(cfg, arrays[0])
    return tuple(buffer_callback(run, shapes, vmap_method="sequential")(*present))


def backward(cfg: AttentionConfig, backend, score_mod, arrays, out, lse, grad_out, grad_lse) -> dict:
    index, present = _present(arrays)
    wanted = [i for i in index if ARRAY_NAMES[i] in DIFFERENTIABLE]

    def run(ctx, outs, *buffers):
        with _torch_stream(ctx):
            tensors = _views(buffers)
            inputs = _inputs(index, tensors[:len(index)], score_mod)
            out_t, lse_t, grad_out_t, grad_lse_t = tensors[len(index):]
            grads = backend.backward(cfg, inputs, None, AttentionOutputs(out_t, lse_t), grad_out_t, grad_lse_t)
            _fill(outs, [grads[ARRAY_NAMES[i]] for i in wanted])

    shapes = tuple(jax.ShapeDtypeStruct(arrays[i].shape, arrays[i].dtype) for i in wanted)
    grads = buffer_callback(run, shapes, vmap_method="sequential")(*present, out, lse, grad_out, grad_lse)
    return {ARRAY_NAMES[i]: g for i, g in zip(wanted, grads)}
