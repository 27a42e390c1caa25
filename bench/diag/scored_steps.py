"""The native operator's host time by step (FUSEDATTN_NATIVE_PROFILE=1 tables at exit) for a padded or THD
call, plain or with a softcap score_mod, forward+backward at a shape whose GPU time is below the host's
(B2 H8 D64, sequences of 100 and 128 tokens, bf16), and the wall time per call of the loop:

    FUSEDATTN_NATIVE_PROFILE=1 python bench/diag/scored_steps.py thd softcap
"""

import sys
import time

import torch

import fusedattn.torch as fat

layout, mod = sys.argv[1], sys.argv[2]
lengths = [100, 128]
offsets = torch.tensor([0, 100, 228], dtype=torch.int32, device="cuda")
options = dict(cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=128, max_seqlen_kv=128,
               mask="padding_causal")
if layout == "thd":
    shape, options["layout"] = (228, 8, 64), "thd"
else:
    shape = (2, 128, 8, 64)
if mod == "softcap":
    options["score_mod"] = lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 30.0)
q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
for _ in range(200):
    torch.autograd.grad(fat.attention(q, k, v, **options), (q, k, v), grad)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(2000):
    torch.autograd.grad(fat.attention(q, k, v, **options), (q, k, v), grad)
torch.cuda.synchronize()
print(f"{layout} {mod}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us per forward+backward", flush=True)
