"""GPU time per kernel of one warm forward (B4 H16 S1024 D128 bf16, inputs requiring grad): a plain call
and the built-in causal() score_mod, whose rows may be emptied (the empty-rows kernel runs after cuDNN's)."""

import torch
from torch.profiler import ProfilerActivity, profile

import fusedattn.torch as fat
from fusedattn import score_mods as sm

q, k, v = (torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for name, options in (("plain", {}), ("causal_builtin", {"score_mod": sm.causal()})):
    for _ in range(5):
        fat.attention(q, k, v, **options)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fat.attention(q, k, v, **options)
        torch.cuda.synchronize()
    for event in prof.key_averages():
        if event.device_time_total > 0:
            us = event.device_time_total / event.count
            print(f"{name:>15}: {us:8.1f} us x{event.count / 20:.0f}  {event.key[:90]}")
