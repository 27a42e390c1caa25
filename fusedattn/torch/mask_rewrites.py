"""Repeat mask_mod calls without rewriting them again.

A call with a mask_mod is rewritten before it is configured (score_mods/mask_rewrite.py: its band
and length conditions become cuDNN's own masks, the rest stays a select in the graph). That costs
tens of microseconds of Python a call. The rewrite depends on the call's shapes and settings (its
plan-cache signature, which names the mask_mod by its code) and on what the mask_mod reads, so a
rewrite is kept here under both (flex.flat_reads as flex.reads_key keys them: objects by identity,
numbers by value). A repeat call, or one with the same closure made anew, then takes the warm path
with the rewritten options.

A document mask run as THD keeps its rewrite too (which captured tensor holds the ids): the
boundaries are read from the ids on each call, cached by the tensor's version (torch/documents.py),
so an in-place change of the ids shows. Rewrites that made tensors (padding lengths computed from
captured tensors on the device) are not kept: their values can change without the mask_mod reading
other objects, so those calls rewrite every time.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fusedattn.cache import LRUCache, register
from fusedattn.score_mods.flex import flat_reads, plain_reads, reads_key, unchanged_reads

__all__ = ["recall", "remember"]

CAPACITY = 256
_ABSENT = object()


class Rewrite(NamedTuple):
    mask_mod: object  # kept alive: the signature holds its code's id
    reads: tuple  # flat_reads(mask_mod) when the rewrite was made, kept alive: the key holds their ids
    changed: dict  # the options the rewrite set (a PartialMask of the kept conditions, mask, window)
    signature: tuple | None  # the rewritten call's plan-cache signature (None for documents)
    documents: object  # a document mask to run as THD (mask_rewrite.Documents), or None
    plain: bool  # reads are flex.plain_reads: a repeat call with this mask_mod compares them in place


_REWRITES: LRUCache = register("torch.mask_mod.rewrites", LRUCache(CAPACITY))


def recall(signature, options: dict) -> tuple[dict, tuple | None, object] | None:
    """(rewritten options, their signature, documents or None) kept for this call, if its mask_mod still
    reads the same objects."""
    mask_mod = options["mask_mod"]
    kept = _REWRITES.peek((signature, id(mask_mod)))  # no lock on the hot path, as score_mod_bindings.recall
    if kept is None or kept.mask_mod is not mask_mod or not unchanged_reads(mask_mod, kept.reads):
        reads = flat_reads(mask_mod)  # a mask_mod made anew, or one reading other objects now
        if reads is None:
            return None
        kept = _REWRITES.peek((signature, reads_key(reads)))
        if kept is None:
            return None
    return {**options, **kept.changed}, kept.signature, kept.documents


def remember(signature, before: dict, after: dict, rewritten_signature, documents=None) -> None:
    """Keep the rewrite of `before` into `after` (their signatures; documents: a document mask the rewrite
    left to run as THD) for the next call, where it may be kept."""
    if signature is None or (rewritten_signature is None and documents is None):
        return
    mask_mod = before["mask_mod"]
    reads = flat_reads(mask_mod)
    if reads is None:
        return
    changed = {name: value for name, value in after.items() if before.get(name, _ABSENT) is not value}
    if any(isinstance(value, torch.Tensor) for value in changed.values()):
        return
    plain = plain_reads(mask_mod, reads)
    rewrite = Rewrite(mask_mod, reads, changed, rewritten_signature, documents, plain)
    _REWRITES.put((signature, reads_key(reads)), rewrite)
    if plain:  # (the entry keeps mask_mod alive, so its id stays its own)
        _REWRITES.put((signature, id(mask_mod)), rewrite)
