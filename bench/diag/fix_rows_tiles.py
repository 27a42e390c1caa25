"""GPU time of the row fix-up kernel (sequence_kernels.fix_rows) by tile: rows per program and elements per
step, on the padded forward and backward of bench_jax's padding row (B4 H16 S1024 D128 bf16, lengths S and
3S/4 in turn) and the THD row. CUDA-graph timing (triton.testing.do_bench_cudagraph), so launch cost is out.

    python bench/diag/fix_rows_tiles.py [--tiles 16x1024,16x256,...]
"""

from __future__ import annotations

import argparse

import torch
import triton

from fusedattn.backends.cudnn import sequence_constants
from fusedattn.backends.cudnn.sequences import SequenceTable, config_layout
from fusedattn.config import AttentionConfig

B, S, H, D = 4, 1024, 16, 128


def _cases():
    lengths = [S if b % 2 == 0 else 3 * S // 4 for b in range(B)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    padded = AttentionConfig(dtype="bfloat16", layout="bshd", batch=B, seqlen_q=S, seqlen_kv=S, heads_q=H, heads_kv=H,
                             head_dim_qk=D, head_dim_v=D, mask="padding", is_training=True, device="cuda")
    thd_lengths = [S * B // 4 - 64 * i for i in range(4)]
    thd_cu = torch.tensor([0, *torch.tensor(thd_lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    thd = padded.replace(layout="thd", batch=4, seqlen_q=max(thd_lengths), seqlen_kv=max(thd_lengths))
    yield "padding", padded, cu, (B, S, H, D), None
    yield "thd", thd, thd_cu, (B * S, H, D), B * S


def _time(cfg, cu, shape, tokens):
    layout = config_layout(cfg)
    table = SequenceTable.build(layout, cu, cu, None, None, None if tokens is None else (tokens, tokens))
    out = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    grads = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(3)]
    if tokens is None:
        lse = torch.randn(B, H, S, device="cuda").permute(0, 2, 1)  # (B, S, H) view of (B, H, S)
    else:
        lse = torch.randn(tokens, H, device="cuda")
    seqlen = cfg.seqlen_q
    forward = lambda: table.fix_rows("q", out, seqlen=seqlen, lse=lse, stats=lse)  # noqa: E731
    backward_q = lambda: table.fix_rows("q", grads[0], seqlen=seqlen)  # noqa: E731
    backward_kv = lambda: table.fix_rows("kv", grads[1], grads[2], seqlen=seqlen)  # noqa: E731
    return {name: triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
            for name, fn in (("forward", forward), ("backward_q", backward_q), ("backward_kv", backward_kv))}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiles", default="16x1024,16x512,16x256,16x128,8x256,4x256,32x128,64x64")
    args = parser.parse_args()
    print(f"fix_rows GPU time (us) on {torch.cuda.get_device_name()}; tile = rows per program x elements per step")
    for name, cfg, cu, shape, tokens in _cases():
        for tile in args.tiles.split(","):
            rows, elements = map(int, tile.split("x"))
            sequence_constants.ROWS_PER_PROGRAM, sequence_constants._ELEMENTS_PER_STEP = rows, elements
            times = _time(cfg, cu, shape, tokens)
            print(f"{name:8s} {tile:>8s}  " + "  ".join(f"{k} {v:6.2f}" for k, v in times.items()), flush=True)


if __name__ == "__main__":
    main()
