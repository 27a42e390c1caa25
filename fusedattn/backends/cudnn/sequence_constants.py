"""The constexprs and grid sizes of the sequence kernels (sequence_kernels.py) for a config's table
layout. No torch here: the torch Python path (sequences.py), the native operator's kernels
(native/sequence_plans.py) and JAX's custom calls (jax/sequence_steps.py) compile the same kernels."""

from __future__ import annotations

from fusedattn.backends.cudnn.sequence_layout import Layout
from fusedattn.config import SoftmaxType
from fusedattn.score_mods.core import MASKED

__all__ = ["ROWS_PER_PROGRAM", "table_programs", "table_constants", "fix_constants", "fix_programs"]

_TABLE_BLOCK = 128  # sequences per step of the table kernel
_PENALTY_BLOCK = 1024  # penalties per step of a penalty program
# fix_rows' tile: 4 rows of 256 elements a step. Measured on an H200 (bench/diag/fix_rows_tiles.py, B4 S1024
# H16 D128 padded): 3.1 / 2.5 / 3.1 us (forward / backward q / backward k and v) against 8.9 / 8.7 / 11.7 us
# with 16 x 1024, whose larger tiles spill registers and leave most SMs idle (few rows need writing).
ROWS_PER_PROGRAM = 4
_ELEMENTS_PER_STEP = 256
_SINK_KINDS = {SoftmaxType.VANILLA: 0, SoftmaxType.OFF_BY_ONE: 1, SoftmaxType.LEARNABLE: 2}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def table_programs(layout: Layout) -> int:
    """The table kernel's programs: one for the table, and one per sequence for its penalties."""
    return 1 + (layout.batch if layout.penalty_rows is not None else 0)


def fix_programs(rows: int) -> int:
    """The fix-up kernel's programs for `rows` rows of one side."""
    return _cdiv(rows, ROWS_PER_PROGRAM)


def table_constants(layout: Layout, padded_q: bool, padded_kv: bool) -> dict:
    """The constexprs of `sequence_tables` for a layout."""
    rows = layout.penalty_rows or (0, 0)
    seqlens = layout.penalties or (0, 0)
    return dict(ROW_UNITS=layout.row_units, ROW_SIDES=layout.row_sides, N_ROWS=len(layout.row_units),
                PADDED_Q=padded_q, PADDED_KV=padded_kv, CHECK_TOTAL=layout.ragged, BLOCK=_TABLE_BLOCK,
                BLOCKS=_cdiv(layout.batch + 1, _TABLE_BLOCK), PENALTY_ROW_Q=rows[0], PENALTY_ROW_KV=rows[1],
                SEQ_Q=seqlens[0], SEQ_KV=seqlens[1], MASKED=MASKED,
                PENALTY_BLOCK=min(_PENALTY_BLOCK, _next_power_of_2(max(seqlens))))


def fix_constants(layout: Layout, side: str, heads: int, dim_x: int, dim_y: int | None, has_lse: bool,
                  stats_apart: bool, softmax: SoftmaxType, backward_stats: bool = False) -> dict:
    """The constexprs of `fix_rows` for one side's rows (dim_y None: no second tensor). backward_stats: it
    also writes a score_mod backward's stats (the native operator's forward)."""
    steps = lambda dim: _cdiv(heads * dim, _ELEMENTS_PER_STEP)  # noqa: E731
    return dict(SIDE=0 if side == "q" else 1, N_UNITS=len(layout.offsets), RAGGED=layout.ragged,
                SEARCH_STEPS=max(layout.batch.bit_length() + 1, 1), HAS_Y=dim_y is not None, HAS_LSE=has_lse,
                STATS_APART=stats_apart, SINK_KIND=_SINK_KINDS[softmax], BLOCK_R=ROWS_PER_PROGRAM,
                BLOCK_E=_ELEMENTS_PER_STEP, STEPS_X=steps(dim_x), STEPS_Y=steps(dim_x if dim_y is None else dim_y),
                BLOCK_H=_next_power_of_2(max(heads, 1)), BACKWARD_STATS=backward_stats)
