"""Recognising boolean masks that are really a native mask: causal, padding, a sliding window.

A drop-in that receives an attention mask as a tensor (SDPA's attn_mask) can run it as an additive
bias, which is always right but makes the kernel read and compute every tile. When the mask is one
of the masks the backends have natively, it runs much faster as that mask. Recognition is exact:
the frontend reduces the mask on its device to three numbers per row (how many keys it takes, the
first one, and how many runs of taken keys it has), reads those once, and `classify` accepts a
pattern only if it reproduces every row. Anything else stays a bias.

Rows are indexed (b, i): b over the mask's batch (1 when it broadcasts over the batch), i over its
query rows (1 when it broadcasts over queries). Diagonals are top-left (key j <= query i), as
SDPA's masks are written, unless the pattern says bottom-right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Pattern", "classify"]


@dataclass(frozen=True)
class Pattern:
    """What a boolean mask is, in `attention`'s vocabulary."""

    mask: str  # none, causal, causal_bottom_right, padding, padding_causal
    window: tuple[int, int] | None = None
    kv_lengths: tuple[int, ...] | None = None  # per batch entry (padding masks), else None


def _extents(reach: np.ndarray, taken: np.ndarray) -> list[int]:
    """Window extents to try on one side: unbounded first, then the widest reach of a row that takes keys."""
    return [-1] + ([int(reach[taken].max())] if taken.any() else [])


def _expected(seqlen_q: int, seqlen_kv: int, lengths: np.ndarray, left: int, right: int, shift: int):
    """(count, first) per row (b, i) of the band [i + shift - left, i + shift + right] cut to
    [0, length_b); -1 extents are unbounded."""
    rows = np.arange(seqlen_q)[None, :] + shift
    low = np.zeros_like(rows) if left < 0 else np.maximum(rows - left, 0)
    high = np.broadcast_to(lengths[:, None] - 1, (lengths.shape[0], seqlen_q))
    if right >= 0:
        high = np.minimum(high, rows + right)
    low = np.broadcast_to(low, high.shape)
    count = np.maximum(high - low + 1, 0)
    return count, np.where(count > 0, low, 0)


def classify(count: np.ndarray, first: np.ndarray, runs: np.ndarray, seqlen_q: int, seqlen_kv: int,
             batch: int) -> Pattern | None:
    """The native mask that reproduces every row, or None.

    count, first, runs: (Bm, Lm) integers per mask row (Bm in {1, batch}, Lm in {1, seqlen_q}): keys
    taken, index of the first one taken (any value for an empty row), runs of consecutive taken keys.
    """
    if (runs > 1).any():  # a row with a gap is no band
        return None
    count, first = count.astype(np.int64), first.astype(np.int64)
    first = np.where(count > 0, first, 0)
    if count.shape[1] == 1 or (count == count[:, :1]).all() and (first == first[:, :1]).all():
        # The same keys for every query: key padding when they are a prefix.
        if not ((first[:, 0] != 0) & (count[:, 0] > 0)).any():
            lengths = np.broadcast_to(count[:, 0], (batch,))
            if (lengths == seqlen_kv).all():
                return Pattern("none")
            return Pattern("padding", kv_lengths=tuple(int(n) for n in lengths))
    if count.shape[1] != seqlen_q:
        return None
    rows = np.arange(seqlen_q)[None, :]
    taken = count > 0
    lengths = np.full(count.shape[0], seqlen_kv, dtype=np.int64)
    last = np.where(taken, first + count - 1, -1)
    candidates = []
    # Top-left causal, perhaps with a window and key padding: row i takes keys up to min(i, length - 1).
    padded = last.max(axis=1) + 1
    padded = np.where(padded >= min(seqlen_q, seqlen_kv), seqlen_kv, padded)
    candidates.append(("causal", padded, 0))
    # Bottom-right causal: row i takes keys up to i + Skv - Sq.
    if seqlen_kv != seqlen_q:
        candidates.append(("causal_bottom_right", lengths, seqlen_kv - seqlen_q))
    for mask, kv_lengths, shift in candidates:
        for left in _extents(rows + shift - first, taken):
            if _matches(count, first, seqlen_q, seqlen_kv, kv_lengths, left, 0, shift):
                padding = (kv_lengths != seqlen_kv).any()
                if padding and mask != "causal":
                    break
                window = (left, 0) if left >= 0 else None
                if padding:
                    return Pattern("padding_causal", window,
                                   tuple(int(n) for n in np.broadcast_to(kv_lengths, (batch,))))
                return Pattern(mask, window)
    # A two-sided window, where top-left and bottom-right diagonals agree (Sq == Skv).
    if seqlen_q == seqlen_kv:
        for left in _extents(rows - first, taken):
            for right in _extents(last - rows, taken):
                if (left >= 0 or right >= 0) and _matches(count, first, seqlen_q, seqlen_kv, lengths, left, right, 0):
                    return Pattern("none", (left, right))
    return None


def _matches(count, first, seqlen_q, seqlen_kv, lengths, left, right, shift) -> bool:
    want_count, want_first = _expected(seqlen_q, seqlen_kv, lengths, left, right, shift)
    return bool((want_count == count).all() and (want_first == first).all())
