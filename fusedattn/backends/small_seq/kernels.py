"""Triton kernels of the small_seq backend: one query per sequence against a few keys.

One program owns one (sequence, KV head) pair: it loads that pair's keys and values once,
as whole (BLOCK_N, BLOCK_D) tiles, and loops over the GROUP query heads that share them.
Keys and values of a pair belong to it alone, so the backward writes dK and dV without
atomics (and is deterministic). The arithmetic is a few dot products per key; memory
traffic is what counts, so everything is 1-D or 2-D over the loaded tiles (no 3-D
broadcasts, whose layout changes go through shared memory).

Positions are int64: a million sequences times heads times D overflows int32 offsets (the
sequence tables may come as int32, as JAX makes them).

Outputs come after every input and number, before the meta-parameters: jax-triton appends the
output buffers to the arguments it is given, and the torch launcher follows the same order.

PADDED (a padded (B, 1, H, D) query and (B, Skv, H, D) keys) means every row exists in
memory: the kernels also write the rows of empty sequences and of keys past a sequence's
length (output 0, LSE -inf, gradients 0). In THD such rows belong to other sequences or to
nobody, so they are left alone (`zero_tail` clears tokens after the last sequence).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sequence(pid, HKV, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV):
    """(kv head, first query token, query count, first key token, key count) of a program."""
    seq = pid // HKV
    head_kv = pid % HKV
    return (head_kv, tl.load(STARTS_Q + seq).to(tl.int64), tl.load(LENS_Q + seq).to(tl.int64),
            tl.load(STARTS_KV + seq).to(tl.int64), tl.load(LENS_KV + seq).to(tl.int64))


@triton.jit
def small_seq_forward(
    Q, K, V, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale, HKV, OUT, LSE,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    head_kv, q_tok, q_len, kv_tok, kv_len = _sequence(pid, HKV, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV)
    if q_len > (-1 if PADDED else 0):  # padded layouts also write the rows of empty sequences
        n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        n_ok = (n < kv_len) & (q_len > 0)  # a padded row without a query sees nothing
        d_ok = d < HEAD_DIM
        tile_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(K + (kv_tok + n)[:, None] * stride_kt + head_kv * stride_kh + d[None, :], mask=tile_ok,
                    other=0.0).to(tl.float32)
        v = tl.load(V + (kv_tok + n)[:, None] * stride_vt + head_kv * stride_vh + d[None, :], mask=tile_ok,
                    other=0.0).to(tl.float32)
        for g in range(GROUP):
            head = head_kv * GROUP + g
            q = tl.load(Q + q_tok * stride_qt + head * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)
            scores = tl.where(n_ok, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
            row_max = tl.max(scores, axis=0)
            row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a sequence without keys
            p = tl.exp(scores - row_max)
            total = tl.sum(p, axis=0)
            safe = tl.where(total > 0.0, total, 1.0)
            out = tl.sum(p[:, None] * v, axis=0) / safe
            lse = tl.where(total > 0.0, row_max + tl.log(safe), float("-inf"))
            tl.store(OUT + q_tok * stride_ot + head * stride_oh + d, out.to(OUT.dtype.element_ty), mask=d_ok)
            tl.store(LSE + q_tok * (HKV * GROUP) + head, lse)


@triton.jit
def small_seq_backward(
    Q, K, V, DO, LSE, DLSE, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, HKV, SKV, DQ, DK, DV,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED: tl.constexpr, HAS_DLSE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    head_kv, q_tok, q_len, kv_tok, kv_len = _sequence(pid, HKV, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    has_query = q_len > 0  # without one, the keys get zero gradients
    n_ok = (n < kv_len) & has_query
    d_ok = d < HEAD_DIM
    tile_ok = n_ok[:, None] & d_ok[None, :]
    k = tl.load(K + (kv_tok + n)[:, None] * stride_kt + head_kv * stride_kh + d[None, :], mask=tile_ok,
                other=0.0).to(tl.float32)
    v = tl.load(V + (kv_tok + n)[:, None] * stride_vt + head_kv * stride_vh + d[None, :], mask=tile_ok,
                other=0.0).to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # Rows written: those read, plus in padded layouts the empty query row and padding keys (zeros).
    q_store = q_len > (-1 if PADDED else 0)
    for g in range(GROUP):
        head = head_kv * GROUP + g
        q = tl.load(Q + q_tok * stride_qt + head * stride_qh + d, mask=d_ok & has_query, other=0.0).to(tl.float32)
        do = tl.load(DO + q_tok * stride_dot + head * stride_doh + d, mask=d_ok & has_query,
                     other=0.0).to(tl.float32)
        lse = tl.load(LSE + q_tok * (HKV * GROUP) + head, mask=has_query, other=float("inf"))
        lse = tl.where(lse == float("-inf"), float("inf"), lse)  # a query without keys: p = 0
        p = tl.where(n_ok, tl.exp(tl.sum(k * q[None, :], axis=1) * scale - lse), 0.0)
        dp = tl.sum(v * do[None, :], axis=1)  # dO . V_j
        # sum_j p_j dp_j = dO . O: the softmax term of the backward, without reading O.
        delta = tl.sum(p * dp, axis=0)
        if HAS_DLSE:  # d lse / d s_j = p_j
            delta -= tl.load(DLSE + q_tok * (HKV * GROUP) + head, mask=has_query, other=0.0)
        ds = p * (dp - delta) * scale
        dq = tl.sum(ds[:, None] * k, axis=0)
        tl.store(DQ + q_tok * stride_dqt + head * stride_dqh + d, dq.to(DQ.dtype.element_ty), mask=d_ok & q_store)
        dk += ds[:, None] * q[None, :]
        dv += p[:, None] * do[None, :]
    n_store = n < (SKV if PADDED else kv_len)
    store_ok = n_store[:, None] & d_ok[None, :]
    tl.store(DK + (kv_tok + n)[:, None] * stride_dkt + head_kv * stride_dkh + d[None, :],
             dk.to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + (kv_tok + n)[:, None] * stride_dvt + head_kv * stride_dvh + d[None, :],
             dv.to(DV.dtype.element_ty), mask=store_ok)


@triton.jit
def zero_tail(X, END, TOKENS, ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """Zero the rows of a contiguous (TOKENS, ROW) tensor from token END[0] on.

    Tokens after the last sequence belong to none; reading END on the device avoids a sync.
    """
    first = tl.program_id(0).to(tl.int64) * BLOCK_T
    end = tl.load(END).to(tl.int64)
    if first + BLOCK_T > end:
        t = first + tl.arange(0, BLOCK_T)
        rows_ok = (t >= end) & (t < TOKENS)
        for r0 in range(0, ROW, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            tl.store(X + t[:, None] * ROW + r[None, :], tl.zeros([BLOCK_T, BLOCK_R], X.dtype.element_ty),
                     mask=rows_ok[:, None] & (r < ROW)[None, :])


@triton.jit
def small_seq_forward_dot(
    Q, K, V, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale, HKV, OUT, LSE,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED: tl.constexpr, INTERPRET: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The forward as two tensor-core products: the GROUP query heads of a KV head are the rows.

    INTERPRET: Triton's CPU interpreter has no bfloat16 products, so operands go to float32 there.
    """
    pid = tl.program_id(0).to(tl.int64)
    head_kv, q_tok, q_len, kv_tok, kv_len = _sequence(pid, HKV, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV)
    if q_len > (-1 if PADDED else 0):
        g = tl.arange(0, BLOCK_G)
        n = tl.arange(0, BLOCK_N)
        d = tl.arange(0, BLOCK_D)
        heads = head_kv * GROUP + g
        g_ok = g < GROUP
        n_ok = (n < kv_len) & (q_len > 0)
        d_ok = d < HEAD_DIM
        q = tl.load(Q + q_tok * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k = tl.load(K + (kv_tok + n)[:, None] * stride_kt + head_kv * stride_kh + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(V + (kv_tok + n)[:, None] * stride_vt + head_kv * stride_vh + d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if INTERPRET:
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k)) * scale
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        row_max = tl.max(scores, axis=1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        p = tl.exp(scores - row_max[:, None])
        total = tl.sum(p, axis=1)
        safe = tl.where(total > 0.0, total, 1.0)
        out = tl.dot((p / safe[:, None]).to(v.dtype), v)
        lse = tl.where(total > 0.0, row_max + tl.log(safe), float("-inf"))
        tl.store(OUT + q_tok * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(OUT.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
        tl.store(LSE + q_tok * (HKV * GROUP) + heads, lse, mask=g_ok)


@triton.jit
def small_seq_backward_dot(
    Q, K, V, DO, LSE, DLSE, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    scale, HKV, SKV, DQ, DK, DV,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PADDED: tl.constexpr, HAS_DLSE: tl.constexpr,
    INTERPRET: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The backward as tensor-core products over the (GROUP, N) score tile (INTERPRET as above)."""
    pid = tl.program_id(0).to(tl.int64)
    head_kv, q_tok, q_len, kv_tok, kv_len = _sequence(pid, HKV, STARTS_Q, LENS_Q, STARTS_KV, LENS_KV)
    g = tl.arange(0, BLOCK_G)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    heads = head_kv * GROUP + g
    has_query = q_len > 0
    g_ok = (g < GROUP) & has_query
    n_ok = (n < kv_len) & has_query
    d_ok = d < HEAD_DIM
    gd = g_ok[:, None] & d_ok[None, :]
    nd = n_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + q_tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=gd, other=0.0)
    do = tl.load(DO + q_tok * stride_dot + heads[:, None] * stride_doh + d[None, :], mask=gd, other=0.0)
    k = tl.load(K + (kv_tok + n)[:, None] * stride_kt + head_kv * stride_kh + d[None, :], mask=nd, other=0.0)
    v = tl.load(V + (kv_tok + n)[:, None] * stride_vt + head_kv * stride_vh + d[None, :], mask=nd, other=0.0)
    if INTERPRET:
        q, do, k, v = q.to(tl.float32), do.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
    lse = tl.load(LSE + q_tok * (HKV * GROUP) + heads, mask=g_ok, other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    valid = g_ok[:, None] & n_ok[None, :]
    p = tl.where(valid, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    delta = tl.sum(p * dp, axis=1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + q_tok * (HKV * GROUP) + heads, mask=g_ok, other=0.0)
    ds = (p * (dp - delta[:, None]) * scale).to(q.dtype)
    dq = tl.dot(ds, k)
    dk = tl.dot(tl.trans(ds), q)
    dv = tl.dot(tl.trans(p.to(do.dtype)), do)
    g_store = (g < GROUP) & (q_len > (-1 if PADDED else 0))
    tl.store(DQ + q_tok * stride_dqt + heads[:, None] * stride_dqh + d[None, :], dq.to(DQ.dtype.element_ty),
             mask=g_store[:, None] & d_ok[None, :])
    n_store = n < (SKV if PADDED else kv_len)
    store_ok = n_store[:, None] & d_ok[None, :]
    tl.store(DK + (kv_tok + n)[:, None] * stride_dkt + head_kv * stride_dkh + d[None, :],
             dk.to(DK.dtype.element_ty), mask=store_ok)
    tl.store(DV + (kv_tok + n)[:, None] * stride_dvt + head_kv * stride_dvh + d[None, :],
             dv.to(DV.dtype.element_ty), mask=store_ok)


_FORMS = {(False, "reduce"): small_seq_forward, (False, "dot"): small_seq_forward_dot,
          (True, "reduce"): small_seq_backward, (True, "dot"): small_seq_backward_dot}


def kernel_of(chosen, backward: bool, interpret: bool):
    """(kernel, meta-parameters) of a plan (blocks.plan) for either launcher; the tensor-core form is told
    when Triton's interpreter runs it."""
    meta = {**chosen.meta, "INTERPRET": interpret} if chosen.kernel == "dot" else chosen.meta
    return _FORMS[backward, chosen.kernel], meta
