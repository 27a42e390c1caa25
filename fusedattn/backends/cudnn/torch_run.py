"""Forward and backward of the cuDNN backend on torch tensors (on torch's current stream).

Everything that depends only on the config (strides, permutations, output shapes) is
computed once per config in a `_Plan`, so a call does little more than allocate the
outputs and execute the built graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedattn.backends.base import AttentionInputs, AttentionOutputs, no_lse_gradient
from fusedattn.backends.cudnn.runtime import execute, get_graph
from fusedattn.backends.cudnn.score_mod_masks import aux_name, mask_plan
from fusedattn.backends.cudnn.sequences import Layout as TableLayout
from fusedattn.backends.cudnn.sequences import SequenceTable, config_layout
from fusedattn.backends.cudnn.spec import (
    SdpaSpec,
    TensorSpec,
    gradient_spec,
    lse_without_keys,
    rows_axis,
    rows_with_keys_bias,
    rows_with_keys_config,
    rows_without_keys,
    sdpa_spec,
)
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig, BiasType, Layout, SoftmaxType
from fusedattn.layout import layout_spec
from fusedattn.score_mods.core import MASKED_BELOW, RuntimeScalar

# Axis permutation taking a base-layout tensor to (B, H, S, D), and back.
_TO_BHSD = {Layout.BSHD: (0, 2, 1, 3), Layout.SBHD: (1, 2, 0, 3), Layout.BHSD: (0, 1, 2, 3)}
_FROM_BHSD = {Layout.BSHD: (0, 2, 1, 3), Layout.SBHD: (2, 0, 1, 3), Layout.BHSD: (0, 1, 2, 3)}


@dataclass(frozen=True)
class _Plan:
    spec: SdpaSpec
    to_bhsd: tuple[int, ...]
    from_bhsd: tuple[int, ...]
    grads: dict  # role -> TensorSpec of its gradient
    sequences: TableLayout | None  # padded and THD configs: their sequence table's layout


_plans: LRUCache = register("cudnn.torch_run.plans", LRUCache(1024))


def _plan(cfg: AttentionConfig) -> _Plan:
    def make() -> _Plan:
        spec = sdpa_spec(cfg)
        base = layout_spec(cfg.layout).base
        grads = {role: gradient_spec(getattr(spec, role)) for role in ("q", "k", "v")}
        sequences = config_layout(cfg) if spec.padding else None
        if cfg.layout.is_ragged:  # THD tensors are passed as they are, with ragged offsets
            return _Plan(spec, (), (), grads, sequences)
        return _Plan(spec, _TO_BHSD[base], _FROM_BHSD[base], grads, sequences)

    return _plans.get_or_build(cfg, make)


def _bhsd(x: torch.Tensor, plan: _Plan, spec: TensorSpec) -> torch.Tensor:
    """x viewed as (B, H, S, D) with the graph's strides; copied into them when it has others."""
    view = x.permute(plan.to_bhsd)
    if view.numel() == 0 or all(n == 1 or a == b for n, a, b in zip(spec.dim, view.stride(), spec.stride)):
        return view
    out = torch.empty_strided(spec.dim, spec.stride, dtype=x.dtype, device=x.device)
    out.copy_(view)
    return out


def _fits(x: torch.Tensor, dim, stride, dtype) -> bool:
    """Whether x has the shape, dtype and strides (where a stride matters) the graph was built for."""
    return (x.dtype == dtype and tuple(x.shape) == tuple(dim)
            and all(n == 1 or a == b for n, a, b in zip(dim, x.stride(), stride)))


def _empty_bhsd(spec: TensorSpec, plan: _Plan, dtype, device, into=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A tensor with spec's strides, as (base-layout view, BHSD view): the caller's buffer `into`
    when it has them (the JAX bridge's output buffers), else a new one."""
    if into is not None and _fits(into.permute(plan.to_bhsd), spec.dim, spec.stride, dtype):
        return into, into.permute(plan.to_bhsd)
    bhsd = torch.empty_strided(spec.dim, spec.stride, dtype=dtype, device=device)
    return bhsd.permute(plan.from_bhsd), bhsd


def _contiguous_target(shape, dtype, device, into=None, zero=True) -> torch.Tensor:
    """A contiguous tensor, zeroed unless zero=False: the caller's buffer `into` when it fits, else a new one."""
    if into is not None and into.is_contiguous() and _fits(into, shape, into.stride(), dtype):
        return into.zero_() if zero else into
    return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)


def _tokens(x: torch.Tensor, spec: TensorSpec, role: str) -> torch.Tensor:
    """A (T, H, D) tensor with the token/head/dim strides the graph was built for."""
    want = (spec.stride[2], spec.stride[1], spec.stride[3])
    if x.stride() == want or x.shape[0] <= 1:
        return x
    if want == (x.shape[1] * x.shape[2], x.shape[2], 1):
        return x.contiguous()
    raise ValueError(f"fusedattn: {role}: expected a packed THD tensor with strides {want}, got {x.stride()}; "
                     "pass the packed tensor itself (not a copy of one slice)")


def _sequence_table(cfg: AttentionConfig, plan: _Plan, inputs: AttentionInputs) -> SequenceTable:
    """Lengths and ragged offsets (THD) of this call on the device, and the offsets' check (sequences.py)."""
    totals = (inputs.q.shape[0], inputs.k.shape[0]) if plan.spec.ragged else None
    return SequenceTable.build(plan.sequences, inputs.cu_seqlens_q, inputs.cu_seqlens_kv, inputs.cu_seqlens_q_padded,
                               inputs.cu_seqlens_kv_padded, totals)


def _shared_buffers(cfg: AttentionConfig, plan: _Plan, inputs: AttentionInputs
                    ) -> tuple[dict, SequenceTable | None]:
    """The graph's inputs by name (a sequence table's rows as addresses), and the table (padded, THD)."""
    spec = plan.spec
    if spec.ragged:  # (T, H, D) tensors: cuDNN reads them through logical (B, H, S, D) dims + offsets
        buffers = {role: _tokens(getattr(inputs, role), getattr(spec, role), role) for role in ("q", "k", "v")}
    else:
        buffers = {"q": _bhsd(inputs.q, plan, spec.q), "k": _bhsd(inputs.k, plan, spec.k),
                   "v": _bhsd(inputs.v, plan, spec.v)}
    table = None
    if spec.padding:
        table = _sequence_table(cfg, plan, inputs)
        buffers.update(table.addresses)
    if spec.bias is not None:
        bias = inputs.bias.to(inputs.q.dtype)
        if cfg.bias is BiasType.PRE_SCALE:  # (qk + b) * scale == qk * scale + b * scale
            bias = bias * cfg.scale
        # Dense in its own (broadcast) shape, then expanded: the strides the graph was built with.
        buffers["bias"] = bias.reshape(cfg.bias_shape).contiguous().expand(spec.bias.dim)
    if spec.sink:
        if cfg.softmax is SoftmaxType.LEARNABLE:
            buffers["sink"] = inputs.sink.to(torch.float32).reshape(1, cfg.heads_q, 1, 1).contiguous()
        else:  # off_by_one: a zero logit per head
            buffers["sink"] = torch.zeros(1, cfg.heads_q, 1, 1, dtype=torch.float32, device=inputs.q.device)
    if spec.dropout:
        buffers["dropout_seed"] = inputs.dropout_seed.reshape(1, 1, 1, 1)
        buffers["dropout_offset"] = inputs.dropout_offset.reshape(1, 1, 1, 1)
    if spec.score_mod:
        _score_mod_buffers(cfg, inputs, buffers)
    return buffers, table


_HOST_TYPES = {"float32": torch.float32, "int32": torch.int32}


def _host_scalar(value, dtype: str) -> torch.Tensor:
    """A pass-by-value graph input: a (1, 1, 1, 1) CPU tensor, bound by its host pointer."""
    return torch.full((1, 1, 1, 1), value, dtype=_HOST_TYPES[dtype])


def _score_mod_buffers(cfg: AttentionConfig, inputs: AttentionInputs, buffers: dict) -> None:
    """The score_mod's aux values, and the inputs of the masks written after it."""
    for name, value in inputs.score_mod.values.items():
        buffers[aux_name(name)] = (_host_scalar(value.value, value.dtype) if isinstance(value, RuntimeScalar)
                                   else value)
    plan = mask_plan(cfg)  # its padding penalties are the sequence table's (SequenceTable.addresses)
    buffers.update({name: _host_scalar(value, dtype) for name, value, dtype in plan.constants(cfg)})


def _clear_empty_rows(out_rows: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Rows a score_mod left without a visible key: output 0 and LSE -inf (their LSE is near MASKED).

    out_rows is the output viewed with lse's shape plus the head dim; returns the new LSE.
    """
    empty = ~(lse >= MASKED_BELOW)  # NaN counts as empty too
    out_rows.masked_fill_(empty.unsqueeze(-1) if out_rows.dim() == lse.dim() + 1 else empty, 0)
    return lse.masked_fill(empty, float("-inf"))


def _backward_stats(lse: torch.Tensor) -> torch.Tensor:
    """Stats for a score_mod backward: +inf for empty rows, so exp(score - stats) is 0 there."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def forward(cfg: AttentionConfig, inputs: AttentionInputs, into: AttentionOutputs | None = None,
            saved: dict | None = None) -> AttentionOutputs:
    """into: preallocated (out, lse, max_logit) the outputs are written into where they fit. saved: a dict
    that receives what the backward can reuse (the stats of a padded call)."""
    if rows_without_keys(cfg):
        return _forward_rows_with_keys(cfg, inputs)
    into = into or AttentionOutputs(None, None, None)
    device = inputs.q.device
    plan = _plan(cfg)
    spec = plan.spec
    buffers, table = _shared_buffers(cfg, plan, inputs)
    sink = buffers.get("sink") if cfg.softmax is SoftmaxType.LEARNABLE else None
    if spec.ragged:
        # cuDNN writes only each sequence's tokens: fix_rows writes the others.
        tokens = inputs.q.shape[0]
        buffers["o"] = out = _contiguous_target((tokens, cfg.heads_q, cfg.head_dim_v), inputs.q.dtype, device,
                                                into.out, zero=False)
        buffers["stats"] = lse = _contiguous_target((tokens, cfg.heads_q), torch.float32, device, into.lse,
                                                    zero=False)
        execute(get_graph(cfg, "forward", device.index), buffers, device.index)
        if spec.score_mod:
            lse = _clear_empty_rows(out, lse)
        table.fix_rows("q", out, lse=lse, stats=lse, seqlen=cfg.seqlen_q, sink=sink, softmax=cfg.softmax)
        return AttentionOutputs(out, lse, torch.empty(0, dtype=torch.float32, device=device))
    out, buffers["o"] = _empty_bhsd(spec.o, plan, inputs.q.dtype, device, into=into.out)
    if spec.max_logit:
        for name in ("row_max", "sum_exp"):
            buffers[name] = torch.empty(spec.stats.dim, dtype=torch.float32, device=device)
    else:
        lse_into = None if spec.padding else into.lse  # padded: the stats stay apart, for the backward
        lse_into = lse_into.view(spec.stats.dim) if lse_into is not None and lse_into.is_contiguous() else None
        buffers["stats"] = _contiguous_target(spec.stats.dim, torch.float32, device, lse_into, zero=False)
    execute(get_graph(cfg, "forward", device.index), buffers, device.index)
    if spec.score_mod:
        buffers["stats"] = _clear_empty_rows(buffers["o"], buffers["stats"])
    max_logit = torch.empty(0, dtype=torch.float32, device=device)  # not requested
    if spec.max_logit:
        row_max = buffers["row_max"]
        if spec.padding:  # cuDNN leaves row_max unwritten past each end and in sequences without keys
            has_keys = table.lengths("kv") > 0
            row_max = row_max.masked_fill(~(_is_query(cfg, table) & has_keys), float("-inf"))
        buffers["stats"] = row_max + torch.log(buffers["sum_exp"])
        max_logit = row_max.amax(dim=(0, 2, 3))
        if spec.padding:
            max_logit = _poisoned(max_logit, table)
    stats = buffers["stats"]
    if not spec.padding:
        return AttentionOutputs(out, stats.view(cfg.batch, cfg.heads_q, cfg.seqlen_q), max_logit)
    # Rows past a sequence's end are not queries (LSE -inf, as the reference says); the stats the
    # backward reads stay finite there.
    lse = _contiguous_target((cfg.batch, cfg.heads_q, cfg.seqlen_q), torch.float32, device, into.lse, zero=False)
    table.fix_rows("q", buffers["o"].permute(0, 2, 1, 3), lse=lse.permute(0, 2, 1),
                   stats=stats.view(lse.shape).permute(0, 2, 1), seqlen=cfg.seqlen_q, sink=sink, softmax=cfg.softmax)
    if saved is not None:
        saved["stats"] = stats
    return AttentionOutputs(out, lse, max_logit)


def _is_query(cfg: AttentionConfig, table: SequenceTable) -> torch.Tensor:
    """(B, 1, Sq, 1) True for rows inside their sequence."""
    rows = torch.arange(cfg.seqlen_q, device=table.table.device).reshape(1, 1, -1, 1)
    return rows < table.lengths("q")


def backward(cfg: AttentionConfig, inputs: AttentionInputs, outputs: AttentionOutputs, grad_out, grad_lse,
             into: dict | None = None, saved: dict | None = None) -> dict:
    """into: preallocated {"q"|"k"|"v": buffer} the gradients are written into where they fit. saved: what
    the forward kept (see forward), or None."""
    into = into or {}
    if grad_lse is not None:
        raise no_lse_gradient("fusedattn.torch.attention", "cudnn")
    if rows_without_keys(cfg):
        return _backward_rows_with_keys(cfg, inputs, outputs, grad_out)
    device = inputs.q.device
    plan = _plan(cfg)
    spec = plan.spec
    buffers, table = _shared_buffers(cfg, plan, inputs)
    if grad_out is None:  # only max_logit was used
        grad_out = torch.zeros_like(outputs.out)
    built = get_graph(cfg, "backward", device.index)
    grads = {}
    if spec.ragged:
        buffers["o"], buffers["dO"], buffers["stats"] = outputs.out, grad_out.contiguous(), outputs.lse
        if spec.score_mod:
            buffers["stats"] = _backward_stats(outputs.lse)
        for role in ("q", "k", "v"):  # fix_rows writes the tokens outside every sequence
            source = getattr(inputs, role)
            heads, dim = (cfg.heads_q, cfg.head_dim_qk) if role == "q" else (
                cfg.heads_kv, cfg.head_dim_qk if role == "k" else cfg.head_dim_v)
            grads[role] = buffers["d" + role] = _contiguous_target((source.shape[0], heads, dim), source.dtype,
                                                                   device, into.get(role), zero=False)
        fixed = {role: grads[role] for role in ("q", "k", "v")}
    else:
        buffers["o"] = outputs.out.permute(plan.to_bhsd)
        buffers["dO"] = _bhsd(grad_out, plan, spec.o)
        lse = outputs.lse.reshape(spec.stats.dim)
        if spec.score_mod:
            buffers["stats"] = _backward_stats(lse)
        elif spec.padding:  # finite past each sequence's end
            kept = (saved or {}).get("stats")
            buffers["stats"] = kept if kept is not None else lse.masked_fill(~_is_query(cfg, table), 0.0)
        else:
            buffers["stats"] = lse
        for role in ("q", "k", "v"):  # with padding, fix_rows writes the rows past each sequence's end
            grads[role], buffers["d" + role] = _empty_bhsd(plan.grads[role], plan, inputs.q.dtype, device,
                                                           into=into.get(role))
        fixed = {role: buffers["d" + role].permute(0, 2, 1, 3) for role in ("q", "k", "v")}
    if "dbias" in built.tensors:
        buffers["dbias"] = torch.empty(spec.bias.dim, dtype=inputs.q.dtype, device=device)
    if "dsink" in built.tensors:
        buffers["dsink"] = torch.empty(1, cfg.heads_q, 1, 1, dtype=torch.float32, device=device)
    execute(built, buffers, device.index)
    if table is not None:
        table.fix_rows("q", fixed["q"], seqlen=cfg.seqlen_q)
        table.fix_rows("kv", fixed["k"], fixed["v"], seqlen=cfg.seqlen_kv)
    if "dbias" in buffers:
        dbias = _reduce_to(buffers["dbias"], cfg.bias_shape)
        if cfg.bias is BiasType.PRE_SCALE:
            dbias = dbias * cfg.scale
        grads["bias"] = _poisoned(dbias.reshape(inputs.bias.shape).to(inputs.bias.dtype), table)
    if "dsink" in buffers and cfg.softmax is SoftmaxType.LEARNABLE:
        grads["sink"] = _poisoned(buffers["dsink"].reshape(cfg.heads_q).to(inputs.sink.dtype), table)
    return grads


def _poisoned(grad: torch.Tensor, table: SequenceTable | None) -> torch.Tensor:
    """NaN when the call's offsets were broken (fix_rows does the same for q, k, v)."""
    return grad if table is None else torch.where(table.broken(), float("nan"), grad)


def _reduce_to(grad: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Sum a full (B, H, Sq, Skv) gradient over the axes the bias broadcast along."""
    axes = tuple(i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1)
    return grad.sum(dim=axes, keepdim=True) if axes else grad


def dropout_mask(cfg: AttentionConfig, inputs: AttentionInputs) -> torch.Tensor:
    """cuDNN's dropout mask for this call, (B, Hq, Sq, Skv) float32, from a debug graph (tests only).

    Built outside the graph cache: the debug output makes it another graph.
    """
    from fusedattn.backends.cudnn.graphs import build_forward
    from fusedattn.backends.cudnn.runtime import _handle, build_lock

    device = inputs.q.device
    plan = _plan(cfg)
    with build_lock(device.index):
        built = build_forward(cfg, plan.spec, _handle(device.index), dump_dropout=True)
    buffers, _ = _shared_buffers(cfg, plan, inputs)
    _, buffers["o"] = _empty_bhsd(plan.spec.o, plan, inputs.q.dtype, device)
    buffers["stats"] = torch.empty(plan.spec.stats.dim, dtype=torch.float32, device=device)
    buffers["rng_dump"] = torch.empty(cfg.batch, cfg.heads_q, cfg.seqlen_q, cfg.seqlen_kv, device=device)
    execute(built, buffers, device.index)
    return buffers["rng_dump"]


# Bottom-right causal with Sq > Skv: the first Sq - Skv query rows see no key. cuDNN refuses
# the mask there, so the last Skv rows run on their own and the others are filled in (output 0,
# the LSE of the sink term alone).
def _rows_with_keys(cfg: AttentionConfig, inputs: AttentionInputs):
    skipped, axis = rows_without_keys(cfg), rows_axis(cfg)
    sub = rows_with_keys_config(cfg)
    return sub, skipped, axis, inputs.replace(q=inputs.q.narrow(axis, skipped, sub.seqlen_q),
                                              bias=rows_with_keys_bias(cfg, inputs.bias))


def _forward_rows_with_keys(cfg: AttentionConfig, inputs: AttentionInputs) -> AttentionOutputs:
    sub, skipped, axis, sub_inputs = _rows_with_keys(cfg, inputs)
    result = forward(sub, sub_inputs)
    shape = list(result.out.shape)
    shape[axis] = cfg.seqlen_q
    out = result.out.new_zeros(shape)
    out.narrow(axis, skipped, sub.seqlen_q).copy_(result.out)
    lse = result.lse.new_empty((cfg.batch, cfg.heads_q, cfg.seqlen_q))
    lse[:, :, :skipped] = lse_without_keys(cfg, inputs.sink, result.lse).view(1, -1, 1)
    lse[:, :, skipped:] = result.lse
    return AttentionOutputs(out, lse, result.max_logit)


def _backward_rows_with_keys(cfg: AttentionConfig, inputs: AttentionInputs, outputs: AttentionOutputs,
                             grad_out) -> dict:
    sub, skipped, axis, sub_inputs = _rows_with_keys(cfg, inputs)
    sub_outputs = AttentionOutputs(outputs.out.narrow(axis, skipped, sub.seqlen_q).contiguous(),
                                   outputs.lse[:, :, skipped:].contiguous())
    if grad_out is not None:
        grad_out = grad_out.narrow(axis, skipped, sub.seqlen_q)
    grads = backward(sub, sub_inputs, sub_outputs, grad_out, None)
    dq = inputs.q.new_zeros(inputs.q.shape)
    dq.narrow(axis, skipped, sub.seqlen_q).copy_(grads["q"])
    grads["q"] = dq
    if "bias" in grads and sub.bias_shape != cfg.bias_shape:
        full = grads["bias"].new_zeros(cfg.bias_shape)
        full[:, :, skipped:] = grads["bias"].reshape(sub.bias_shape)
        grads["bias"] = full.reshape(inputs.bias.shape)
    return grads
