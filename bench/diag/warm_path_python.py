"""The Python of warm calls alone, with the native operator stubbed (any host, CPU tensors): a plain
call, score_mods and compositions made once and made anew at each call, and a causal mask_mod, B1 S16 H2 D8, median
of 7 loops of 500 calls. Run it on two hosts to compare their Python speed (bench/diag/score_mod_split.py
gives the GPU host's whole host time)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.torch import functional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from common import plain_loop  # noqa: E402


def stub_operator() -> None:
    """Every call has native plan 7 and the operator returns its inputs' views: only Python runs."""
    functional._native_plan_on = lambda cfg, name, device: 7
    functional._operator = lambda plan, q, k, v, sink, seed, offset, *extra: (q, q[..., 0])


def closure(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)
    return softcap


def rows(q: torch.Tensor) -> dict:
    slopes = torch.rand(q.shape[2])
    once, builtin = closure(20.0), sm.softcap(20.0)
    composed = sm.compose(sm.alibi(slopes), sm.softcap(20.0))

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    return {"plain": lambda: fat.attention(q, q, q, mask="causal"),
            "closure made once": lambda: fat.attention(q, q, q, mask="causal", score_mod=once),
            "alibi closure": lambda: fat.attention(q, q, q, mask="causal", score_mod=alibi),
            "closure made each call": lambda: fat.attention(q, q, q, mask="causal", score_mod=closure(20.0)),
            "built-in made once": lambda: fat.attention(q, q, q, mask="causal", score_mod=builtin),
            "built-in made each call": lambda: fat.attention(q, q, q, mask="causal", score_mod=sm.softcap(20.0)),
            "causal() made each call": lambda: fat.attention(q, q, q, score_mod=sm.causal()),
            "compose made once": lambda: fat.attention(q, q, q, mask="causal", score_mod=composed),
            "compose made each call": lambda: fat.attention(q, q, q, mask="causal",
                                                            score_mod=sm.compose(sm.alibi(slopes), sm.softcap(20.0))),
            "causal mask_mod": lambda: fat.attention(q, q, q, mask_mod=causal)}


def main() -> None:
    stub_operator()
    calls = rows(torch.randn(1, 16, 2, 8))
    with torch.no_grad():
        for name in sys.argv[1:] or calls:
            fn = calls[name]
            for _ in range(200):
                fn()
            loops = [plain_loop(fn, 500, torch.device("cpu"))[0] for _ in range(7)]
            print(f"{name:>24}: {statistics.median(loops):6.1f} us/call", flush=True)


if __name__ == "__main__":
    main()
