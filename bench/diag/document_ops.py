"""The CPU-side ops (torch profiler) of 20 document mask_mod forward+backward calls against the same THD call
made directly and a plain dense call (B4 H16 S1024 D128 bf16, 4 documents a row): what a document call spends
on the host that the others do not (bench/results/document-host-dense-thd.txt).

    python bench/diag/document_ops.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fusedattn.torch as fat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from bench_score_mod import document_lengths, flex_document, segment_ids  # noqa: E402

B, H, S, D = 4, 16, 1024, 128
CALLS = 20


def main() -> None:
    device = torch.device("cuda")
    lengths = document_lengths(S)
    mask_mod = flex_document(segment_ids(lengths, device))
    flat = [n for row in lengths for n in row]
    offsets = torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()], dtype=torch.int32, device=device)
    thd = {"layout": "thd", "cu_seqlens_q": offsets, "cu_seqlens_kv": offsets, "max_seqlen_q": max(flat),
           "max_seqlen_kv": max(flat)}
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    tokens = [x.detach().reshape(B * S, H, D).requires_grad_() for x in (q, k, v)]

    def document():
        torch.autograd.grad(fat.attention(q, k, v, mask_mod=mask_mod), (q, k, v), dout)

    def direct():
        torch.autograd.grad(fat.attention(*tokens, **thd), tokens, dout.reshape(B * S, H, D))

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    def plain():
        torch.autograd.grad(fat.attention(q, k, v), (q, k, v), dout)

    for name, call in (("document mask_mod", document), ("THD direct", direct), ("plain", plain)):
        for _ in range(30):
            call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(CALLS):
                call()
            torch.cuda.synchronize()
        print(f"===== {name}: {CALLS} calls")
        print(profile.key_averages().table(sort_by="cpu_time_total", row_limit=28, max_name_column_width=60))


if __name__ == "__main__":
    main()
