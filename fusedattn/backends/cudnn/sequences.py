"""Per-sequence tables and row fix-ups of cuDNN's padded and THD calls (kernels: sequence_kernels.py).

A padded or THD pass is: `SequenceTable.build` (one kernel: lengths, ragged offsets and the offsets'
check, into one int32 tensor whose rows cuDNN reads by address), the cuDNN graph, then `fix_rows` on
each side's outputs (one kernel per side). Nothing is read back to the host and nothing depends on
whether the offsets were read before: a broken call gives NaN in every output and gradient.
"""

from __future__ import annotations

import torch

from fusedattn.backends.cudnn import sequence_kernels
from fusedattn.backends.cudnn.sequence_constants import (
    ROWS_PER_PROGRAM,
    fix_constants,
    fix_programs,
    table_constants,
    table_programs,
)
from fusedattn.backends.cudnn.sequence_layout import Layout, config_layout, layout_of
from fusedattn.backends.fast_launch import FastLaunch
from fusedattn.config import SoftmaxType

__all__ = ["Layout", "layout_of", "config_layout", "SequenceTable", "table_programs", "table_constants",
           "fix_constants", "ROWS_PER_PROGRAM"]

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
        _fix_rows((fix_programs(rows),),
            x, x if y is None else y, lse if has_lse else x, stats if has_lse else x,
            sink if sink is not None else x, x if backward_stats is None else backward_stats, self.table,
            layout.width, layout.batch, rows, seqlen, heads,
            x.shape[-1], x.shape[-1] if y is None else y.shape[-1], 0.0 if ragged else float("-inf"),
            *strides(x), *strides(x if y is None else y),
            *(strides(lse) if has_lse else (0, 0, 0)),
            **fix_constants(layout, side, heads, x.shape[-1], None if y is None else y.shape[-1], has_lse,
                            has_lse and stats is not lse, softmax, backward_stats is not None))
