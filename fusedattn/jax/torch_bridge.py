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
from fusedattn.jax.partition import ShardedCall, Split, shard_local
from fusedattn.layout import layout_spec
from fusedattn.score_mods.core import RuntimeScalar

__all__ = ["forward", "backward", "output_shapes"]

API = "fusedattn.jax.attention"
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


def _present(arrays) -> tuple[list[int], list]:
    index = [i for i, x in enumerate(arrays) if x is not None]
    return index, [arrays[i] for i in index]


def _aux(score_mod) -> tuple[list[str], list]:
    """The score_mod's aux arrays (names, arrays): operands of the callback, like q/k/v."""
    if score_mod is None:
        return [], []
    names = [name for name, value in score_mod.values.items() if not isinstance(value, RuntimeScalar)]
    return names, [score_mod.values[name] for name in names]


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


def output_shapes(cfg: AttentionConfig, q) -> tuple[jax.ShapeDtypeStruct, ...]:
    """(out, lse, max_logit) of a call, from the config and the unpacked q."""
    out = jax.ShapeDtypeStruct(tuple(q.shape[:-1]) + (cfg.head_dim_v,), jnp.dtype(cfg.out_dtype))
    lse_shape = (q.shape[0], cfg.heads_q) if cfg.layout.is_ragged else (cfg.batch, cfg.heads_q, cfg.seqlen_q)
    max_logit = (cfg.heads_q,) if cfg.return_max_logit else (0,)
    return (out, jax.ShapeDtypeStruct(lse_shape, jnp.float32), jax.ShapeDtypeStruct(max_logit, jnp.float32))


def _forward_shapes(cfg: AttentionConfig, operands) -> tuple[jax.ShapeDtypeStruct, ...]:
    return output_shapes(cfg, operands[0])


def _unpacked(cfg: AttentionConfig) -> AttentionConfig:
    """The config for separate q, k, v: JAX slices packed layouts into new arrays before the call."""
    return cfg.replace(layout=layout_spec(cfg.layout).base)


def _roles(cfg: AttentionConfig, index) -> list[str]:
    """Each operand's axes for sharding (see partition.py), right-aligned."""
    q_axes = layout_spec(cfg.layout).tensors[0][1]
    kv_axes = q_axes.replace("H", "G")
    roles = {"q": q_axes, "k": kv_axes, "v": kv_axes, "bias": "BHQK", "alibi_slopes": "BH", "sink": "H",
             "dropout_seed": "", "dropout_offset": ""}
    return [roles.get(ARRAY_NAMES[i], "N") for i in index]


def _lse_role(cfg: AttentionConfig) -> str:
    return "TH" if cfg.layout.is_ragged else "BHQ"


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


def _native_call(lean, direction: str, operands, shapes):
    """The pass as a native XLA custom call (fusedattn.jax.native) when the lean path applies and
    the native library runs here: no Python at run time. None otherwise."""
    if lean is None:
        return None
    import torch

    from fusedattn.jax import native

    plan = native.plan_id(lean, direction, torch.cuda.current_device(), len(operands) + len(shapes))
    if plan is None:
        return None
    workspace = jax.ShapeDtypeStruct((max(plan.workspace, 1),), jnp.uint8)
    call = jax.ffi.ffi_call(native.TARGET, (*shapes, workspace), vmap_method="sequential")
    return call(*operands, **plan.attributes)[:-1]


def _lean_callback(lean, direction: str, outputs: int):
    """A callback that hands XLA's buffer addresses (the inputs, then the first `outputs` results)
    straight to the backend, on XLA's stream."""
    def callback(ctx, outs, *buffers):
        lean(direction, _device(buffers[0]), ctx.stream, _addresses((*buffers, *outs[:outputs])))

    return callback


def _call(cfg, run, shapes, operands, roles, out_roles, summed, index, aux_count, split) -> tuple:
    """run over operands: whole, or once per shard of `split`. shapes(cfg, operands): the results'."""
    if split is None:
        return run(cfg, tuple(operands))
    seed_position = ARRAY_NAMES.index("dropout_seed")
    seed = index.index(seed_position) if seed_position in index else None
    pinned = tuple(range(len(index), len(index) + aux_count))
    call = ShardedCall(API, cfg, run, tuple(roles), tuple(out_roles), tuple(summed), shapes, seed, pinned)
    return shard_local(call, split, operands)


def forward(cfg: AttentionConfig, backend, score_mod, arrays, split: Split | None = None) -> tuple:
    """(out, lse, max_logit) of backend's forward, as JAX arrays."""
    cfg = _unpacked(cfg)
    index, present = _present(arrays)
    aux_names, aux = _aux(score_mod)

    def run(local_cfg, operands):
        def through_torch(ctx, outs, *buffers):
            with _torch_stream(ctx):
                tensors, targets = _views(buffers), _views(outs)
                inputs = _inputs(index, tensors, score_mod, aux_names)
                _fill(targets, backend.forward_into(local_cfg, inputs, AttentionOutputs(*targets)))

        lean = _lean(backend, local_cfg, index, aux)
        shapes = _forward_shapes(local_cfg, operands)
        native = _native_call(lean, "forward", operands, shapes)
        if native is not None:
            return tuple(native)
        callback = through_torch if lean is None else _lean_callback(lean, "forward", outputs=2)  # not max_logit
        return tuple(buffer_callback(callback, shapes, vmap_method="sequential")(*operands))

    roles = _roles(cfg, index)
    return _call(cfg, run, _forward_shapes, present + aux, roles + ["BHQK"] * len(aux),
                 (roles[0], _lse_role(cfg), "H"), (False, False, False), index, len(aux), split)


def backward(cfg: AttentionConfig, backend, score_mod, arrays, out, lse, grad_out, grad_lse,
             split: Split | None = None) -> dict:
    """{name: gradient} for the differentiable arrays; grad_out/grad_lse None mean zero."""
    cfg = _unpacked(cfg)
    index, present = _present(arrays)
    aux_names, aux = _aux(score_mod)
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
        native = _native_call(lean, "backward", operands, shapes)
        if native is not None:
            return tuple(native)
        callback = through_torch if lean is None else _lean_callback(lean, "backward", outputs=3)
        return tuple(buffer_callback(callback, shapes, vmap_method="sequential")(*operands))

    roles = _roles(cfg, index)
    q_role, lse_role = roles[0], _lse_role(cfg)
    extra_roles = [q_role, lse_role, q_role, lse_role][:len(extra)]
    out_roles = [roles[index.index(i)] for i in wanted]
    summed = [ARRAY_NAMES[i] not in ("q", "k", "v") for i in wanted]
    grads = _call(cfg, run, gradient_shapes, present + aux + extra, roles + ["BHQK"] * len(aux) + extra_roles,
                  out_roles, summed, index, len(aux), split)
    return {ARRAY_NAMES[i]: g for i, g in zip(wanted, grads)}
