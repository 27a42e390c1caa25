"""One Triton kernel for the rows a score_mod left without keys, run after a cuDNN forward.

cuDNN gives such a row the mean of V and an LSE near the mask's score (below MASKED_BELOW, or NaN).
The library promises output 0 and LSE -inf there, and its backward reads +inf stats for them (so
their probabilities are 0). With torch ops that is five small kernels and as many launches of host
time (torch_op.cc: clear_empty_rows, the fallback); this kernel does it in one pass over the LSE,
writing the output only in the rows it empties (a block of rows with none empty never touches it).

Rows are the LSE's, (N0, N1, N2) and contiguous; the output row (i0, i1, i2) starts at
i0 * S0 + i1 * S1 + i2 * S2 elements: a dense forward's LSE is (B, H, S) and its output's (b, h, s)
strides are (S0, S1, S2). The launch has programs(N0 * N1, N2) programs.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedattn.score_mods.core import MASKED_BELOW

__all__ = ["clear_empty_rows", "ROWS_PER_PROGRAM", "constants", "programs", "run"]

ROWS_PER_PROGRAM = 64
POINTERS = {"RAW": "*fp32", "LSE": "*fp32"}  # OUT takes the call's dtype; every other argument is int64


@triton.jit
def clear_empty_rows(OUT, RAW, LSE, ROWS, N1, N2, S0, S1, S2, TRAINING: tl.constexpr, DIM: tl.constexpr,
                     BLOCK_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr, MASKED: tl.constexpr):
    """RAW: cuDNN's LSE. Training: LSE gets the returned LSE (-inf in empty rows) and RAW becomes the
    backward's stats (+inf there); inference: RAW becomes the returned LSE. OUT: 0 in empty rows.

    A program takes BLOCK_ROWS consecutive rows of one (i0, i1): its indices come from the program id
    with scalar arithmetic once (per-row 64-bit division made the operator's compile, which gives no
    alignment hints, 10x larger and 20x slower). ROWS is the LSE's numel, N0 * N1 * N2."""
    blocks = tl.cdiv(N2, BLOCK_ROWS)
    program = tl.program_id(0).to(tl.int64)
    i01 = program // blocks  # i0 * N1 + i1
    i2 = (program - i01 * blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    inside = i2 < N2
    rows = i01 * N2 + i2
    raw = tl.load(RAW + rows, mask=inside, other=0.0)
    empty = inside & ~(raw >= MASKED)  # NaN counts as empty
    if TRAINING:
        tl.store(LSE + rows, tl.where(empty, float("-inf"), raw), mask=inside)
        tl.store(RAW + rows, tl.full([BLOCK_ROWS], float("inf"), tl.float32), mask=empty)
    else:
        tl.store(RAW + rows, tl.full([BLOCK_ROWS], float("-inf"), tl.float32), mask=empty)
    if tl.max(empty.to(tl.int32), axis=0) > 0:  # most blocks have none: they skip the output entirely
        i0 = i01 // N1
        start = i0 * S0 + (i01 - i0 * N1) * S1 + i2 * S2
        columns = tl.arange(0, BLOCK_DIM)
        zeros = tl.zeros([BLOCK_ROWS, BLOCK_DIM], dtype=OUT.dtype.element_ty)
        tl.store(OUT + start[:, None] + columns[None, :], zeros, mask=empty[:, None] & (columns < DIM)[None, :])


def programs(n1_rows: int, n2: int) -> int:
    """The launch's programs for an LSE of n1_rows = N0 * N1 rows of N2 each."""
    return n1_rows * triton.cdiv(n2, ROWS_PER_PROGRAM)


def constants(dim: int, training: bool) -> dict:
    """The kernel's constexprs for an output of head dim `dim`."""
    return {"TRAINING": training, "DIM": dim, "BLOCK_DIM": triton.next_power_of_2(dim),
            "BLOCK_ROWS": ROWS_PER_PROGRAM, "MASKED": MASKED_BELOW}


def run(out_rows, raw, training: bool):
    """The kernel on torch tensors (tests; the operator launches the compiled cubin itself): out_rows
    (A, N1, N2, D) in any strides, raw (A, N1, N2) contiguous float32. Returns (lse, stats) in training,
    else (raw, None), as clear_empty_rows leaves them."""
    import torch

    lse = torch.empty_like(raw) if training else raw
    grid = (programs(raw.shape[0] * raw.shape[1], raw.shape[2]),)
    if grid[0]:
        clear_empty_rows[grid](out_rows, raw, lse, raw.numel(), raw.shape[1], raw.shape[2], *out_rows.stride()[:3],
                               **constants(out_rows.shape[-1], training))
    return (lse, raw) if training else (raw, None)
