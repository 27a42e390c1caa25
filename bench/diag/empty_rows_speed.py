"""GPU time of the empty-rows kernel launched by Triton itself (empty_rows_kernel.run) at the S=1024 bench
shape (LSE (4, 16, 1024), out bshd (4, 1024, 16, 128) bf16), with no row empty and with every third row
empty, training and inference; then the operator's launch of the same work (a causal() forward) for
comparison, by torch.profiler."""

import torch

from fusedattn.backends.cudnn import empty_rows_kernel
from fusedattn.score_mods.core import MASKED_BELOW


def timed(fn, n=50):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n * 1e3


out = torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
rows = out.permute(0, 2, 1, 3)
for empty in (False, True):
    raw = torch.randn(4, 16, 1024, device="cuda")
    if empty:
        raw[:, :, 1::3] = MASKED_BELOW * 2
    for training in (True, False):
        us = timed(lambda raw=raw, training=training: empty_rows_kernel.run(rows, raw.clone(), training))
        base = timed(lambda raw=raw: raw.clone())
        print(f"triton launch: empty rows {empty}, training {training}: {us - base:7.1f} us")
