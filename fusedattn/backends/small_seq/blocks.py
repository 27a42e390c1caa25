"""Which small_seq kernel runs a config, with which tiles and warps (no Triton import: CPU-testable).

Two kernel forms (kernels.py): "reduce" (dot products as multiply-and-sum over the loaded
tiles, one query head at a time) and "dot" (the GROUP query heads of a KV head as the rows
of tensor-core products, padded to 16). Measured on an H200 at B=30720, H=16, bf16 (percent
of the measured copy bandwidth, forward/backward): few warps win, because each program's
work is small and more warps only add cross-warp reductions.

    MHA Skv=16 D=128   reduce/2 warps 77/81   dot/1 82/68   reduce/4 31/55
    MHA Skv=16 D=512   reduce/2 99/85         dot/2 76/74
    MHA Skv=4  D=128   reduce/1 55/60         dot/1 30/26
    MHA Skv=64 D=128   reduce/2 86/82         dot/2 91/80
    GQA 16:4 Skv=16    reduce/1 32/37         dot/2 61/55
    MQA 16:1 Skv=16    reduce/1 20/16         dot/2 44/44
"""

from __future__ import annotations

from typing import NamedTuple


def next_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


class Plan(NamedTuple):
    kernel: str  # "reduce" or "dot"
    num_warps: int
    meta: dict  # BLOCK_* meta-parameters


def plan(group: int, seqlen_kv: int, head_dim: int, backward: bool) -> Plan:
    """The kernel form and tiles for GROUP query heads per KV head, Skv keys, head dim D."""
    block_n = max(2, next_power_of_two(seqlen_kv))
    block_d = max(16, next_power_of_two(head_dim))
    if group > 1 or (not backward and 8 <= block_n and block_d < 512):
        warps = 2 if group > 1 or block_n >= 64 else 1
        meta = {"BLOCK_G": max(16, next_power_of_two(group)), "BLOCK_N": max(16, block_n), "BLOCK_D": block_d}
        return Plan("dot", warps, meta)
    return Plan("reduce", 1 if block_n <= 4 else 2, {"BLOCK_N": block_n, "BLOCK_D": block_d})


def sees_first_key_only(cfg) -> bool:
    """Top-left causal: each sequence's one query (position 0) sees key 0 and no other."""
    return not cfg.diagonal_bottom_right and cfg.window[1] == 0


def sequence_tables(cfg, cu_seqlens, arange, as_index) -> tuple:
    """(starts_q, lens_q, starts_kv, lens_kv) of the kernels, (B,) in token units, for torch tensors
    or JAX arrays alike.

    cu_seqlens: {"q", "kv", "q_padded", "kv_padded"} (None where absent); arange(n): 0..n-1 as
    indices; as_index(x): x in the index dtype. THD starts are the padded offsets where given; a
    padded layout's sequence b starts at query row b and key row b * Skv.
    """
    def lengths(side):
        cu = cu_seqlens[side]
        return as_index(cu[1:] - cu[:-1])

    if cfg.layout.is_ragged:
        starts = {side: cu_seqlens[f"{side}_padded"] if cu_seqlens[f"{side}_padded"] is not None
                  else cu_seqlens[side] for side in ("q", "kv")}
        starts_q, starts_kv = as_index(starts["q"][:-1]), as_index(starts["kv"][:-1])
        lens_q, lens_kv = lengths("q"), lengths("kv")
    else:
        rows = arange(cfg.batch)
        starts_q, starts_kv = rows, rows * cfg.seqlen_kv
        if cfg.mask.is_padding:
            lens_q, lens_kv = lengths("q"), lengths("kv")
        else:
            lens_q, lens_kv = rows * 0 + 1, rows * 0 + cfg.seqlen_kv
    if sees_first_key_only(cfg):
        lens_kv = lens_kv.clip(max=1)
    return starts_q, lens_q, starts_kv, lens_kv
