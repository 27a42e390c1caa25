"""Per-sequence tables and row fix-ups of cuDNN's padded and THD calls (kernels: sequence_kernels.py).

A padded or THD pass is: `SequenceTable.build` (one kernel: lengths, ragged offsets and the offsets'
check, into one int32 tensor whose rows cuDNN reads by address), the cuDNN graph, then `fix_rows` on
each side's outputs (one kernel per side). Nothing is read back to the host and nothing depends on
whether the offsets were read before: a broken call gives NaN in every output and gradient.
"""

from __future__ import annotations

import torch
import triton

from fusedattn.backends.cudnn import sequence_kernels
from fusedattn.backends.cudnn.sequence_layout import Layout, config_layout, layout_of
from fusedattn.backends.fast_launch import FastLaunch
from fusedattn.config import SoftmaxType
from fusedattn.score_mods.core import MASKED

__all__ = ["Layout", "layout_of", "config_layout", "SequenceTable", "table_programs", "table_constants",
           "fix_constants", "ROWS_PER_PROGRAM"]

_TABLE_BLOCK = 128  # sequences per step of the table kernel
_PENALTY_BLOCK = 1024  # penalties per step of a penalty program
ROWS_PER_PROGRAM = 16
_ELEMENTS_PER_STEP = 1024
_SINK_KINDS = {SoftmaxType.VANILLA: 0, SoftmaxType.OFF_BY_ONE: 1, SoftmaxType.LEARNABLE: 2}
_sequence_tables = FastLaunch(sequence_kernels.sequence_tables)
_fix_rows = FastLaunch(sequence_kernels.fix_rows)


_INT32_MAX = 2**31 - 1


def _check_offsets_fit(layout: Layout, totals: tuple[int, int]) -> None:
    """cuDNN's ragged offsets are int32 element offsets: refuse packed tensors whose offsets could pass that."""
    for index, (name, unit) in enumerate(layout.offsets):
        tokens = totals[0] if index < layout.queries else totals[1]
        if tokens * unit > _INT32_MAX:
            raise ValueError(
                f"fusedattn: cudnn: THD offsets of {name!r} reach {tokens} tokens x {unit} elements = {tokens * unit}, "
                f"past cuDNN's int32 ragged offsets ({_INT32_MAX}); split the packed batch, or use backend='reference'")


class SequenceTable:
    """One call's table on the device: its rows' addresses, tensor views where a caller needs them."""

    def __init__(self, layout: Layout, table: torch.Tensor):
        self.layout, self.table = layout, table
        step = layout.width * 4  # bytes per row
        base = table.data_ptr()
        self.addresses = {"seq_len_q": base, "seq_len_kv": base + step}
        for row, (name, _) in enumerate(layout.offsets, start=4):
            self.addresses["ro_" + name] = base + row * step
        penalties = layout.penalty_rows
        if penalties is not None:  # a score_mod graph's padding (see Layout.penalty_rows)
            self.addresses["sm_row_penalty"] = base + penalties[0] * step
            self.addresses["sm_col_penalty"] = base + penalties[1] * step

    @classmethod
    def build(cls, layout: Layout, cu_q: torch.Tensor, cu_kv: torch.Tensor, padded_q: torch.Tensor | None,
              padded_kv: torch.Tensor | None, totals: tuple[int, int] | None) -> SequenceTable:
        """totals: (query tokens, key tokens) of THD tensors, the bound of the last offset; None when padded."""
        if totals is not None:
            _check_offsets_fit(layout, totals)
        table = torch.empty(layout.rows, layout.width, dtype=torch.int32, device=cu_q.device)
        _sequence_tables((table_programs(layout),),
            cu_q, cu_kv, cu_q if padded_q is None else padded_q, cu_kv if padded_kv is None else padded_kv,
            table, layout.batch, *layout.limits, *(totals or (0, 0)), layout.width,
            **table_constants(layout, padded_q is not None, padded_kv is not None))
        return cls(layout, table)

    def lengths(self, side: str) -> torch.Tensor:
        """(B, 1, 1, 1) int32 lengths of one side ("q" or "kv"), as the graph binds them."""
        return self.table[0 if side == "q" else 1, :self.layout.batch].view(-1, 1, 1, 1)

    def broken(self) -> torch.Tensor:
        """A 0-d boolean: the offsets broke the rules (every output is NaN then)."""
        return self.table[self.layout.flag_row, 0] != 0

    def fix_rows(self, side: str, x: torch.Tensor, y: torch.Tensor | None = None, *, seqlen: int,
                 lse: torch.Tensor | None = None, stats: torch.Tensor | None = None, sink: torch.Tensor | None = None,
                 softmax: SoftmaxType = SoftmaxType.VANILLA, backward_stats: torch.Tensor | None = None) -> None:
        """Fix the rows of one side in place. x, y: (B, S, H, D) views (THD: (T, H, D)) of that side's outputs
        or gradients; lse, stats: (B, S, H) views (THD: (T, H)) of the returned LSE and of the stats cuDNN
        wrote (the same tensor for THD), for the forward's query side. backward_stats: strided as lse, gets the
        stats a score_mod backward reads (the native operator's forward writes them so)."""
        layout = self.layout
        ragged = layout.ragged
        rows = x.shape[0] if ragged else x.shape[0] * x.shape[1]
        if rows == 0:
            return
        seqlen = 1 if ragged else seqlen
        strides = lambda t: (0, *t.stride()[:2]) if ragged else t.stride()[:3]  # noqa: E731
        heads = x.shape[-2]
        has_lse = lse is not None
        _fix_rows((triton.cdiv(rows, ROWS_PER_PROGRAM),),
            x, x if y is None else y, lse if has_lse else x, stats if has_lse else x,
            sink if sink is not None else x, x if backward_stats is None else backward_stats, self.table,
            layout.width, layout.batch, rows, seqlen, heads,
            x.shape[-1], x.shape[-1] if y is None else y.shape[-1], 0.0 if ragged else float("-inf"),
            *strides(x), *strides(x if y is None else y),
            *(strides(lse) if has_lse else (0, 0, 0)),
            **fix_constants(layout, side, heads, x.shape[-1], None if y is None else y.shape[-1], has_lse,
                            has_lse and stats is not lse, softmax, backward_stats is not None))


def table_programs(layout: Layout) -> int:
    """The table kernel's programs: one for the table, and one per sequence for its penalties."""
    return 1 + (layout.batch if layout.penalty_rows is not None else 0)


def table_constants(layout: Layout, padded_q: bool, padded_kv: bool) -> dict:
    """The constexprs of `sequence_tables` for a layout (the native operator compiles the same kernel)."""
    rows = layout.penalty_rows or (0, 0)
    seqlens = layout.penalties or (0, 0)
    return dict(ROW_UNITS=layout.row_units, ROW_SIDES=layout.row_sides, N_ROWS=len(layout.row_units),
                PADDED_Q=padded_q, PADDED_KV=padded_kv, CHECK_TOTAL=layout.ragged, BLOCK=_TABLE_BLOCK,
                BLOCKS=triton.cdiv(layout.batch + 1, _TABLE_BLOCK), PENALTY_ROW_Q=rows[0], PENALTY_ROW_KV=rows[1],
                SEQ_Q=seqlens[0], SEQ_KV=seqlens[1], MASKED=MASKED,
                PENALTY_BLOCK=min(_PENALTY_BLOCK, triton.next_power_of_2(max(seqlens))))


def fix_constants(layout: Layout, side: str, heads: int, dim_x: int, dim_y: int | None, has_lse: bool,
                  stats_apart: bool, softmax: SoftmaxType, backward_stats: bool = False) -> dict:
    """The constexprs of `fix_rows` for one side's rows (dim_y None: no second tensor). backward_stats: it
    also writes a score_mod backward's stats (the native operator's forward)."""
    steps = lambda dim: triton.cdiv(heads * dim, _ELEMENTS_PER_STEP)  # noqa: E731
    return dict(SIDE=0 if side == "q" else 1, N_UNITS=len(layout.offsets), RAGGED=layout.ragged,
                SEARCH_STEPS=max(layout.batch.bit_length() + 1, 1), HAS_Y=dim_y is not None, HAS_LSE=has_lse,
                STATS_APART=stats_apart, SINK_KIND=_SINK_KINDS[softmax], BLOCK_R=ROWS_PER_PROGRAM,
                BLOCK_E=_ELEMENTS_PER_STEP, STEPS_X=steps(dim_x), STEPS_Y=steps(dim_x if dim_y is None else dim_y),
                BLOCK_H=triton.next_power_of_2(max(heads, 1)), BACKWARD_STATS=backward_stats)
