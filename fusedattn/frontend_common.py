"""Steps both frontends share after describing a call: results and keyword checks."""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["AttentionResult", "pick_outputs"]


class AttentionResult(NamedTuple):
    """Returned instead of the bare output when return_lse or return_max_logit is set.

    out: attention output in q's layout. lse: float32 log-sum-exp of the scaled scores
    (including the sink term), (B, Hq, Sq), or (Tq, Hq) for THD; None unless return_lse.
    max_logit: float32 (Hq,) largest visible score per head; None unless return_max_logit.
    """

    out: Any
    lse: Any = None
    max_logit: Any = None


def pick_outputs(cfg, out, lse, max_logit):
    """The bare output, or an AttentionResult holding what was asked for."""
    if not (cfg.return_lse or cfg.return_max_logit):
        return out
    return AttentionResult(out, lse if cfg.return_lse else None, max_logit if cfg.return_max_logit else None)
