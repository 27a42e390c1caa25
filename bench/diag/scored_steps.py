"""The native operator's host time by step (FUSEDATTN_NATIVE_PROFILE=1 tables at exit) for a padded, THD or
dense call, plain or with a score_mod (softcap as a closure, the softcap, alibi or relative-position built-in),
forward+backward at a shape whose GPU time is below the host's (B2 H8 D64, sequences of 100 and 128 tokens,
bf16), and the wall time per call of the loop:

    FUSEDATTN_NATIVE_PROFILE=1 python bench/diag/scored_steps.py thd softcap
    FUSEDATTN_NATIVE_PROFILE=1 python bench/diag/scored_steps.py dense relpos
"""

import sys
import time

import torch

import fusedattn
import fusedattn.torch as fat
from fusedattn import score_mods as sm

layout, mod = sys.argv[1], sys.argv[2]
lengths = [100, 128]
offsets = torch.tensor([0, 100, 228], dtype=torch.int32, device="cuda")
options = dict(cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=128, max_seqlen_kv=128,
               mask="padding_causal")
if layout == "thd":
    shape, options["layout"] = (228, 8, 64), "thd"
else:
    shape = (2, 128, 8, 64)
if layout == "dense":
    options = {}
mods = {"softcap": lambda s, b, h, q_idx, kv_idx: 30.0 * torch.tanh(s / 30.0), "builtin_softcap": sm.softcap(30.0),
        "alibi": sm.alibi(fusedattn.standard_alibi_slopes(8)),
        "relpos": sm.relative_position_bias(torch.randn(8, 257, device="cuda", dtype=torch.bfloat16))}
if mod in mods:
    options["score_mod"] = mods[mod]
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
