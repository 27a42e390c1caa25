"""A naive float64 attention in torch, written from the documented semantics: the tests' ground truth.

It shares no code with fusedattn on purpose. Everything is explicit: loops over batch,
heads and query rows, a boolean visibility matrix built key by key, a softmax over the
visible keys only. Slow and obviously correct; gradients come from torch autograd on
float64 inputs.

Semantics (fusedattn's documented contract):
  scores   s = q.k;  + bias (pre_scale);  * scale (default 1/sqrt(D));  score_mod(s, b, h, q_idx,
           kv_idx) (a result <= -1e8 counts as masked);  + bias (post_scale) or
           - slope[h] * |i + off - j| (ALiBi);  then masks.
  diagonal off = 0 for top-left masks (causal, padding_causal), len_kv - len_q otherwise
           (bottom-right masks and the non-causal 'none' / 'padding'), per sequence.
  masks    causal: j <= i + off; padding: i < len_q and j < len_kv; THD layouts always pad.
  window   (left, right), -1 unbounded: j >= i + off - left and j <= i + off + right;
           causal masks imply right = 0.
  softmax  lse = log(sum_visible exp(s) + sink term): off_by_one adds exp(0), learnable exp(sink[h]).
           A row with no visible key: out 0, lse -inf or log(sink term). A padding row
           (i >= len_q in a padded layout): out 0, lse -inf.
  dropout  out = (P * keep / (1 - p)) @ V with keep indexed [b, h, i, j] (i, j positions in
           the sequence); lse is unaffected.
  max_logit (Hq,): max of the visible scores over batch, query and key (-inf if none); no gradient.
  THD      sequence b starts at cu_seqlens_padded[b] (else cu_seqlens[b]) and has
           cu_seqlens[b+1] - cu_seqlens[b] tokens; q_idx/kv_idx are positions in the
           sequence; tokens outside every sequence get out 0 and lse 0.
"""

from __future__ import annotations

import math

import torch

__all__ = ["naive_attention", "BASE_LAYOUT"]

F64 = torch.float64
NEG_INF = float("-inf")

# The layout of q (and of the output) once packed tensors are split.
BASE_LAYOUT = {
    "bshd": "bshd", "sbhd": "sbhd", "bhsd": "bhsd", "thd": "thd",
    "bs3hd": "bshd", "sb3hd": "sbhd", "t3hd": "thd",
    "bshd_bs2hd": "bshd", "sbhd_sb2hd": "sbhd", "thd_t2hd": "thd",
}


def _split(layout, q, k, v):
    """(q, k, v) in the base layout from the tensors the layout takes."""
    if layout in ("bshd", "sbhd", "bhsd", "thd"):
        return q, k, v
    if layout in ("bs3hd", "sb3hd"):  # (B, S, 3, H, D) / (S, B, 3, H, D)
        assert k is None and v is None
        return q[:, :, 0], q[:, :, 1], q[:, :, 2]
    if layout == "t3hd":  # (T, 3, H, D)
        assert k is None and v is None
        return q[:, 0], q[:, 1], q[:, 2]
    if layout in ("bshd_bs2hd", "sbhd_sb2hd"):  # kv (B, S, 2, H, D) / (S, B, 2, H, D) passed as k
        assert v is None
        return q, k[:, :, 0], k[:, :, 1]
    if layout == "thd_t2hd":  # kv (T, 2, H, D) passed as k
        assert v is None
        return q, k[:, 0], k[:, 1]
    raise ValueError(f"unknown layout {layout!r}")


def _sequence(x, base, b, start, length):
    """Sequence b of x as (S, H, D)."""
    if base == "bshd":
        return x[b]
    if base == "sbhd":
        return x[:, b]
    if base == "bhsd":
        return x[b].transpose(0, 1)
    return x[start:start + length]  # thd


def _mask_kind(mask, ragged):
    """(padding, causal, bottom_right) of a mask name; THD layouts always pad."""
    if ragged and not mask.startswith("padding"):
        mask = "padding" if mask == "none" else "padding_" + mask
    causal = "causal" in mask
    bottom_right = mask.endswith("bottom_right") or not causal
    return mask.startswith("padding"), causal, bottom_right


def _visible(i, j, len_q, len_kv, off, padding, left, right):
    """Whether query i sees key j."""
    if padding and (i >= len_q or j >= len_kv):
        return False
    if left != -1 and j < i + off - left:
        return False
    if right != -1 and j > i + off + right:
        return False
    return True


def naive_attention(q, k=None, v=None, *, layout="bshd", mask="none", window=(-1, -1), bias=None,
                    bias_type="post_scale", alibi_slopes=None, softmax_type="vanilla", sink=None,
                    scale=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                    cu_seqlens_kv_padded=None, dropout_keep=None, dropout_p=0.0, score_mod=None):
    """(out, lse, max_logit) of attention on float64 tensors in `layout`'s shapes.

    out in q's base layout (..., Hq, Dv); lse (B, Hq, Sq), or (Tq, Hq) for THD; max_logit (Hq,).
    dropout_keep: boolean (B, Hq, Sq, Skv) (the longest sequences for THD), with dropout_p.
    """
    for x in (q, k, v, bias, alibi_slopes, sink):
        assert x is None or x.dtype == F64, "naive_attention takes float64 tensors"
    base = BASE_LAYOUT[layout]
    ragged = base == "thd"
    q, k, v = _split(layout, q, k, v)
    head_axis = 1 if base == "bhsd" else -2
    heads_q, heads_kv = q.shape[head_axis], k.shape[head_axis]
    head_dim, head_dim_v = q.shape[-1], v.shape[-1]
    assert heads_q % heads_kv == 0
    group = heads_q // heads_kv
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    padding, causal, bottom_right = _mask_kind(mask, ragged)
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0

    # Per sequence: start in the packed tensor (THD) and lengths.
    if ragged:
        batch = len(cu_seqlens_q) - 1
        lens_q = [int(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) for b in range(batch)]
        lens_kv = [int(cu_seqlens_kv[b + 1] - cu_seqlens_kv[b]) for b in range(batch)]
        starts_q = [int((cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q)[b])
                    for b in range(batch)]
        starts_kv = [int((cu_seqlens_kv_padded if cu_seqlens_kv_padded is not None else cu_seqlens_kv)[b])
                     for b in range(batch)]
        grid_q, grid_kv = lens_q, lens_kv  # rows and columns of each sequence's score matrix
    else:
        seq_axis = {"bshd": 1, "sbhd": 0, "bhsd": 2}[base]
        batch = q.shape[{"bshd": 0, "sbhd": 1, "bhsd": 0}[base]]
        seqlen_q, seqlen_kv = q.shape[seq_axis], k.shape[seq_axis]
        if padding:
            lens_q = [int(cu_seqlens_q[b + 1] - cu_seqlens_q[b]) for b in range(batch)]
            lens_kv = [int(cu_seqlens_kv[b + 1] - cu_seqlens_kv[b]) for b in range(batch)]
        else:
            lens_q, lens_kv = [seqlen_q] * batch, [seqlen_kv] * batch
        starts_q = starts_kv = [0] * batch
        grid_q, grid_kv = [seqlen_q] * batch, [seqlen_kv] * batch

    if bias is not None:
        assert not ragged, "no bias tensor for THD"
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        bias = bias.expand(batch, heads_q, seqlen_q, seqlen_kv)

    max_logit = [NEG_INF] * heads_q
    outs, lses = [], []  # per sequence: (Sq, Hq, Dv) and (Sq, Hq)
    for b in range(batch):
        sq, skv = grid_q[b], grid_kv[b]
        qb = _sequence(q, base, b, starts_q[b], sq)
        kb = _sequence(k, base, b, starts_kv[b], skv)
        vb = _sequence(v, base, b, starts_kv[b], skv)
        off = lens_kv[b] - lens_q[b] if bottom_right else 0
        visible = torch.tensor(
            [[_visible(i, j, lens_q[b], lens_kv[b], off, padding, left, right) for j in range(skv)]
             for i in range(sq)], dtype=torch.bool).reshape(sq, skv)
        distance = torch.tensor([[abs(i + off - j) for j in range(skv)] for i in range(sq)],
                                dtype=F64).reshape(sq, skv)
        head_outs, head_lses = [], []
        for h in range(heads_q):
            qh, kh, vh = qb[:, h, :], kb[:, h // group, :], vb[:, h // group, :]
            s = qh @ kh.T  # (sq, skv)
            if bias is not None and bias_type == "pre_scale":
                s = s + bias[b, h]
            s = s * scale
            if score_mod is not None:
                q_idx = torch.arange(sq).reshape(sq, 1)
                kv_idx = torch.arange(skv).reshape(1, skv)
                s = score_mod(s, torch.tensor(b), torch.tensor(h), q_idx, kv_idx)
                s = torch.broadcast_to(s.to(F64), (sq, skv))
                s = torch.where(s <= -1e8, float("-inf"), s)
            if bias is not None and bias_type != "pre_scale":  # post_scale, the default
                s = s + bias[b, h]
            if alibi_slopes is not None:
                slope = alibi_slopes[h] if alibi_slopes.dim() == 1 else alibi_slopes[b, h]
                s = s - slope * distance
            if softmax_type == "learnable":
                sink_logit = sink[h].reshape(1)
            elif softmax_type == "off_by_one":
                sink_logit = torch.zeros(1, dtype=F64)
            else:
                sink_logit = None

            rows_out, rows_lse = [], []
            for i in range(sq):
                if padding and not ragged and i >= lens_q[b]:  # a padding row, not a query
                    rows_out.append(torch.zeros(head_dim_v, dtype=F64))
                    rows_lse.append(torch.tensor(NEG_INF, dtype=F64))
                    continue
                # visible by the masks, and not masked by the score_mod (a score of -inf)
                cols = torch.tensor([j for j in range(skv) if visible[i, j] and s[i, j] != NEG_INF],
                                    dtype=torch.long)
                logits = s[i, cols]
                if len(cols):
                    max_logit[h] = max(max_logit[h], float(logits.detach().max()))
                terms = logits if sink_logit is None else torch.cat([logits, sink_logit])
                if terms.numel() == 0:
                    rows_out.append(torch.zeros(head_dim_v, dtype=F64))
                    rows_lse.append(torch.tensor(NEG_INF, dtype=F64))
                    continue
                lse = torch.logsumexp(terms, dim=0)
                p = torch.exp(logits - lse)  # softmax weights of the visible keys
                if dropout_keep is not None:
                    keep = dropout_keep[b, h, i, cols].to(F64)
                    p = p * keep / (1.0 - dropout_p)
                rows_out.append(p @ vh[cols])
                rows_lse.append(lse)
            head_outs.append(torch.stack(rows_out) if sq else torch.zeros(0, head_dim_v, dtype=F64))
            head_lses.append(torch.stack(rows_lse) if sq else torch.zeros(0, dtype=F64))
        outs.append(torch.stack(head_outs, dim=1))  # (sq, Hq, Dv)
        lses.append(torch.stack(head_lses, dim=1))  # (sq, Hq)

    if ragged:
        out = torch.zeros(q.shape[0], heads_q, head_dim_v, dtype=F64)
        lse = torch.zeros(q.shape[0], heads_q, dtype=F64)
        for b in range(batch):
            out[starts_q[b]:starts_q[b] + lens_q[b]] = outs[b]
            lse[starts_q[b]:starts_q[b] + lens_q[b]] = lses[b]
    else:
        out = torch.stack(outs)  # (B, Sq, Hq, Dv)
        lse = torch.stack(lses).permute(0, 2, 1)  # (B, Hq, Sq)
        if base == "sbhd":
            out = out.permute(1, 0, 2, 3)
        elif base == "bhsd":
            out = out.permute(0, 2, 1, 3)
    return out, lse, torch.tensor(max_logit, dtype=F64)
