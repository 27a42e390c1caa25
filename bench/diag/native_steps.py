"""Where the native operator's host time goes, step by step (FUSEDATTN_NATIVE_PROFILE=1 tables at exit).

Runs forward+backward calls at a shape whose GPU time is below the host's (B1 S128 H8 D64, causal,
bf16), so no launch waits for a full queue and the steps time the host alone:

    FUSEDATTN_NATIVE_PROFILE=1 taskset -c 5 python bench/diag/native_steps.py
"""

import torch

import fusedattn.torch as fat

q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
for _ in range(2000):
    torch.autograd.grad(fat.attention(q, k, v, mask="causal"), (q, k, v), grad)
torch.cuda.synchronize()
