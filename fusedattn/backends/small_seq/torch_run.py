"""Launching the small_seq kernels on torch tensors: per-sequence tables, views, outputs.

THD tensors are (T, H, D) with a token stride; a padded bshd call (Sq = 1) is read as
(B, H, D) queries and (B * Skv, H, D) keys, each sequence starting at b * Skv.
"""

from __future__ import annotations

import torch
import triton

from fusedattn.backends.base import AttentionInputs, AttentionOutputs
from fusedattn.backends.small_seq.blocks import next_power_of_two, plan, sees_first_key_only, sequence_tables
from fusedattn.backends.small_seq.kernels import kernel_of, zero_tail
from fusedattn.config import AttentionConfig

_TAIL_TOKENS = 64


def _tokens(x: torch.Tensor, padded_rows: int | None) -> torch.Tensor:
    """x as (tokens, H, D) with unit stride on D; padded (B, S, H, D) merges B and S."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if padded_rows is None:
        return x
    batch, seqlen, heads, dim = x.shape
    if x.stride(0) != seqlen * x.stride(1):
        x = x.contiguous()
    return x.as_strided((batch * seqlen, heads, dim), (x.stride(1), x.stride(2), 1))


def _tables(cfg: AttentionConfig, inputs: AttentionInputs, device) -> tuple[torch.Tensor, ...]:
    """(starts_q, lens_q, starts_kv, lens_kv) as int64 (B,) device tensors, in token units."""
    cu_seqlens = {side: getattr(inputs, f"cu_seqlens_{side}") for side in ("q", "kv", "q_padded", "kv_padded")}
    tables = sequence_tables(cfg, cu_seqlens, lambda n: torch.arange(n, device=device, dtype=torch.int64),
                             lambda x: x.to(torch.int64))
    return tuple(x.contiguous() for x in tables)


def _new(shape, dtype, device, cfg: AttentionConfig, end, fill=0.0) -> torch.Tensor:
    """An output whose rows the kernel writes; THD tokens outside every sequence get `fill`."""
    if not cfg.layout.is_ragged:
        return torch.empty(shape, dtype=dtype, device=device)
    if cfg.padded_offsets:  # gaps between sequences: cheaper to fill than to find
        return torch.full(shape, fill, dtype=dtype, device=device)
    x = torch.empty(shape, dtype=dtype, device=device)
    row = x[0].numel() if x.shape[0] else 1
    if x.shape[0]:
        zero_tail[(triton.cdiv(x.shape[0], _TAIL_TOKENS),)](x, end, x.shape[0], ROW=row, BLOCK_T=_TAIL_TOKENS,
                                                            BLOCK_R=min(1024, next_power_of_two(row)))
    return x


def _views(cfg: AttentionConfig, inputs: AttentionInputs):
    padded = None if cfg.layout.is_ragged else cfg.seqlen_kv
    q = inputs.q if cfg.layout.is_ragged else inputs.q[:, 0]
    if q.stride(-1) != 1:
        q = q.contiguous()
    return q, _tokens(inputs.k, padded), _tokens(inputs.v, padded)


def forward(cfg: AttentionConfig, inputs: AttentionInputs) -> AttentionOutputs:
    device = inputs.q.device
    q, k, v = _views(cfg, inputs)
    starts_q, lens_q, starts_kv, lens_kv = _tables(cfg, inputs, device)
    end_q = inputs.cu_seqlens_q[-1:] if cfg.layout.is_ragged else None
    out = _new(q.shape, q.dtype, device, cfg, end_q)
    lse = _new(q.shape[:2], torch.float32, device, cfg, end_q)
    chosen = plan(cfg.gqa_group, cfg.seqlen_kv, cfg.head_dim_qk, backward=False)
    kernel, meta = kernel_of(chosen, backward=False, interpret=device.type == "cpu")
    grid = (cfg.batch * cfg.heads_kv,)
    if grid[0]:
        kernel[grid](
            q, k, v, starts_q, lens_q, starts_kv, lens_kv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
            out.stride(1), cfg.scale, cfg.heads_kv, out, lse,
            GROUP=cfg.gqa_group, HEAD_DIM=cfg.head_dim_qk, PADDED=not cfg.layout.is_ragged,
            num_warps=chosen.num_warps, **meta)
    if not cfg.layout.is_ragged:
        out, lse = out.unsqueeze(1), lse.unsqueeze(-1)  # (B, 1, Hq, D), (B, Hq, 1)
    return AttentionOutputs(out, lse, torch.empty(0, dtype=torch.float32, device=device))


def backward(cfg: AttentionConfig, inputs: AttentionInputs, outputs: AttentionOutputs, grad_out, grad_lse) -> dict:
    device = inputs.q.device
    q, k, v = _views(cfg, inputs)
    starts_q, lens_q, starts_kv, lens_kv = _tables(cfg, inputs, device)
    ragged = cfg.layout.is_ragged
    if grad_out is None:
        grad_out = torch.zeros_like(outputs.out)
    do = grad_out if ragged else grad_out[:, 0]
    if do.stride(-1) != 1:
        do = do.contiguous()
    lse = outputs.lse if ragged else outputs.lse[..., 0]
    dlse = None
    if grad_lse is not None:
        dlse = (grad_lse if ragged else grad_lse[..., 0]).to(torch.float32).contiguous()
    end_q = inputs.cu_seqlens_q[-1:] if ragged else None
    end_kv = inputs.cu_seqlens_kv[-1:] if ragged else None
    dq = _new(q.shape, q.dtype, device, cfg, end_q)
    if sees_first_key_only(cfg):  # the kernel writes key 0 of each sequence; the others get no gradient
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    else:
        dk = _new(k.shape, k.dtype, device, cfg, end_kv)
        dv = _new(v.shape, v.dtype, device, cfg, end_kv)
    chosen = plan(cfg.gqa_group, cfg.seqlen_kv, cfg.head_dim_qk, backward=True)
    kernel, meta = kernel_of(chosen, backward=True, interpret=device.type == "cpu")
    grid = (cfg.batch * cfg.heads_kv,)
    if grid[0]:
        kernel[grid](
            q, k, v, do, lse.contiguous(), dlse if dlse is not None else lse,
            starts_q, lens_q, starts_kv, lens_kv,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), do.stride(0),
            do.stride(1), dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            cfg.scale, cfg.heads_kv, cfg.seqlen_kv, dq, dk, dv,
            GROUP=cfg.gqa_group, HEAD_DIM=cfg.head_dim_qk, PADDED=not ragged, HAS_DLSE=dlse is not None,
            num_warps=chosen.num_warps, **meta)
    if not ragged:
        dq = dq.unsqueeze(1)
        dk, dv = (x.view(cfg.batch, cfg.seqlen_kv, cfg.heads_kv, cfg.head_dim_v) for x in (dk, dv))
    return {"q": dq, "k": dk, "v": dv}
