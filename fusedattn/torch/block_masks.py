"""What a FlexAttention BlockMask means, read as a mask: its block table checked against its mask_mod.

Compiled FlexAttention visits only the blocks a BlockMask lists: a "full" block whole, a
"partial" block where mask_mod holds, and no other block. A BlockMask from
create_block_mask(mask_mod) lists exactly the blocks where mask_mod holds somewhere, so the
table only skips work and mask_mod alone says what is seen; fusedattn then runs mask_mod (as
cuDNN's own masks where it can). A table made otherwise (BlockMask.from_kv_blocks, a sliced
or adjusted mask, a table built for another mask_mod) can mean something else: a full block
where mask_mod is False somewhere, or a block left out where it is True. Such a table is
applied too, so the result is what compiled FlexAttention computes, never the mask_mod alone:
a `(B, H, L, S)` gather cuDNN reads as a dense tensor (a warning, once per BlockMask, gives
its memory).

The check evaluates mask_mod over every (b, h, q_idx, kv_idx) once per BlockMask (one block
row of queries at a time), and is kept while the BlockMask lives.
"""

from __future__ import annotations

import warnings

import torch

from fusedattn.cache import LRUCache, kept_while_alive, register

__all__ = ["mask_of_block_mask", "table_issue"]

_CHECKED: LRUCache = register("torch.flex_attention.block_masks", LRUCache(32))


def _dense(counts: torch.Tensor, indices: torch.Tensor, kv_blocks: int) -> torch.Tensor:
    """(B, H, nq, kv_blocks) bool: block (i, j) listed in indices[..., i, :counts[..., i]]."""
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts.unsqueeze(-1)
    dense = torch.zeros((*indices.shape[:-1], kv_blocks + 1), dtype=torch.bool, device=indices.device)
    columns = torch.where(listed, indices.long(), kv_blocks)  # unlisted entries land in a spare column
    return dense.scatter_(-1, columns, True)[..., :kv_blocks]


def _tables(block_mask, batch: int, heads: int, kv_blocks: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(listed, full): (B, H, nq, nkv) bool tables on the call's device, broadcast to its batch and heads."""
    listed = _dense(block_mask.kv_num_blocks, block_mask.kv_indices, kv_blocks)
    full = torch.zeros_like(listed)
    if block_mask.full_kv_num_blocks is not None:
        full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_blocks)
    shape = (batch, heads, *listed.shape[2:])
    return (listed | full).to(device).expand(shape), full.to(device).expand(shape)


def _per_block(keep: torch.Tensor, pad: int, kv_blocks: int, block_kv: int, filler: bool) -> torch.Tensor:
    """(B, H, rows, S) -> (B, H, rows, nkv, block_kv), the last block filled out with `filler`."""
    padded = torch.nn.functional.pad(keep, (0, pad), value=filler)
    return padded.view(*keep.shape[:3], kv_blocks, block_kv)


def table_issue(block_mask, mask_mod, batch: int, heads: int, query_len: int, key_len: int,
                device=None) -> str | None:
    """None when the block table is the one mask_mod implies (it only skips work), else what differs.
    mask_mod runs on `device` (the query's; default the table's), beside the tensors it captures."""
    block_q, block_kv = block_mask.BLOCK_SIZE
    kv_blocks = -(-key_len // block_kv)
    device = block_mask.kv_num_blocks.device if device is None else device
    listed, full = _tables(block_mask, batch, heads, kv_blocks, device)
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    kv = torch.arange(key_len, device=device).view(1, 1, 1, -1)
    pad = kv_blocks * block_kv - key_len
    for row in range(listed.shape[2]):
        q = torch.arange(row * block_q, min((row + 1) * block_q, query_len), device=device).view(1, 1, -1, 1)
        if q.numel() == 0:
            break
        keep = torch.ones((), dtype=torch.bool, device=device) if mask_mod is None else mask_mod(b, h, q, kv)
        keep = torch.as_tensor(keep, device=device).to(torch.bool).expand(batch, heads, q.shape[2], key_len)
        somewhere = _per_block(keep, pad, kv_blocks, block_kv, False).any(dim=4).any(dim=2)
        everywhere = _per_block(keep, pad, kv_blocks, block_kv, True).all(dim=4).all(dim=2)
        if bool((somewhere & ~listed[:, :, row]).any()):
            return (f"query block {row} leaves out a key block where the mask_mod keeps keys (FlexAttention skips "
                    "it)")
        if bool((full[:, :, row] & ~everywhere).any()):
            return (f"query block {row} lists a key block as full where the mask_mod masks keys (FlexAttention "
                    "keeps them)")
    return None


def mask_of_block_mask(block_mask, mask_mod, batch: int, heads: int, query_len: int, key_len: int, device=None):
    """The mask_mod that gives what compiled FlexAttention computes with this BlockMask: mask_mod itself
    (None for no mask) when the table agrees with it, else one that applies the table as well.
    device: the query's (mask_mod and the applied table live there; default the table's)."""
    block_q = block_mask.BLOCK_SIZE[0]
    covered = block_mask.kv_num_blocks.shape[-1] * block_q
    if covered < query_len:  # (FlexAttention's eager form ignores the table; its compiled kernels read past it)
        raise ValueError(f"flex_attention: block_mask: its table covers {block_mask.kv_num_blocks.shape[-1]} query "
                         f"blocks of {block_q} ({covered} queries), the call has L={query_len}; make it for this "
                         f"length: create_block_mask(mask_mod, B, H, Q_LEN={query_len}, KV_LEN={key_len})")
    device = block_mask.kv_num_blocks.device if device is None else device
    key = (id(block_mask), id(mask_mod), batch, heads, query_len, key_len, str(device),
           *(getattr(t, "_version", None) for t in (block_mask.kv_num_blocks, block_mask.kv_indices)))

    def checked():
        issue = table_issue(block_mask, mask_mod, batch, heads, query_len, key_len, device)
        if issue is None:
            return mask_mod
        size = batch * heads * query_len * key_len * 4 / 2**20
        warnings.warn(f"flex_attention: block_mask: its block table says more than its mask_mod ({issue}); it is "
                      f"applied as a dense (B, H, L, S) = ({batch}, {heads}, {query_len}, {key_len}) mask, {size:.3g} "
                      "MiB per call", stacklevel=4)
        return _with_table(block_mask, mask_mod, batch, heads, key_len, device)

    return kept_while_alive(_CHECKED, key, block_mask, checked)


def _with_table(block_mask, mask_mod, batch: int, heads: int, key_len: int, device):
    block_q, block_kv = block_mask.BLOCK_SIZE
    listed, full = (t.contiguous() for t in _tables(block_mask, batch, heads, -(-key_len // block_kv), device))

    def block_table_mask(b, h, q_idx, kv_idx):  # full blocks whole, listed ones where mask_mod holds
        i, j = q_idx // block_q, kv_idx // block_kv
        if mask_mod is None:
            return listed[b, h, i, j]
        return full[b, h, i, j] | (listed[b, h, i, j] & mask_mod(b, h, q_idx, kv_idx))

    return block_table_mask
