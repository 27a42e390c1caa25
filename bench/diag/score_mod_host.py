"""Where a warm score_mod call's extra host time goes (B1 S128 H8 D64 causal bf16, no_grad): host us
per call of a plain call, a flex softcap and a flex ALiBi over a captured (H,) tensor, then cProfile
of the ALiBi calls (the functions that take the most own time), and the launch core's routes."""

from __future__ import annotations

import cProfile
import pstats

import torch
from native_smoke import per_call_us  # this folder: the same timing loop

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import core


def main() -> None:
    q = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16)
    slopes = torch.rand(8, device="cuda") / 8

    def softcap(score, b, h, q_idx, kv_idx):
        return 30 * sm.tanh(score / 30)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    calls = {"plain": lambda: fat.attention(q, q, q, mask="causal"),
             "softcap_flex": lambda: fat.attention(q, q, q, mask="causal", score_mod=softcap),
             "alibi_flex": lambda: fat.attention(q, q, q, mask="causal", score_mod=alibi)}
    with torch.no_grad():
        for call in calls.values():
            for _ in range(3):
                call()
        for _ in range(3):
            times = {name: per_call_us(call, n=300)[0] for name, call in calls.items()}
            print("  ".join(f"{name} {us:6.1f} us" for name, us in times.items()), flush=True)
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            calls["alibi_flex"]()
        profile.disable()
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("tottime").print_stats(18)
    print("routes", core.replay_counts())


if __name__ == "__main__":
    main()
