"""Bottom-right causal with Sq > Skv on the native operator: its first Sq - Skv query rows see no key.

cuDNN refuses that mask there, and the rows are simply empty (output 0, the LSE of the sink term alone:
-inf without a sink). The operator runs
the config of the rows that do see keys (spec.rows_with_keys_config: the last Skv rows, where both
diagonals meet) on a view of q, and torch ops put the empty rows in front, so autograd gives q's
gradient 0 there. The Python path does the same around its own runs (torch_run.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusedattn.backends.cudnn.spec import (
    lse_without_keys,
    rows_axis,
    rows_with_keys_bias,
    rows_with_keys_config,
    rows_without_keys,
)
from fusedattn.config import AttentionConfig
from fusedattn.frontend_common import AttentionResult

__all__ = ["RowsPlan", "plan", "run"]

class RowsPlan(NamedTuple):
    """What the operator runs for such a config: the native plan of the rows with keys, and where they lie."""

    planned: tuple  # (config of the rows with keys, selection, its native plan)
    skipped: int  # the leading rows without keys
    axis: int  # q's and out's sequence axis


def plan(cfg: AttentionConfig, selection, plan_on) -> RowsPlan | None:
    """The operator's plan for a config with rows without keys (plan_on(config) -> native plan or None),
    or None where it has none or the config has no such rows."""
    skipped = rows_without_keys(cfg)
    if not skipped:
        return None
    sub = rows_with_keys_config(cfg)
    native = plan_on(sub)
    if native is None:
        return None
    return RowsPlan((sub, selection, native), skipped, rows_axis(cfg))


def run(rows: RowsPlan, cfg: AttentionConfig, call, q: torch.Tensor, bias, sink):
    """call(planned, q, bias) on the rows with keys, its result with the empty rows in front (output 0, the
    LSE of the sink term alone)."""
    sub = rows.planned[0]
    result = call(rows.planned, q.narrow(rows.axis, rows.skipped, sub.seqlen_q), rows_with_keys_bias(cfg, bias))
    if not isinstance(result, AttentionResult):
        return _padded(result, rows.axis, rows.skipped, 0.0)
    lse = result.lse
    if lse is not None:
        empty = lse_without_keys(cfg, sink, lse).view(1, -1, 1).expand(lse.shape[0], -1, rows.skipped)
        lse = torch.cat([empty, lse], 2)
    return AttentionResult(_padded(result.out, rows.axis, rows.skipped, 0.0), lse, result.max_logit)


def _padded(x: torch.Tensor, axis: int, rows: int, value: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[axis] = rows
    return torch.cat([x.new_full(shape, value), x], axis)
