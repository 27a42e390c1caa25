"""Triton kernels around cuDNN's padded and THD graphs: the per-sequence tables before, the row fix-ups after.

cuDNN reads sequence lengths and ragged offsets (element offsets of each sequence's first token) from
device tensors, and writes only the rows inside a sequence. Before these kernels, the torch path built
those tensors and fixed the rows cuDNN leaves with some twenty small torch ops per pass, and
multiplied q, k, v and every output by a NaN-or-one factor for offsets it had not read: more host time
than the attention kernel at S=1024.

`sequence_tables` (one program) checks the offsets on the device by the rules the host check enforces
(layout.offsets_violated) and writes one int32 table: lengths, starts and ragged offsets per side, and a
flag. Broken offsets get the flag and all-zero lengths and offsets, so cuDNN reads and writes nothing.

`fix_rows` then visits the rows of one side (queries, or keys and values) and writes only those that need
it: NaN everywhere when the flag is set; else 0 in rows outside every sequence (THD gaps, rows past a
padded sequence's end) and in rows of a sequence whose other side is empty. For the forward it also
writes the returned LSE (the log of the sink term for queries without keys, `gap_lse` outside) and sets
the stats the backward reads to 0 outside every sequence.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _lengths(CU, STARTS, i, ok, PADDED: tl.constexpr):
    """(lengths, room between padded starts, starts) of sequences i (int64)."""
    first = tl.load(CU + i, mask=ok, other=0).to(tl.int64)
    lengths = tl.load(CU + i + 1, mask=ok, other=0).to(tl.int64) - first
    if PADDED:
        starts = tl.load(STARTS + i, mask=ok, other=0).to(tl.int64)
        room = tl.load(STARTS + i + 1, mask=ok, other=0).to(tl.int64) - starts
    else:
        starts = first
        room = lengths
    return lengths, room, starts


@triton.jit
def _side_violated(CU, STARTS, B, LIMIT, TOTAL, PADDED: tl.constexpr, CHECK_TOTAL: tl.constexpr,
                   BLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """1 when one side's offsets break the rules of layout.offsets_violated, else 0."""
    bad = (tl.load(CU).to(tl.int64) != 0).to(tl.int32)
    if PADDED:
        bad = bad | (tl.load(STARTS).to(tl.int64) < 0).to(tl.int32)
    for step in range(BLOCKS):
        i = step * BLOCK + tl.arange(0, BLOCK)
        ok = i < B
        lengths, room, _ = _lengths(CU, STARTS, i, ok, PADDED)
        broken = ok & ((lengths < 0) | (lengths > LIMIT) | (room < lengths))
        bad = bad | tl.max(broken.to(tl.int32), axis=0)
    if CHECK_TOTAL:  # THD: the last (padded) offset within the packed tensor
        bad = bad | (tl.load(STARTS + B).to(tl.int64) > TOTAL).to(tl.int32)
    return bad


@triton.jit
def sequence_tables(
    CU_Q, CU_KV, STARTS_Q, STARTS_KV, TABLE, B, LIMIT_Q, LIMIT_KV, TOTAL_Q, TOTAL_KV, WIDTH,
    ROW_UNITS: tl.constexpr, ROW_SIDES: tl.constexpr, N_ROWS: tl.constexpr, PADDED_Q: tl.constexpr,
    PADDED_KV: tl.constexpr, CHECK_TOTAL: tl.constexpr, BLOCK: tl.constexpr, BLOCKS: tl.constexpr,
    PENALTY_ROW_Q: tl.constexpr, PENALTY_ROW_KV: tl.constexpr, SEQ_Q: tl.constexpr, SEQ_KV: tl.constexpr,
    MASKED: tl.constexpr, PENALTY_BLOCK: tl.constexpr,
):
    """TABLE rows of WIDTH int32 (WIDTH >= B + 1): len_q, len_kv, then N_ROWS rows of starts * ROW_UNITS[r]
    on side ROW_SIDES[r] (0 queries, 1 keys; the first two: the starts themselves, unit 1), then the flag
    (first entry of row 2 + N_ROWS). STARTS_*: padded offsets where PADDED_*, else the cu_seqlens
    themselves. BLOCKS * BLOCK > B. Units are constexprs: one config, one set of units.

    Program 0 writes those rows. Where PENALTY_ROW_Q > 0 (a score_mod graph's padding), program 1 + b
    writes sequence b's penalties as float32 bits: SEQ_Q entries from row PENALTY_ROW_Q on at b * SEQ_Q,
    SEQ_KV from row PENALTY_ROW_KV on at b * SEQ_KV, 0 inside the sequence and MASKED past its end (all
    MASKED when the offsets are broken)."""
    bad = _side_violated(CU_Q, STARTS_Q, B, LIMIT_Q, TOTAL_Q, PADDED_Q, CHECK_TOTAL, BLOCK, BLOCKS)
    bad = bad | _side_violated(CU_KV, STARTS_KV, B, LIMIT_KV, TOTAL_KV, PADDED_KV, CHECK_TOTAL, BLOCK, BLOCKS)
    keep = bad == 0
    program = tl.program_id(0)
    if program == 0:
        for step in range(BLOCKS):
            i = step * BLOCK + tl.arange(0, BLOCK)
            ok = i < B + 1  # B + 1 starts, B lengths
            len_q, _, _ = _lengths(CU_Q, STARTS_Q, i, i < B, PADDED_Q)
            len_kv, _, _ = _lengths(CU_KV, STARTS_KV, i, i < B, PADDED_KV)
            starts_q = tl.load(STARTS_Q + i, mask=ok, other=0).to(tl.int64)  # B + 1 of them
            starts_kv = tl.load(STARTS_KV + i, mask=ok, other=0).to(tl.int64)
            tl.store(TABLE + i, tl.where(keep, len_q, 0).to(tl.int32), mask=i < B)
            tl.store(TABLE + WIDTH + i, tl.where(keep, len_kv, 0).to(tl.int32), mask=i < B)
            for row in tl.static_range(N_ROWS):
                starts = starts_q if ROW_SIDES[row] == 0 else starts_kv
                tl.store(TABLE + (2 + row) * WIDTH + i, tl.where(keep, starts * ROW_UNITS[row], 0).to(tl.int32),
                         mask=ok)
        tl.store(TABLE + (2 + N_ROWS) * WIDTH, bad)
    if PENALTY_ROW_Q > 0:
        if program > 0:
            b = (program - 1).to(tl.int64)
            _penalties(CU_Q, TABLE + PENALTY_ROW_Q * WIDTH + b * SEQ_Q, b, keep, SEQ_Q, MASKED, PENALTY_BLOCK)
            _penalties(CU_KV, TABLE + PENALTY_ROW_KV * WIDTH + b * SEQ_KV, b, keep, SEQ_KV, MASKED, PENALTY_BLOCK)


@triton.jit
def _penalties(CU, OUT, b, keep, SEQ: tl.constexpr, MASKED: tl.constexpr, BLOCK: tl.constexpr):
    """SEQ float32 penalties of sequence b (bits into an int32 table): 0 before its length, MASKED after."""
    length = tl.where(keep, tl.load(CU + b + 1).to(tl.int64) - tl.load(CU + b).to(tl.int64), 0)
    for start in range(0, SEQ, BLOCK):
        s = start + tl.arange(0, BLOCK)
        value = tl.where(s < length, 0.0, MASKED).to(tl.float32)
        tl.store(OUT + s, value.to(tl.int32, bitcast=True), mask=s < SEQ)


@triton.jit
def _fill_rows(X, base, fill, write, ELEMENTS, HEAD_DIM, stride_h, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
               STEPS: tl.constexpr):
    """Writes `fill` (per row) into the ELEMENTS = heads * HEAD_DIM entries of the rows where `write`."""
    if tl.max(write.to(tl.int32), axis=0) > 0:  # most blocks: every row is inside a sequence, nothing to do
        for step in range(STEPS):  # STEPS * BLOCK_E >= ELEMENTS
            e = step * BLOCK_E + tl.arange(0, BLOCK_E)
            offsets = base[:, None] + (e // HEAD_DIM).to(tl.int64)[None, :] * stride_h + (e % HEAD_DIM)[None, :]
            values = tl.zeros((BLOCK_R, BLOCK_E), dtype=tl.float32) + fill[:, None]
            tl.store(X + offsets, values.to(X.dtype.element_ty), mask=write[:, None] & (e < ELEMENTS)[None, :])


@triton.jit
def fix_rows(
    X, Y, LSE, STATS, SINK, BSTATS, TABLE, WIDTH, B, ROWS, SEQ, HEADS, DIM_X, DIM_Y, gap_lse,
    sx_b, sx_s, sx_h, sy_b, sy_s, sy_h, sl_b, sl_s, sl_h,
    SIDE: tl.constexpr, N_UNITS: tl.constexpr, RAGGED: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    HAS_Y: tl.constexpr, HAS_LSE: tl.constexpr, STATS_APART: tl.constexpr, SINK_KIND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, STEPS_X: tl.constexpr, STEPS_Y: tl.constexpr,
    BLOCK_H: tl.constexpr, BACKWARD_STATS: tl.constexpr,
):
    """Rows r of one side (SIDE 0: queries, 1: keys and values): THD token r (RAGGED), else (r // SEQ,
    r % SEQ). X (and Y) are that side's (B, S, H, D)-strided outputs or gradients; LSE/STATS (forward,
    queries) are (B, S, H)-strided; gap_lse is the LSE outside every sequence. SINK_KIND: 0 none (-inf),
    1 a zero logit, 2 SINK's per-head logits. BACKWARD_STATS: also write BSTATS (strided as LSE), the stats
    a score_mod graph's backward reads: the LSE, +inf where it is -inf (so those rows' probabilities are 0)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < ROWS
    lengths = TABLE + SIDE * WIDTH
    others = TABLE + (1 - SIDE) * WIDTH
    if RAGGED:  # the last sequence starting at or before token r: an upper bound by bisection
        starts = TABLE + (2 + SIDE) * WIDTH
        low = tl.zeros((BLOCK_R,), dtype=tl.int64)
        high = tl.zeros((BLOCK_R,), dtype=tl.int64) + B
        for _ in tl.static_range(SEARCH_STEPS):
            active = low < high
            middle = (low + high) // 2
            start = tl.load(starts + middle, mask=active & row_ok, other=0).to(tl.int64)
            right = active & (start <= r)
            low = tl.where(right, middle + 1, low)
            high = tl.where(active & ~right, middle, high)
        b = tl.maximum(low - 1, 0)
        position = r - tl.load(starts + b, mask=row_ok, other=0).to(tl.int64)
        seq_b = tl.zeros((BLOCK_R,), dtype=tl.int64)  # THD tensors: (T, H, D), token r at r * stride_s
        seq_s = r
    else:
        b = r // SEQ
        position = r % SEQ
        seq_b = b
        seq_s = position
    length = tl.load(lengths + b, mask=row_ok, other=0).to(tl.int64)
    inside = row_ok & (position >= 0) & (position < length)
    alone = inside & (tl.load(others + b, mask=row_ok, other=0) == 0)  # the other side is empty
    bad = tl.load(TABLE + (4 + N_UNITS) * WIDTH) != 0
    write = row_ok & (bad | ~inside | alone)
    fill = tl.where(bad, float("nan"), 0.0) + tl.zeros((BLOCK_R,), dtype=tl.float32)
    _fill_rows(X, seq_b * sx_b + seq_s * sx_s, fill, write, HEADS * DIM_X, DIM_X, sx_h, BLOCK_R, BLOCK_E, STEPS_X)
    if HAS_Y:
        _fill_rows(Y, seq_b * sy_b + seq_s * sy_s, fill, write, HEADS * DIM_Y, DIM_Y, sy_h, BLOCK_R, BLOCK_E, STEPS_Y)
    if HAS_LSE:
        if True:  # one block of heads: BLOCK_H >= HEADS
            h = tl.arange(0, BLOCK_H)
            cell = row_ok[:, None] & (h < HEADS)[None, :]
            at = (seq_b * sl_b + seq_s * sl_s)[:, None] + h.to(tl.int64)[None, :] * sl_h
            if SINK_KIND == 2:
                sink = tl.load(SINK + h, mask=h < HEADS, other=0.0).to(tl.float32)
            elif SINK_KIND == 1:
                sink = tl.zeros((BLOCK_H,), dtype=tl.float32)
            else:
                sink = tl.zeros((BLOCK_H,), dtype=tl.float32) - float("inf")
            stats = tl.load(STATS + at, mask=cell, other=0.0)
            lse = tl.where(alone[:, None], sink[None, :], stats)
            lse = tl.where(inside[:, None], lse, gap_lse)
            lse = tl.where(bad, float("nan"), lse)
            tl.store(LSE + at, lse, mask=cell)
            if BACKWARD_STATS:
                tl.store(BSTATS + at, tl.where(lse == float("-inf"), float("inf"), lse), mask=cell)
            if STATS_APART:  # the backward's stats: finite outside every sequence
                tl.store(STATS + at, tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32), mask=cell & ~inside[:, None])
