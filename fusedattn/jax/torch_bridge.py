"""Running a torch-implemented backend (cuDNN graphs, Triton kernels) inside a JAX program.

Each pass is one `jax.experimental.buffer_callback`: XLA hands over its input and output
buffers, torch views them through DLPack (no copies), the backend runs on XLA's stream and
writes into XLA's output buffers where it can (`Backend.forward_into`; anything else is
copied in). Output shapes come from the config alone, so tracing never runs a kernel.
score_mod aux arrays travel as operands. Sharded inputs run once per shard
(fusedattn/jax/partition.py). On the CPU the same path runs (Triton's interpreter), which is
how the CPU tests cover it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
from jax.experimental.buffer_callback import buffer_callback

from fusedattn.backends.base import ARRAY_NAMES, AttentionInputs, AttentionOutputs
from fusedattn.config import AttentionConfig
from fusedattn.jax.partition import Split
from fusedattn.jax.pass_calls import backward_call, forward_call, output_shapes

__all__ = ["forward", "backward"]

ENV_LEAN = "FUSEDATTN_JAX_LEAN"


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
    """Copy each result into its output buffer, unless the backend already wrote it there."""
    for target, result in zip(targets, results):
        if target.numel() and not (result.data_ptr() == target.data_ptr() and result.stride() == target.stride()):
            target.copy_(result.reshape(target.shape))


def _inputs(index, tensors, score_mod, aux_names) -> AttentionInputs:
    """AttentionInputs of torch views: arrays by position, then the aux arrays by name."""
    import torch

    values = dict.fromkeys(ARRAY_NAMES)
    for i, tensor in zip(index, tensors):
        values[ARRAY_NAMES[i]] = tensor
    for name in ("dropout_seed", "dropout_offset"):  # JAX's uint32 bits; the graphs take int64
        if values[name] is not None:
            values[name] = values[name].to(torch.int64)
    if aux_names:
        aux = dict(zip(aux_names, tensors[len(index):]))
        score_mod = dataclasses.replace(score_mod, values={**score_mod.values, **aux})
    return AttentionInputs(**values, score_mod=score_mod)


def _lean(backend, cfg: AttentionConfig, index, aux, grad_lse=None):
    """The backend's raw-address runner when this call qualifies: q, k, v only (no other arrays, no
    aux, no lse gradient) and a config the backend runs as is. FUSEDATTN_JAX_LEAN=0 turns it off."""
    if index != [0, 1, 2] or aux or grad_lse is not None or os.environ.get(ENV_LEAN, "1") == "0":
        return None
    return backend.address_runner(cfg)


def _addresses(buffers) -> list[int]:
    return [b.__cuda_array_interface__["data"][0] for b in buffers]


def _device(buffer) -> int:
    return buffer.__dlpack_device__()[1]


def _lean_callback(lean, direction: str, outputs: int):
    """A callback that hands XLA's buffer addresses (the inputs, then the first `outputs` results)
    straight to the backend, on XLA's stream."""
    def callback(ctx, outs, *buffers):
        lean(direction, _device(buffers[0]), ctx.stream, _addresses((*buffers, *outs[:outputs])))

    return callback


def forward(cfg: AttentionConfig, backend, score_mod, arrays, split: Split | None = None) -> tuple:
    """(out, lse, max_logit) of backend's forward, as JAX arrays."""
    def run_pass(local_cfg, named, aux):
        index = [ARRAY_NAMES.index(name) for name in named]
        operands = (*named.values(), *aux.values())

        def through_torch(ctx, outs, *buffers):
            with _torch_stream(ctx):
                tensors, targets = _views(buffers), _views(outs)
                inputs = _inputs(index, tensors, score_mod, list(aux))
                _fill(targets, backend.forward_into(local_cfg, inputs, AttentionOutputs(*targets)))

        lean = _lean(backend, local_cfg, index, aux)
        callback = through_torch if lean is None else _lean_callback(lean, "forward", outputs=2)  # not max_logit
        shapes = output_shapes(local_cfg, operands[0])
        return tuple(buffer_callback(callback, shapes, vmap_method="sequential")(*operands))

    return forward_call(cfg, score_mod, arrays, split, run_pass)


def backward(cfg: AttentionConfig, backend, score_mod, arrays, out, lse, grad_out, grad_lse,
             split: Split | None = None) -> dict:
    """{name: gradient} for the differentiable arrays; grad_out/grad_lse None mean zero."""
    def run_pass(local_cfg, named, aux, out, lse, grad_out, grad_lse, wanted):
        index = [ARRAY_NAMES.index(name) for name in named]
        operands = (*named.values(), *aux.values(), out, lse, grad_out, *(() if grad_lse is None else (grad_lse,)))

        def through_torch(ctx, outs, *buffers):
            with _torch_stream(ctx):
                tensors, targets = _views(buffers), _views(outs)
                count = len(named) + len(aux)
                inputs = _inputs(index, tensors[:count], score_mod, list(aux))
                out_t, lse_t, grad_out_t, *grad_lse_t = tensors[count:]
                grads = backend.backward_into(local_cfg, inputs, AttentionOutputs(out_t, lse_t), grad_out_t,
                                              grad_lse_t[0] if grad_lse_t else None, dict(zip(wanted, targets)))
                _fill(targets, [grads[name] for name in wanted])

        lean = _lean(backend, local_cfg, index, aux, grad_lse)
        callback = through_torch if lean is None else _lean_callback(lean, "backward", outputs=3)
        shapes = tuple(jax.ShapeDtypeStruct(named[name].shape, named[name].dtype) for name in wanted)
        return dict(zip(wanted, buffer_callback(callback, shapes, vmap_method="sequential")(*operands)))

    return backward_call(cfg, score_mod, arrays, out, lse, grad_out, grad_lse, split, run_pass)
