"""Forward and backward of the cuDNN backend on torch tensors (on torch's current stream)."""

from __future__ import annotations

import torch

from fusedattn.backends.base import AttentionInputs, AttentionOutputs
from fusedattn.backends.cudnn.runtime import as_layout, empty_like_spec, execute, get_graph
from fusedattn.backends.cudnn.spec import SdpaSpec, gradient_spec, sdpa_spec
from fusedattn.config import AttentionConfig, SoftmaxType
from fusedattn.layout import from_bhsd, layout_spec, to_bhsd


def _shared_buffers(cfg: AttentionConfig, spec: SdpaSpec, inputs: AttentionInputs) -> dict:
    base = layout_spec(cfg.layout).base
    view = lambda x: to_bhsd(x, base)  # noqa: E731
    buffers = {"q": as_layout(inputs.q, spec.q, view), "k": as_layout(inputs.k, spec.k, view),
               "v": as_layout(inputs.v, spec.v, view)}
    if spec.bias is not None:
        bias = inputs.bias.to(inputs.q.dtype).reshape(cfg.bias_shape).expand(spec.bias.dim)
        buffers["bias"] = bias if bias.stride()[2:] == spec.bias.stride[2:] else bias.contiguous()
    if spec.sink:
        if cfg.softmax is SoftmaxType.LEARNABLE:
            buffers["sink"] = inputs.sink.to(torch.float32).reshape(1, cfg.heads_q, 1, 1).contiguous()
        else:  # off_by_one: a zero logit per head
            buffers["sink"] = torch.zeros(1, cfg.heads_q, 1, 1, dtype=torch.float32, device=inputs.q.device)
    if spec.dropout:
        buffers["dropout_seed"] = inputs.dropout_seed.reshape(1, 1, 1, 1)
        buffers["dropout_offset"] = inputs.dropout_offset.reshape(1, 1, 1, 1)
    return buffers


def forward(cfg: AttentionConfig, inputs: AttentionInputs) -> AttentionOutputs:
    device = inputs.q.device.index
    spec = sdpa_spec(cfg)
    base = layout_spec(cfg.layout).base
    buffers = _shared_buffers(cfg, spec, inputs)
    out_shape = from_bhsd(torch.empty(spec.o.dim, device="meta"), base).shape
    out = torch.empty(out_shape, dtype=inputs.q.dtype, device=inputs.q.device)  # contiguous in the base layout
    buffers["o"] = to_bhsd(out, base)
    stat_names = ("row_max", "sum_exp") if spec.max_logit else ("stats",)
    for name in stat_names:
        buffers[name] = empty_like_spec(spec.stats, torch.float32, inputs.q.device)
    execute(get_graph(cfg, "forward", device), buffers, device)
    if spec.max_logit:
        row_max = buffers["row_max"]
        lse = row_max + torch.log(buffers["sum_exp"])
        max_logit = row_max.amax(dim=(0, 2, 3))
    else:
        lse = buffers["stats"]
        max_logit = torch.empty(0, dtype=torch.float32, device=inputs.q.device)  # not requested
    return AttentionOutputs(out, lse.view(cfg.batch, cfg.heads_q, cfg.seqlen_q), max_logit)


def backward(cfg: AttentionConfig, inputs: AttentionInputs, outputs: AttentionOutputs, grad_out, grad_lse) -> dict:
    if grad_lse is not None:
        raise NotImplementedError(
            "fusedattn: the cudnn backend has no gradient through the returned lse; "
            "use backend='reference' for losses that depend on lse")
    device = inputs.q.device.index
    spec = sdpa_spec(cfg)
    base = layout_spec(cfg.layout).base
    view = lambda x: to_bhsd(x, base)  # noqa: E731
    buffers = _shared_buffers(cfg, spec, inputs)
    buffers["o"] = view(outputs.out)
    if grad_out is None:  # only lse or max_logit was used
        grad_out = torch.zeros_like(outputs.out)
    buffers["dO"] = as_layout(grad_out, spec.o, view)
    buffers["stats"] = outputs.lse.reshape(cfg.batch, cfg.heads_q, cfg.seqlen_q, 1)
    built = get_graph(cfg, "backward", device)
    grads_bhsd = {}
    for name, role in (("dq", "q"), ("dk", "k"), ("dv", "v")):
        shaped = gradient_spec(getattr(spec, role))
        grads_bhsd[role] = buffers[name] = empty_like_spec(shaped, inputs.q.dtype, inputs.q.device)
    if "dbias" in built.tensors:
        buffers["dbias"] = torch.empty(spec.bias.dim, dtype=inputs.q.dtype, device=inputs.q.device)
    if "dsink" in built.tensors:
        buffers["dsink"] = torch.empty(1, cfg.heads_q, 1, 1, dtype=torch.float32, device=inputs.q.device)
    execute(built, buffers, device)
    grads = {role: from_bhsd(g, base) for role, g in grads_bhsd.items()}
    if "dbias" in buffers:
        grads["bias"] = _reduce_to(buffers["dbias"], cfg.bias_shape).reshape(inputs.bias.shape).to(inputs.bias.dtype)
    if "dsink" in buffers and cfg.softmax is SoftmaxType.LEARNABLE:
        grads["sink"] = buffers["dsink"].reshape(cfg.heads_q).to(inputs.sink.dtype)
    return grads


def _reduce_to(grad: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum a full (B, H, Sq, Skv) gradient over the axes the bias broadcast along."""
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    return grad.sum(dim=axes, keepdim=True) if axes else grad
