"""Where the Python part of a warm forward call goes on this host: cProfile of repeat public calls
(B1 S128 H8 D64 causal bf16, no_grad), beside the operator alone and the prologue's pieces."""

import cProfile
import pstats

import torch
from native_smoke import per_call_us  # this folder: the same timing loop

import fusedattn.torch as fat
from fusedattn.selection import recall_call
from fusedattn.torch import functional


def main():
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    options = ("bshd", "causal", None, None, "vanilla", 0.0, None, None, None, False, False, False, None)
    tensors = (q, k, v, None, None, None, None, None, None, None)
    with torch.no_grad():
        fat.attention(q, k, v, mask="causal")
        signature = functional._signature(tensors, options, offsets=(), score_mod=None)
        planned = recall_call(signature)
        print("planned:", None if planned is None else (planned[1].name, planned[2]), flush=True)
        plan = planned[2]
        op = torch.ops.fusedattn_native.attention.default
        rows = {"public": lambda: fat.attention(q, k, v, mask="causal"),
                "operator": lambda: op(plan, q, k, v, None, None, None),
                "_native_call": lambda: functional._native_call(plan, signature, planned, q, k, v, None, None, 0),
                "_signature": lambda: functional._signature(tensors, options, offsets=(), score_mod=None),
                "recall_call": lambda: recall_call(signature)}
        for name, fn in rows.items():
            print(f"{name:>14}: {per_call_us(fn, n=3000)[0]:6.2f} us/call (host)", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3000):
            fat.attention(q, k, v, mask="causal")
        profiler.disable()
        torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
