"""Which part of a derived softcap derivative costs backward time: cuDNN-native variants of
20 * tanh(s / 20) that differ in one thing each from the built-in, timed with it on the same
inputs (interleaved rounds of CUDA-event-timed forward+backward loops, median), B4 H16 bf16.

builtin          x = s / cap kept by the forward; bprop tanh_backward(dscore, x)
recompute        bprop recomputes x from the saved score (its own scalar of the same value)
scaled           builtin, then * 1.0 (a scalar) at the end of bprop
reciprocal       x = s * (1 / cap) in the forward, shared; bprop tanh_backward(dscore, x)
reciprocal_rec   x = s * (1 / cap); bprop recomputes it from the score, then * 1.0: the derived form
portable         the flex function traced by fusedattn (simplified)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from native_softcap import native_softcap  # noqa: E402 (the hand-written graph, once score_mods.softcap)

from fusedattn.score_mods.core import ScoreMod

sys.path.insert(0, str(Path(__file__).resolve().parent))
from softcap_forms import _time_ms  # noqa: E402  (CUDA-event loop timing)

CAP = 20.0


def eager(ops, s, b, h, qi, ki, t):
    return CAP * ops.module.tanh(s / CAP)


def variant(name, reciprocal: bool, shared: bool, scaled: bool) -> ScoreMod:
    def forward(graph, score, tensors):
        tensors["v.score"] = score
        x = graph.mul(a=score, b=tensors["inv"]) if reciprocal else graph.div(a=score, b=tensors["cap"])
        tensors["v.x"] = x
        return graph.mul(a=graph.tanh(input=x), b=tensors["cap"])

    def bprop(graph, dscore, tensors):
        if shared:
            x = tensors["v.x"]
        elif reciprocal:
            x = graph.mul(a=tensors["v.score"], b=tensors["inv2"])
        else:
            x = graph.div(a=tensors["v.score"], b=tensors["cap2"])
        out = graph.tanh_backward(loss=dscore, input=x)
        return graph.mul(a=out, b=tensors["one"]) if scaled else out

    values = {"cap": CAP, "cap2": CAP, "inv": 1 / CAP, "inv2": 1 / CAP, "one": 1.0}
    return ScoreMod(forward, bprop, values, masks=False, eager=eager, name=name)


def portable(score, b, h, q_idx, kv_idx):
    return CAP * sm.tanh(score / CAP)


def main() -> int:
    forms = {"builtin": native_softcap(CAP),
             "recompute": variant("recompute", reciprocal=False, shared=False, scaled=False),
             "scaled": variant("scaled", reciprocal=False, shared=True, scaled=True),
             "reciprocal": variant("reciprocal", reciprocal=True, shared=True, scaled=False),
             "reciprocal_rec": variant("reciprocal_rec", reciprocal=True, shared=False, scaled=True),
             "portable": portable}
    for s, d in ((4096, 64), (4096, 128), (16384, 128)):
        q, k, v = (torch.randn(4, s, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        repeats = 10 if s == 4096 else 2

        def call(mod, q=q, k=k, v=v, dout=dout):
            out = fat.attention(q, k, v, backend="cudnn", score_mod=mod)
            return torch.autograd.grad(out, (q, k, v), dout)

        want = call(forms["builtin"])
        for name, mod in forms.items():
            got = call(mod)
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
            assert diff < 0.05, (name, diff)
        times = {name: [] for name in forms}
        for _ in range(9):
            for name, mod in forms.items():
                times[name].append(_time_ms(lambda mod=mod: call(mod), repeats))
        base = statistics.median(times["builtin"])
        print(f"S{s} D{d} fwd+bwd: " + "  ".join(f"{n} {statistics.median(t) / base:.3f}x"
                                                  for n, t in times.items()) + f"  (builtin {base:.3f} ms)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
