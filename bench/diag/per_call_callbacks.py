"""Host time of warm calls whose callbacks are made anew at each call, as a model's forward writes them:
a flex softcap closure, a bound method and a built-in ScoreMod, against the same callbacks made once
(B4 H16 S1024 D128 bf16, no grad; wall time per call of back-to-back calls, GPU not held)."""

import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its timing loop
from profile_overhead import per_call_us  # noqa: E402  (wall time per call, synchronized after)


class Capped:
    cap = 20.0

    def softcap(self, score, b, h, q_idx, kv_idx):
        return self.cap * sm.tanh(score / self.cap)


def closure(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)
    return softcap


q = torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
made_once, module = closure(20.0), Capped()
builtin = sm.softcap(20.0)
rows = {"plain": lambda: fat.attention(q, q, q),
        "closure made once": lambda: fat.attention(q, q, q, score_mod=made_once),
        "closure made each call": lambda: fat.attention(q, q, q, score_mod=closure(20.0)),
        "bound method": lambda: fat.attention(q, q, q, score_mod=module.softcap),
        "built-in made once": lambda: fat.attention(q, q, q, score_mod=builtin),
        "built-in made each call": lambda: fat.attention(q, q, q, score_mod=sm.softcap(20.0))}
with torch.no_grad():
    for name, fn in rows.items():
        print(f"{name:>24}: {per_call_us(fn):8.1f} us/call", flush=True)
