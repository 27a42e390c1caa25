"""GPU time of one softcap written three ways, on the same inputs in one process: the built-in
(hand-written cuDNN graph and derivative), the portable flex function 20 * tanh(s / 20) as
traced and simplified (score_mods.simplify), and the same function lowered as traced (its
derivative reading the forward's values, but no rewrites). Forward (no grad) and forward+backward
(torch.autograd.grad of q, k, v). Interleaved rounds of CUDA-event-timed loops, median per form.

    python bench/diag/softcap_forms.py [--seqlens 4096,16384] [--head-dims 64,128] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from native_softcap import native_softcap  # noqa: E402 (the hand-written graph, once score_mods.softcap)

from fusedattn.score_mods import flex

CAP = 20.0


def portable(score, b, h, q_idx, kv_idx):
    return CAP * sm.tanh(score / CAP)


def as_traced(score, b, h, q_idx, kv_idx):  # another code object: its own trace and graph
    return CAP * sm.tanh(score / CAP)


def _trace_unsimplified():
    """Trace as_traced with the simplification off; the trace cache then keeps that form."""
    kept = flex.simplified, flex.simplified_with_map
    flex.simplified = lambda expr, forward=None: expr
    flex.simplified_with_map = lambda expr, forward=None: (expr, {n: n for n in range(len(expr.nodes))})
    try:
        flex.trace("torch", as_traced, None, torch.device("cuda"))
    finally:
        flex.simplified, flex.simplified_with_map = kept


def _time_ms(fn, repeats: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", default="4096,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="JSON of the rows")
    args = parser.parse_args(argv)
    _trace_unsimplified()
    forms = {"builtin": native_softcap(CAP), "portable": portable, "portable_as_traced": as_traced}
    rows = []
    for s in map(int, args.seqlens.split(",")):
        for d in map(int, args.head_dims.split(",")):
            q, k, v = (torch.randn(4, s, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            dout = torch.randn_like(q)
            flops = 4 * 4 * 16 * s * s * d
            repeats = max(2, int(2e12 / flops))
            for mode in ("fwd", "fwd+bwd"):
                def call(mod, mode=mode, q=q, k=k, v=v, dout=dout):
                    if mode == "fwd":
                        with torch.no_grad():
                            return fat.attention(q, k, v, backend="cudnn", score_mod=mod)
                    out = fat.attention(q, k, v, backend="cudnn", score_mod=mod)
                    return torch.autograd.grad(out, (q, k, v), dout)

                outs = {name: call(mod) for name, mod in forms.items()}  # build, and check they agree
                first = outs["builtin"]
                first = first if isinstance(first, tuple) else (first,)
                diffs = {name: max(float((a.float() - b.float()).abs().max())
                                   for a, b in zip(first, out if isinstance(out, tuple) else (out,)))
                         for name, out in outs.items()}
                times: dict = {name: [] for name in forms}
                for _ in range(args.rounds):
                    for name, mod in forms.items():
                        times[name].append(_time_ms(lambda mod=mod: call(mod), repeats))
                median = {name: statistics.median(t) for name, t in times.items()}
                work = flops * (1 if mode == "fwd" else 3.5)
                row = {"workload": f"softcap-b4-h16-s{s}-d{d}", "mode": mode, "repeats": repeats,
                       "ms": median, "tflops": {n: work / (m * 1e9) for n, m in median.items()},
                       "vs_builtin": {n: m / median["builtin"] for n, m in median.items()},
                       "max_abs_diff_vs_builtin": diffs}
                rows.append(row)
                print(f"{row['workload']} {mode:>7}: " + "  ".join(
                    f"{n} {m:.3f} ms ({row['tflops'][n]:.0f} TF/s, {row['vs_builtin'][n]:.3f}x, "
                    f"diff {diffs[n]:.3g})" for n, m in median.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
