"""A document mask_mod (doc[b, q_idx] == doc[b, kv_idx]) run as THD: each document its own sequence.

Dense, a document mask computes every tile of every row; as THD the kernels see only each
document's own tiles. That is exact only when every document is one run of tokens within its
row, so the ids are checked on the device (non-decreasing along each row) together with where
the documents start: one host read per new ids tensor (cached while the tensor is unchanged,
so the layers of one step read it once). Ids that are not sorted run as a select in the graph.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from fusedattn.cache import LRUCache, register
from fusedattn.layout import from_bhsd, to_bhsd

__all__ = ["boundaries", "to_tokens", "from_tokens", "lse_from_tokens"]

# (id, version, address, shape, B, S) -> (weakref to ids, result)
_SEEN: LRUCache = register("torch.documents.boundaries", LRUCache(8))


def _read(ids: torch.Tensor, batch: int, seqlen: int):
    rows = ids.expand(batch, seqlen) if ids.ndim == 1 else ids
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    sorted_ = (rows[:, 1:] >= rows[:, :-1]).all().reshape(1)
    host = torch.cat([starts.reshape(-1), sorted_]).cpu().numpy()  # the one read
    if not host[-1]:
        return None
    first = np.flatnonzero(host[:-1])
    offsets = np.append(first, batch * seqlen).astype(np.int32)
    longest = int(np.diff(offsets).max())
    return torch.from_numpy(offsets).to(ids.device, non_blocking=True), longest


def boundaries(ids: torch.Tensor, batch: int, seqlen: int):
    """(cu_seqlens (D+1,) int32 on ids' device, longest document) over the B*S tokens, or None when
    some row's ids are not sorted."""
    key = (id(ids), ids._version, ids.data_ptr(), tuple(ids.shape), batch, seqlen)
    hit = _SEEN.get(key)
    if hit is not None and hit[0]() is ids:  # the same tensor, not a new one at a freed address
        return hit[1]
    result = _read(ids, batch, seqlen)
    _SEEN.put(key, (weakref.ref(ids), result))
    return result


def to_tokens(x: torch.Tensor, layout: str) -> torch.Tensor:
    """(B*S, H, D) tokens, batch-major, from a dense layout. BSHD (the default) is one view: every op
    here is also a node of the backward, and at S=1024 four of them per tensor cost the host more than
    the kernels take (measured on an H100, bench/diag/document_host.py)."""
    if layout == "bshd":
        return x.flatten(0, 1)
    x = to_bhsd(x, layout).transpose(1, 2)
    return x.reshape(-1, x.shape[2], x.shape[3])


def from_tokens(x: torch.Tensor, layout: str, batch: int) -> torch.Tensor:
    if layout == "bshd":
        return x.unflatten(0, (batch, -1))
    return from_bhsd(x.reshape(batch, -1, x.shape[1], x.shape[2]).transpose(1, 2), layout)


def lse_from_tokens(lse: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """(T, Hq) to the dense layouts' (B, Hq, S)."""
    return None if lse is None else lse.reshape(batch, -1, lse.shape[1]).permute(0, 2, 1)
