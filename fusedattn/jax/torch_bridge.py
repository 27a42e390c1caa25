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
import jax.numpy as jnp
from jax.experimental.buffer_callback import buffer_callback

from fusedattn.backends.base import ARRAY_NAMES, DIFFERENTIABLE, AttentionInputs, AttentionOutputs
from fusedattn.config import AttentionConfig
from fusedattn.jax.partition import Split
from fusedattn.jax.pass_calls import aux_arrays, lse_role, output_shapes, present, roles, run_split, unpacked

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


def _forward_shapes(cfg: AttentionConfig, operands) -> tuple[jax.ShapeDtypeStruct, ...]:
    return output_shapes(cfg, operands[0])


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
    cfg = unpacked(cfg)
    index, passed = present(arrays)
    aux_names, aux = aux_arrays(score_mod)

    def run(local_cfg, operands):
        def through_torch(ctx, outs, *buffers):
            with _torch_stream(ctx):
                tensors, targets = _views(buffers), _views(outs)
                inputs = _inputs(index, tensors, score_mod, aux_names)
                _fill(targets, backend.forward_into(local_cfg, inputs, AttentionOutputs(*targets)))

        lean = _lean(backend, local_cfg, index, aux)
        shapes = _forward_shapes(local_cfg, operands)
        callback = through_torch if lean is None else _lean_callback(lean, "forward", outputs=2)  # not max_logit
        return tuple(buffer_callback(callback, shapes, vmap_method="sequential")(*operands))

    operand_roles = roles(cfg, index)
    return run_split(cfg, run, _forward_shapes, passed + aux, operand_roles + ["BHQK"] * len(aux),
                     (operand_roles[0], lse_role(cfg), "H"), (False, False, False), index, len(aux), split)


def backward(cfg: AttentionConfig, backend, score_mod, arrays, out, lse, grad_out, grad_lse,
             split: Split | None = None) -> dict:
    """{name: gradient} for the differentiable arrays; grad_out/grad_lse None mean zero."""
    cfg = unpacked(cfg)
    index, passed = present(arrays)
    aux_names, aux = aux_arrays(score_mod)
    wanted = [i for i in index if ARRAY_NAMES[i] in DIFFERENTIABLE]
    extra = [out, lse, jnp.zeros_like(out) if grad_out is None else grad_out]
    if grad_lse is not None:
        extra.append(grad_lse)

    def gradient_shapes(_cfg, operands):  # each gradient has its array's shape and dtype
        return tuple(jax.ShapeDtypeStruct(operands[index.index(i)].shape, operands[index.index(i)].dtype)
                     for i in wanted)

    def run(local_cfg, operands):
        def through_torch(ctx, outs, *buffers):
            with _torch_stream(ctx):
                tensors, targets = _views(buffers), _views(outs)
                count = len(index) + len(aux)
                inputs = _inputs(index, tensors[:count], score_mod, aux_names)
                out_t, lse_t, grad_out_t, *grad_lse_t = tensors[count:]
                into = {ARRAY_NAMES[i]: t for i, t in zip(wanted, targets)}
                grads = backend.backward_into(local_cfg, inputs, AttentionOutputs(out_t, lse_t), grad_out_t,
                                              grad_lse_t[0] if grad_lse_t else None, into)
                _fill(targets, [grads[ARRAY_NAMES[i]] for i in wanted])

        lean = _lean(backend, local_cfg, index, aux, grad_lse)
        shapes = gradient_shapes(local_cfg, operands)
        callback = through_torch if lean is None else _lean_callback(lean, "backward", outputs=3)
        return tuple(buffer_callback(callback, shapes, vmap_method="sequential")(*operands))

    operand_roles = roles(cfg, index)
    q_role, lse_axes = operand_roles[0], lse_role(cfg)
    extra_roles = [q_role, lse_axes, q_role, lse_axes][:len(extra)]
    out_roles = [operand_roles[index.index(i)] for i in wanted]
    summed = [ARRAY_NAMES[i] not in ("q", "k", "v") for i in wanted]
    grads = run_split(cfg, run, gradient_shapes, passed + aux + extra,
                      operand_roles + ["BHQK"] * len(aux) + extra_roles, out_roles, summed, index, len(aux), split)
    return {ARRAY_NAMES[i]: g for i, g in zip(wanted, grads)}
