"""A call with a mask_mod, rewritten to use the backends' own masks where the mask_mod has them.

A mask written as a score_mod select makes every kernel compute every tile; the same mask as
`mask='causal'`, a `window` or padding lengths lets cuDNN skip the tiles it hides. So before a
call with a mask_mod is configured, its conditions (mask_forms) are mapped, for this call's
shapes, onto our options:

    a band (causal, sliding window)    mask 'causal' / 'causal_bottom_right' / 'none' + window
    idx < lengths[b] + n, idx < n      mask 'padding*' + cu_seqlens_q/kv computed on the device
                                       (clipped to [0, S]; nothing is read back)
    a document mask                    THD (torch, no other mask left; fusedattn.torch.documents)

Conditions that do not map stay in the score_mod graph (flex.PartialMask), and the call's
result is the same either way: the reference backend runs both and the tests compare them.
A call that already names a mask, window, offsets or a ragged layout, or whose score_mod is not
flex-style (those refuse a mask_mod), is left as it is. Two options change what a rewrite may do:
with a sink (softmax_type other than 'vanilla') a length on q_idx stays in the graph (a padding
row's LSE is -inf; a row without keys keeps the sink's term), and with `alibi_slopes` the rewrite
is taken only where the mask keeps ALiBi's diagonal (see _keeps_alibi_diagonal).
"""

from __future__ import annotations

from dataclasses import dataclass

from fusedattn.layout import layout_spec
from fusedattn.score_mods.expr import ExprError
from fusedattn.score_mods.flex import PartialMask, is_flex_score_mod, trace_mask
from fusedattn.score_mods.mask_forms import Band, Document, Length, MaskForms
from fusedattn.xp import namespace

__all__ = ["NativeMask", "Documents", "native_mask", "rewrite_mask"]

_UNTOUCHED = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "segment_ids_q",
              "segment_ids_kv")
_INTEGERS = ("int8", "int16", "int32", "int64", "uint8")


@dataclass(frozen=True)
class NativeMask:
    """What of a mask_mod runs as native masks for one call shape."""

    mask: str  # none, causal, causal_bottom_right, padding, padding_causal
    window: tuple | None
    lengths: tuple  # the Length of each padded axis
    document: Document | None  # run as THD by the frontend (torch)
    kept: frozenset  # numbers of the conditions left in the score_mod graph
    partial: PartialMask | None  # the mask_mod to pass on: its kept conditions (one object per choice)
    fallback: PartialMask | None  # with a document: the same plus the document condition (ids not sorted)


def _window(left: int | None, right: int | None) -> tuple[int, int] | None:
    """Our window for bounds around a diagonal (None: unbounded, -1), or None if one is negative."""
    if (left is not None and left < 0) or (right is not None and right < 0):
        return None
    return (-1 if left is None else left, -1 if right is None else right)


def _band_options(band: Band, seqlen_q: int, seqlen_kv: int, padded: bool) -> tuple[str, tuple] | None:
    """(mask, window) for a band in absolute positions, or None when no native mask is that band."""
    top_left = _window(band.left, band.right)
    if top_left is None:
        return None
    if band.right == 0:
        return ("padding_causal" if padded else "causal"), top_left
    if padded:  # padding masks align other windows per sequence, not in absolute positions
        return None
    shift = seqlen_kv - seqlen_q  # the bottom-right diagonal is kv_idx = q_idx + shift
    window = _window(None if band.left is None else band.left + shift,
                     None if band.right is None else band.right - shift)
    if window is None:
        return None
    return ("causal_bottom_right" if window[1] == 0 and shift != 0 else "none"), window


def _length_usable(forms: MaskForms, length: Length, batch: int) -> bool:
    if length.slot is None:
        return True
    lengths = forms.expr.captured[length.slot]
    ops = namespace(lengths)
    return tuple(lengths.shape) == (batch,) and ops.dtype_name(lengths) in _INTEGERS


def native_mask(mask_mod, forms: MaskForms, batch: int, seqlen_q: int, seqlen_kv: int,
                document_ok: bool, query_lengths_ok: bool = True) -> NativeMask:
    """The native masks for these shapes (cached on forms, mask_mod's trace). document_ok: the
    frontend can run a document mask as THD when nothing else stays in the graph. query_lengths_ok:
    a length on q_idx may become padding (not with a sink: a padding row's LSE is -inf, while a row
    the mask_mod leaves without keys keeps the sink's term)."""
    return forms.choices.get_or_build(
        (batch, seqlen_q, seqlen_kv, document_ok, query_lengths_ok),
        lambda: _choose(mask_mod, forms, batch, seqlen_q, seqlen_kv, document_ok, query_lengths_ok))


def _choose(mask_mod, forms: MaskForms, batch: int, seqlen_q: int, seqlen_kv: int,
            document_ok: bool, query_lengths_ok: bool) -> NativeMask:
    native: set[int] = set()
    number = {node: i for i, (node, _) in enumerate(forms.conditions)}
    lengths = {}
    for node, length in forms.of(Length):
        size = seqlen_q if length.axis == "q_idx" else seqlen_kv
        if length.slot is None and length.offset >= size:  # true at every position of this call
            native.add(number[node])
        elif length.axis == "q_idx" and not query_lengths_ok:
            continue
        elif length.axis not in lengths and _length_usable(forms, length, batch):
            lengths[length.axis] = length
            native.add(number[node])
    bands = forms.of(Band)
    band = Band(_tightest(b.left for _, b in bands), _tightest(b.right for _, b in bands))
    mask, window = ("padding" if lengths else "none"), None
    if bands:
        mapped = _band_options(band, seqlen_q, seqlen_kv, bool(lengths))
        if mapped is not None:
            mask, window = mapped
            native.update(number[node] for node, _ in bands)
    document = fallback = None
    documents = forms.of(Document)
    rest = [i for i in range(len(forms.conditions)) if i not in native]
    if (document_ok and not lengths and len(documents) == 1 and rest == [number[documents[0][0]]]
            and _document_usable(forms, documents[0][1], batch, seqlen_q)):
        document = documents[0][1]
        fallback = PartialMask(mask_mod, frozenset(rest))
        native.add(rest.pop())
    kept = frozenset(rest)
    return NativeMask(mask, window, tuple(lengths.values()), document, kept,
                      PartialMask(mask_mod, kept) if kept else None, fallback)


def _keeps_alibi_diagonal(chosen: NativeMask, seqlen_q: int, seqlen_kv: int) -> bool:
    """Whether the rewritten call measures ALiBi's distances from the diagonal the unrewritten one does:
    a call whose mask is 'none' measures them from the bottom-right diagonal, 'causal' from the top-left
    one and padding masks per sequence (tests/naive.py), so only a rewrite to 'none' or
    'causal_bottom_right' (or any band when Sq == Skv, where the diagonals meet), without lengths,
    keeps them."""
    if chosen.lengths:
        return False
    return chosen.mask in ("none", "causal_bottom_right") or seqlen_q == seqlen_kv


def _document_usable(forms: MaskForms, document: Document, batch: int, seqlen: int) -> bool:
    ids = forms.expr.captured[document.slot]
    return tuple(ids.shape) == ((batch, seqlen) if document.batched else (seqlen,))


def _tightest(bounds) -> int | None:
    given = [b for b in bounds if b is not None]
    return min(given) if given else None


def _counts(forms: MaskForms, length: Length | None, batch: int, size: int, like):
    """(B,) int32 lengths of one axis on like's device, clipped to [0, size]."""
    ops = namespace(like)
    if length is None or length.slot is None:
        count = size if length is None else min(max(length.offset, 0), size)
        return ops.full((batch,), count, like, "int32")
    lengths = ops.astype(forms.expr.captured[length.slot], "int64")
    return ops.astype(ops.clip(lengths + length.offset, 0, size), "int32")


def _cumulative(ops, counts, like):
    return ops.concatenate([ops.full((1,), 0, like, "int32"), ops.astype(ops.cumsum(counts, 0), "int32")], 0)


def _shapes(q, k, layout: str) -> tuple[int, int, int] | None:
    """(B, Sq, Skv) of a dense unpacked layout (bshd, sbhd, bhsd), else None."""
    try:
        spec = layout_spec(layout)
    except ValueError:
        return None  # the call's own validation names the bad layout
    axes = spec.tensors[0][1]
    packed_or_ragged = spec.base is not spec.layout or spec.layout.is_ragged
    if packed_or_ragged or getattr(q, "ndim", 0) != 4 or getattr(k, "ndim", 0) != 4:
        return None
    batch, sequence = axes.index("B"), axes.index("S")
    return q.shape[batch], q.shape[sequence], k.shape[sequence]


@dataclass(frozen=True)
class Documents:
    """A document mask for the frontend to run as THD: the ids, (B, S) when batched, else (S,)."""

    ids: object
    batch: int
    seqlen: int
    fallback: PartialMask  # the mask_mod with the document condition kept, if the ids are not sorted


def rewrite_mask(framework: str, q, k, v, options: dict, document_ok: bool) -> tuple[dict, Documents | None]:
    """The options with mask_mod's native parts as masks (the same options when nothing maps), and a
    document mask left for the caller to run as THD (its options then hold everything else)."""
    mask_mod = options.get("mask_mod")
    layout = options.get("layout") or "bshd"
    score_mod = options.get("score_mod")
    if (mask_mod is None or isinstance(mask_mod, PartialMask) or v is None or options.get("mask", "none") != "none"
            or (score_mod is not None and not is_flex_score_mod(score_mod))
            or options.get("window") is not None or any(options.get(n) is not None for n in _UNTOUCHED)):
        return options, None
    shapes = _shapes(q, k, layout) if isinstance(layout, str) else None
    if shapes is None:
        return options, None
    batch, seqlen_q, seqlen_kv = shapes
    try:
        forms = trace_mask(framework, mask_mod, getattr(q, "device", None) if framework == "torch" else None)
    except ExprError:
        return options, None  # the score_mod path gives the reason
    chosen = native_mask(mask_mod, forms, batch, seqlen_q, seqlen_kv, document_ok and seqlen_q == seqlen_kv,
                         options.get("softmax_type", "vanilla") == "vanilla")
    if len(chosen.kept) == len(forms.conditions):
        return options, None
    if options.get("alibi_slopes") is not None and not _keeps_alibi_diagonal(chosen, seqlen_q, seqlen_kv):
        return options, None
    options = dict(options)
    options["mask_mod"] = chosen.partial
    if chosen.mask != "none":
        options["mask"] = chosen.mask
    if chosen.window is not None:
        options["window"] = chosen.window
    if chosen.lengths:
        ops = namespace(q)
        by_axis = {length.axis: length for length in chosen.lengths}
        for axis, size, name in (("q_idx", seqlen_q, "q"), ("kv_idx", seqlen_kv, "kv")):
            counts = _counts(forms, by_axis.get(axis), batch, size, q)
            options[f"cu_seqlens_{name}"] = _cumulative(ops, counts, q)
            options[f"max_seqlen_{name}"] = size
    documents = None
    if chosen.document is not None:
        documents = Documents(forms.expr.captured[chosen.document.slot], batch, seqlen_q, chosen.fallback)
    return options, documents
