"""A document mask_mod (doc[b, q_idx] == doc[b, kv_idx]) run as THD from JAX: each document its own
sequence, as the torch frontend does (frontend_common.call_as_thd).

The ids must be concrete: a captured array, read on the host when the call is traced (under
jit, once per trace; the offsets become constants of the program). Traced ids (an argument
of the jitted function), or ids that are not sorted along each row, keep the mask as a select
in the graph: correct, but every tile is computed. Offsets are kept on the host per ids array
while it lives, so eager calls read the ids once; each call gets them as a concrete array (a
cached JAX array made inside one jit trace would leak that trace's tracer into the next).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.cache import LRUCache, kept_while_alive, register
from fusedattn.layout import document_offsets

__all__ = ["boundaries"]

_SEEN: LRUCache = register("jax.documents.boundaries", LRUCache(8))  # (id, B, S) -> (weakref, result)


def _read(ids, batch: int, seqlen: int):
    rows = np.broadcast_to(np.asarray(ids), (batch, seqlen))
    if (rows[:, 1:] < rows[:, :-1]).any():
        return None
    starts = np.ones(rows.shape, dtype=bool)
    starts[:, 1:] = rows[:, 1:] != rows[:, :-1]
    return document_offsets(starts.reshape(-1))


def boundaries(ids, batch: int, seqlen: int):
    """(cu_seqlens (D+1,) int32, longest document) over the B*S tokens, or None when the ids are traced
    or some row's ids are not sorted."""
    if isinstance(ids, jax.core.Tracer):
        return None
    found = kept_while_alive(_SEEN, (id(ids), batch, seqlen), ids, lambda: _read(ids, batch, seqlen))
    if found is None:
        return None
    with jax.ensure_compile_time_eval():  # a concrete array even inside a jit trace: its values are read
        return jnp.asarray(found[0]), found[1]
