"""Layouts: which tensors a layout takes, their axes, packing and THD conversions.

Works on torch tensors and JAX arrays alike through `fusedattn.xp`. Axis letters:
B batch, S sequence, H heads, D head dim, T packed tokens, 3/2 the packing axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusedattn.config import Layout
from fusedattn.xp import namespace

__all__ = [
    "LayoutSpec",
    "layout_spec",
    "split_packed",
    "to_bhsd",
    "from_bhsd",
    "dense_to_tokens",
    "tokens_to_dense",
    "lse_tokens_to_dense",
    "document_offsets",
    "sequence_starts",
    "thd_to_padded",
    "padded_to_thd",
    "segment_ids_to_cu_seqlens",
    "cu_seqlens_to_segment_ids",
    "check_cu_seqlens",
    "check_segment_ids",
    "offsets_violated",
    "segment_ids_violated",
]


@dataclass(frozen=True)
class LayoutSpec:
    """The tensors a layout takes, e.g. bshd_bs2hd -> (("q", "BSHD"), ("kv", "BS2HD"))."""

    layout: Layout
    tensors: tuple[tuple[str, str], ...]
    base: Layout  # layout of q, k, v once unpacked, and of the output

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.tensors)


def _spec(layout: str, *tensors: tuple[str, str], base: str) -> LayoutSpec:
    return LayoutSpec(Layout(layout), tuple(tensors), Layout(base))


_SPECS = {
    spec.layout: spec
    for spec in (
        _spec("bshd", ("q", "BSHD"), ("k", "BSHD"), ("v", "BSHD"), base="bshd"),
        _spec("sbhd", ("q", "SBHD"), ("k", "SBHD"), ("v", "SBHD"), base="sbhd"),
        _spec("bhsd", ("q", "BHSD"), ("k", "BHSD"), ("v", "BHSD"), base="bhsd"),
        _spec("thd", ("q", "THD"), ("k", "THD"), ("v", "THD"), base="thd"),
        _spec("bs3hd", ("qkv", "BS3HD"), base="bshd"),
        _spec("sb3hd", ("qkv", "SB3HD"), base="sbhd"),
        _spec("t3hd", ("qkv", "T3HD"), base="thd"),
        _spec("bshd_bs2hd", ("q", "BSHD"), ("kv", "BS2HD"), base="bshd"),
        _spec("sbhd_sb2hd", ("q", "SBHD"), ("kv", "SB2HD"), base="sbhd"),
        _spec("thd_t2hd", ("q", "THD"), ("kv", "T2HD"), base="thd"),
    )
}


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of this shape (an empty axis counts as one element)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def layout_spec(layout) -> LayoutSpec:
    return _SPECS[Layout.parse(layout, "layout")]


def split_packed(layout, tensors):
    """Views (q, k, v) of the tensors a layout takes; packed tensors are sliced, not copied."""
    spec = layout_spec(layout)
    out = []
    for (name, axes), x in zip(spec.tensors, tensors):
        pack = axes.find("3") if "3" in axes else axes.find("2")
        if pack < 0:
            out.append(x)
        elif hasattr(x, "unbind"):  # torch: one node whose backward stacks the gradients into the pack
            out.extend(x.unbind(pack))
        else:
            lead = (slice(None),) * pack
            out.extend(x[lead + (i,)] for i in range(len(name)))
    return tuple(out)


def to_bhsd(x, base):
    """A bshd/sbhd/bhsd tensor viewed as (B, H, S, D)."""
    ops = namespace(x)
    base = Layout.parse(base, "layout")
    if base is Layout.BSHD:
        return ops.moveaxis(x, 2, 1)
    if base is Layout.SBHD:
        return ops.moveaxis(x, 0, 2)  # S B H D -> B H S D
    if base is Layout.BHSD:
        return x
    raise ValueError(f"to_bhsd: expected layout bshd, sbhd or bhsd, got {base.value!r}")


def from_bhsd(x, base):
    """Inverse of `to_bhsd`."""
    ops = namespace(x)
    base = Layout.parse(base, "layout")
    if base is Layout.BSHD:
        return ops.moveaxis(x, 1, 2)
    if base is Layout.SBHD:
        return ops.moveaxis(x, 2, 0)  # B H S D -> S B H D
    if base is Layout.BHSD:
        return x
    raise ValueError(f"from_bhsd: expected layout bshd, sbhd or bhsd, got {base.value!r}")


def dense_to_tokens(x, base):
    """(B*S, H, D) tokens, batch-major, from a bshd/sbhd/bhsd tensor (documents run as THD). BSHD is one
    reshape (a view where the memory allows), read off the array itself: every op here is also a node
    of torch's backward, and this runs on a document call's warm path."""
    if base == "bshd":  # (a Layout is a str enum)
        return x.reshape(-1, *x.shape[2:])
    ops = namespace(x)
    x = ops.moveaxis(to_bhsd(x, Layout.parse(base, "layout")), 1, 2)
    return ops.reshape(x, (-1, *x.shape[2:]))


def tokens_to_dense(x, base, batch: int):
    """Inverse of `dense_to_tokens` for `batch` rows."""
    x = x.reshape(batch, -1, *x.shape[1:])
    if base == "bshd":
        return x
    return from_bhsd(namespace(x).moveaxis(x, 1, 2), Layout.parse(base, "layout"))


def lse_tokens_to_dense(lse, batch: int):
    """A THD call's LSE (T, Hq) as the dense layouts' (B, Hq, S); None stays None."""
    if lse is None:
        return None
    return lse.reshape(batch, -1, lse.shape[1]).swapaxes(1, 2)


def document_offsets(starts: np.ndarray) -> tuple[np.ndarray, int]:
    """(cu_seqlens int32, longest) of the documents over B*S tokens, from a flat (B*S,) bool array that is
    True where a document starts (every row's first token among them)."""
    offsets = np.append(np.flatnonzero(starts), starts.size).astype(np.int32)
    return offsets, int(np.diff(offsets).max())


def sequence_starts(cu_seqlens, padded_offsets=None):
    """(starts, lengths) of each packed sequence; padded offsets give the starts when present."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = (padded_offsets if padded_offsets is not None else cu_seqlens)[:-1]
    return starts, lengths


def thd_to_padded(x, cu_seqlens, max_seqlen: int, padded_offsets=None):
    """(T, ...) packed tokens -> (B, max_seqlen, ...), zeros past each sequence's end."""
    ops = namespace(x)
    starts, lengths = sequence_starts(cu_seqlens, padded_offsets)
    position = ops.arange(max_seqlen, like=x, dtype="int64")
    index = ops.astype(starts, "int64")[:, None] + position[None, :]  # (B, S)
    valid = position[None, :] < lengths[:, None]
    index = ops.where(valid, index, 0)
    index = ops.clip(index, 0, max(x.shape[0] - 1, 0))
    if x.shape[0] == 0:  # nothing to gather: every position is padding
        return ops.full((index.shape[0], max_seqlen) + tuple(x.shape[1:]), 0, x, ops.dtype_name(x))
    gathered = ops.take(x, index, axis=0)
    valid = ops.reshape(valid, tuple(valid.shape) + (1,) * (len(x.shape) - 1))
    return ops.where(valid, gathered, 0)


def padded_to_thd(y, cu_seqlens, total_tokens: int, padded_offsets=None):
    """(B, S, ...) -> (total_tokens, ...) packed; tokens outside every sequence are zero."""
    ops = namespace(y)
    batch, seqlen = y.shape[0], y.shape[1]
    if batch * seqlen == 0:  # no sequence, or none with a token: every token lies outside them
        return ops.full((total_tokens,) + tuple(y.shape[2:]), 0, y, ops.dtype_name(y))
    starts, lengths = sequence_starts(cu_seqlens, padded_offsets)
    token = ops.arange(total_tokens, like=y, dtype="int64")
    starts64 = ops.astype(starts, "int64")
    b = ops.clip(ops.searchsorted(starts64, token, right=True) - 1, 0, batch - 1)
    position = token - ops.take(starts64, b, axis=0)
    valid = (position >= 0) & (position < ops.take(ops.astype(lengths, "int64"), b, axis=0))
    flat_index = ops.where(valid, b * seqlen + ops.clip(position, 0, max(seqlen - 1, 0)), 0)
    flat = ops.reshape(y, (batch * seqlen,) + tuple(y.shape[2:]))
    gathered = ops.take(flat, flat_index, axis=0)
    valid = ops.reshape(valid, (total_tokens,) + (1,) * (len(y.shape) - 2))
    return ops.where(valid, gathered, 0)


def segment_ids_to_cu_seqlens(segment_ids, batch: int):
    """Packed segment ids (T,) -> cu_seqlens (B+1,).

    Token t belongs to sequence segment_ids[t] in [0, B); ids must be non-decreasing,
    so each sequence is contiguous; ids >= B mark trailing padding tokens.
    """
    ops = namespace(segment_ids)
    ids = ops.astype(segment_ids, "int32")
    sequences = ops.arange(batch + 1, like=ids, dtype="int32")
    return ops.astype(ops.searchsorted(ids, sequences, right=False), "int32")


def check_segment_ids(argument: str, segment_ids: np.ndarray) -> None:
    """Validate host copies of packed segment ids: integers >= 0, non-decreasing (each sequence contiguous)."""
    ids = np.asarray(segment_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"{argument}: expected an integer array, got dtype {ids.dtype}")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{argument}: expected ids >= 0, got {int(ids.min())} at token {int(np.argmin(ids))}")
    drops = np.flatnonzero(np.diff(ids.astype(np.int64)) < 0)
    if drops.size:
        t = int(drops[0])
        raise ValueError(f"{argument}: expected non-decreasing ids (each sequence's tokens contiguous, in order), "
                         f"got {int(ids[t])} then {int(ids[t + 1])} at tokens {t} and {t + 1}")


def segment_ids_violated(segment_ids):
    """On the device: a 0-d boolean, True when packed segment ids break check_segment_ids' rules."""
    ops = namespace(segment_ids)
    ids = ops.astype(segment_ids, "int64")
    if ids.shape[0] == 0:
        return ops.any(ids < 0, axis=0)
    return ops.any(ids[1:] < ids[:-1], axis=0) | (ids[0] < 0)


def offsets_violated(cu_seqlens, max_seqlen: int, total_tokens: int | None, padded_offsets=None):
    """On the device: a 0-d boolean, True when offsets break the rules check_cu_seqlens enforces on
    the host, or hold a sequence longer than max_seqlen. For offsets whose values are not read (traced
    under jit, or trusted GPU tensors), so a bad call can be made to give NaN instead of a plausible
    answer, without waiting for the device."""
    ops = namespace(cu_seqlens)
    cu = ops.astype(cu_seqlens, "int64")
    lengths = cu[1:] - cu[:-1]
    bad = (cu[0] != 0) | ops.any((lengths < 0) | (lengths > max_seqlen), axis=0)
    if padded_offsets is None:
        return bad | (cu[-1] > total_tokens) if total_tokens is not None else bad
    padded = ops.astype(padded_offsets, "int64")
    room = padded[1:] - padded[:-1]
    bad = bad | (padded[0] < 0) | ops.any(room < lengths, axis=0)
    return bad | (padded[-1] > total_tokens) if total_tokens is not None else bad


def cu_seqlens_to_segment_ids(cu_seqlens, total_tokens: int):
    """cu_seqlens (B+1,) -> segment ids (T,); tokens past the last sequence get id B."""
    ops = namespace(cu_seqlens)
    token = ops.arange(total_tokens, like=cu_seqlens, dtype=ops.dtype_name(cu_seqlens))
    return ops.astype(ops.searchsorted(cu_seqlens[1:], token, right=True), "int32")


def check_cu_seqlens(argument: str, cu_seqlens: np.ndarray, total_tokens: int,
                     padded_offsets: np.ndarray | None = None, padded_argument: str = "") -> int:
    """Validate host copies of cu_seqlens (and padded offsets); return the longest sequence.

    Raises ValueError naming the argument and the offending values.
    """
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.shape[0] < 1:
        raise ValueError(f"{argument}: expected a 1-D tensor of B+1 offsets (B >= 0), got shape {tuple(cu.shape)}")
    if cu[0] != 0:
        raise ValueError(f"{argument}: expected the first offset to be 0, got {int(cu[0])}")
    lengths = np.diff(cu.astype(np.int64))
    if (lengths < 0).any():
        b = int(np.argmax(lengths < 0))
        raise ValueError(
            f"{argument}: expected non-decreasing offsets, got {int(cu[b])} then {int(cu[b + 1])} at index {b}"
        )
    if padded_offsets is None:
        if cu[-1] > total_tokens:
            raise ValueError(
                f"{argument}: last offset {int(cu[-1])} exceeds the {total_tokens} packed tokens of the tensor"
            )
        return int(lengths.max(initial=0))
    padded = np.asarray(padded_offsets).astype(np.int64)
    if padded.shape != cu.shape:
        raise ValueError(f"{padded_argument}: expected shape {tuple(cu.shape)} like {argument}, "
                         f"got {tuple(padded.shape)}")
    if padded[0] < 0:
        raise ValueError(f"{padded_argument}: expected offsets >= 0, got {int(padded[0])}")
    room = np.diff(padded)
    if (room < 0).any():
        b = int(np.argmax(room < 0))
        raise ValueError(f"{padded_argument}: expected non-decreasing offsets, got {int(padded[b])} then "
                         f"{int(padded[b + 1])} at index {b}")
    if (room < lengths).any():
        b = int(np.argmax(room < lengths))
        raise ValueError(
            f"{padded_argument}: sequence {b} holds {int(lengths[b])} tokens but its padded slot "
            f"[{int(padded[b])}, {int(padded[b + 1])}) has room for {int(room[b])}"
        )
    if padded[-1] > total_tokens:
        raise ValueError(
            f"{padded_argument}: last offset {int(padded[-1])} exceeds the {total_tokens} packed tokens of the tensor"
        )
    return int(lengths.max(initial=0))
