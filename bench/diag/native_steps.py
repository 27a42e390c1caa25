"""Where the native operator's host time goes, step by step (FUSEDATTN_NATIVE_PROFILE=1 tables at exit).

Runs forward+backward calls at a shape whose GPU time is below the host's (B1 S128 H8 D64, causal,
bf16), so no launch waits for a full queue and the steps time the host alone; `documents` runs a
document mask_mod (4 documents, run as THD) instead, and prints the host's time per step of both:

    FUSEDATTN_NATIVE_PROFILE=1 taskset -c 5 python bench/diag/native_steps.py [documents]
"""

import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from common import plain_loop  # noqa: E402

q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
ids = torch.repeat_interleave(torch.arange(4, device="cuda"), torch.tensor([50, 30, 40, 8], device="cuda"))[None]


def same_document(b, h, q_idx, kv_idx):
    return ids[b, q_idx] == ids[b, kv_idx]


options = {"mask_mod": same_document} if sys.argv[1:] == ["documents"] else {"mask": "causal"}


def step():
    torch.autograd.grad(fat.attention(q, k, v, **options), (q, k, v), grad)


for _ in range(2000):
    step()
torch.cuda.synchronize()
loops = [plain_loop(step, 50, torch.device("cuda"))[0] for _ in range(21)]
print(f"{sys.argv[1:] or ['plain']}: host {statistics.median(loops):.1f} us per forward+backward step", flush=True)
