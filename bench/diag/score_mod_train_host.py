"""Where a score_mod training call's extra host time goes: forward+backward (torch.autograd.grad) of a
plain causal call and of softcap (flex and built-in), a flex ALiBi over a captured (H,) tensor and a
(1, H, S, S) bias, and softcap made anew each call (score_mods.softcap(30.0) inside the step), at
B1 S128 H8 D64 and B8 S1024 H12 D64, bf16. Per variant: host us per call with the
GPU held (profile_overhead's loop), the launch core's routes over the loop, and from torch.profiler the
CUDA runtime calls per step and the operators with the most host time of their own."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import core

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its timing loop
from common import held_loop, spin_cycles_per_us  # noqa: E402

CALLS = 50


def variants(h: int, s: int, device) -> dict:
    slopes = torch.rand(h, device=device) / 8
    bias = torch.randn(1, h, s, s, device=device, dtype=torch.bfloat16)

    def softcap(score, b, hh, q_idx, kv_idx):
        return 30 * sm.tanh(score / 30)

    def alibi(score, b, hh, q_idx, kv_idx):
        return score + slopes[hh] * (kv_idx - q_idx)

    return {"plain": {}, "softcap_flex": {"score_mod": softcap}, "softcap_builtin": {"score_mod": sm.softcap(30.0)},
            "alibi_flex": {"score_mod": alibi}, "bias": {"bias": bias}, "softcap_builtin_made_per_call": None}


def profile_step(step) -> tuple[dict, list]:
    """CUDA runtime calls per step, and the top operators by self CPU time, over 5 steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    runtime, ops = {}, []
    for event in prof.key_averages():
        if event.key.startswith("cuda") or event.key.startswith("cu"):
            runtime[event.key] = event.count / 5
        elif event.self_cpu_time_total > 0:
            ops.append((event.self_cpu_time_total / 5, event.count / 5, event.key))
    return runtime, sorted(ops, reverse=True)[:12]


def main() -> None:
    cycles = spin_cycles_per_us()
    for b, h, s, d in ((1, 8, 128, 64), (8, 12, 1024, 64)):
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn_like(q)
        plain_host = None
        for name, options in variants(h, s, q.device).items():
            def step(options=options, q=q, k=k, v=v, grad=grad):
                given = {"score_mod": sm.softcap(30.0)} if options is None else options
                return torch.autograd.grad(fat.attention(q, k, v, mask="causal", **given), (q, k, v), grad)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            before = core.replay_counts()
            hosts = []
            for _ in range(7):
                host, _, held = held_loop(step, CALLS, int(cycles * 60_000))
                hosts.append(host)
            host = sorted(hosts)[3]
            after = core.replay_counts()
            routes = {key: (after[key] - before[key]) / (7 * CALLS) for key in after}
            plain_host = host if plain_host is None else plain_host
            print(f"B{b} S{s} {name:>16}: host {host:7.1f} us/step (+{host - plain_host:6.1f}), held {held}, "
                  f"routes per step {routes}", flush=True)
            runtime, ops = profile_step(step)
            print("    runtime calls/step:", {key: round(n, 1) for key, n in sorted(runtime.items())})
            for self_us, count, key in ops:
                print(f"    {self_us:8.1f} us  x{count:4.1f}  {key}")


if __name__ == "__main__":
    main()
