"""A document mask_mod (doc[b, q_idx] == doc[b, kv_idx]) run as THD: each document its own sequence.

Dense, a document mask computes every tile of every row; as THD (frontend_common.call_as_thd)
the kernels see only each document's own tiles. That is exact only when every document is one
run of tokens within its row, so the ids are checked on the device (non-decreasing along each
row) together with where the documents start: one host read per new ids tensor (cached while
the tensor is unchanged, so the layers of one step read it once). Ids that are not sorted run
as a select in the graph.
"""

from __future__ import annotations

import torch

from fusedattn.cache import LRUCache, kept_while_alive, register
from fusedattn.layout import document_offsets

__all__ = ["boundaries"]

# (id, version, address, shape, B, S) -> (weakref to ids, result): cache.kept_while_alive
_SEEN: LRUCache = register("torch.documents.boundaries", LRUCache(8))


def _read(ids: torch.Tensor, batch: int, seqlen: int):
    rows = ids.expand(batch, seqlen) if ids.ndim == 1 else ids
    starts = torch.ones_like(rows, dtype=torch.bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    sorted_ = (rows[:, 1:] >= rows[:, :-1]).all().reshape(1)
    host = torch.cat([starts.reshape(-1), sorted_]).cpu().numpy()  # the one read
    if not host[-1]:
        return None
    offsets, longest = document_offsets(host[:-1])
    return torch.from_numpy(offsets).to(ids.device, non_blocking=True), longest


def boundaries(ids: torch.Tensor, batch: int, seqlen: int):
    """(cu_seqlens (D+1,) int32 on ids' device, longest document) over the B*S tokens, or None when
    some row's ids are not sorted."""
    key = (id(ids), ids._version, ids.data_ptr(), tuple(ids.shape), batch, seqlen)
    return kept_while_alive(_SEEN, key, ids, lambda: _read(ids, batch, seqlen))
