"""Where a warm score_mod call's extra host time goes, split into Python and the operator: at
bench_score_mod's S=1024 shape (B4 H16 D128 bf16, inputs requiring grad, not causal), the public call,
the native operator called directly with the arguments the public call passed it (its Python entry),
and the forward+backward (torch.autograd.grad of q, k, v) of both, for a plain call, softcap (built-in
and flex, made once and made anew at each call), a flex ALiBi, a causal mask_mod and the built-in
causal() score_mod, and added terms that learn (ALiBi slopes, a relative-position table; the
table's also with every binding dropped before each call: the full path; SPLIT_ONLY=a,b keeps those and
plain; SPLIT_PROFILE=a,b: the calls cProfile shows). Host us per
call with the GPU held, interleaved rounds, in one process (SPLIT_GC=0: with Python's garbage collector
off while timing); then cProfile of two public calls' Python."""

from __future__ import annotations

import cProfile
import gc
import os
import pstats
import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import torch_plans
from fusedattn.torch import functional, score_mod_bindings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its timing loops
from common import held_loop, spin_cycles_per_us  # noqa: E402

CALLS, ROUNDS = 30, 15


def main() -> None:
    q, k, v = (torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    slopes = torch.rand(16, device="cuda") / 8
    grad = torch.randn_like(q)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20 * sm.tanh(score / 20)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def closure(cap):
        return lambda score, b, h, q_idx, kv_idx: cap * sm.tanh(score / cap)

    # added terms that learn: they run as a post-scale bias, gathered anew at each call
    table = (torch.randn(16, 2047, device="cuda") / 4).requires_grad_(True)
    learning_slopes = slopes.clone().requires_grad_(True)

    def relpos_learning(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 1023]

    def alibi_learning(score, b, h, q_idx, kv_idx):
        return score + learning_slopes[h] * (kv_idx - q_idx)

    def full_path(options):  # every binding dropped first: the call goes the whole way, as before 2026-11-27
        score_mod_bindings.forget()
        return options

    # a callable: the call's options made anew at each call, as a model's forward writes them
    variants = {"plain": {}, "softcap_builtin": {"score_mod": sm.softcap(20.0)}, "softcap_flex": {"score_mod": softcap},
                "alibi_flex": {"score_mod": alibi}, "causal_mask_mod": {"mask_mod": causal},
                "causal_builtin": {"score_mod": sm.causal()}, "plain_causal": {"mask": "causal"},
                "softcap_builtin_each_call": lambda: {"score_mod": sm.softcap(20.0)},
                "softcap_closure_each_call": lambda: {"score_mod": closure(20.0)},
                "alibi_learning": {"score_mod": alibi_learning}, "relpos_learning": {"score_mod": relpos_learning},
                "relpos_learning_full_path": lambda: full_path({"score_mod": relpos_learning})}
    only = os.environ.get("SPLIT_ONLY")  # comma-separated variant names (plain always kept)
    if only:
        variants = {name: options for name, options in variants.items() if name == "plain" or name in only.split(",")}
    passed = {}
    original = functional._operator

    def recording(*args):
        passed["last"] = args
        return original(*args)

    calls = {}
    functional._operator = recording
    for name, options in variants.items():
        public = (lambda options=options: fat.attention(q, k, v, **(options() if callable(options) else options)))
        for _ in range(3):
            public()
        args = passed.pop("last", None)
        calls[name] = public
        calls[name + " fwd+bwd"] = (lambda public=public: torch.autograd.grad(public(), (q, k, v), grad))
        if args is not None:
            calls[name + " (operator)"] = (lambda args=args: torch_plans.entry(*args))
            calls[name + " (operator) fwd+bwd"] = (
                lambda args=args: torch.autograd.grad(torch_plans.entry(*args)[0], (q, k, v), grad))
        else:
            print(f"{name}: did not reach the native operator", flush=True)
    functional._operator = original
    torch.cuda.synchronize()
    cycles = spin_cycles_per_us()
    if os.environ.get("SPLIT_GC") == "0":  # whether Python's collector explains the forward+backward extras
        gc.collect()
        gc.disable()
        print("garbage collection off while timing", flush=True)
    samples = {name: [] for name in calls}
    names = list(calls)
    for index in range(ROUNDS):
        for name in names if index % 2 == 0 else names[::-1]:
            host, _, held = held_loop(calls[name], CALLS, int(cycles * 60_000))
            if held:
                samples[name].append(host)
    gc.enable()
    suffixes = (" (operator) fwd+bwd", " (operator)", " fwd+bwd")
    bases = {suffix: statistics.median(samples["plain" + suffix]) for suffix in ("", *suffixes)}
    for name in names:
        us = statistics.median(samples[name])
        extra = us - bases[next((s for s in suffixes if name.endswith(s)), "")]
        print(f"{name:>28}: {us:7.1f} us/call host ({extra:+6.1f} over plain), {len(samples[name])} rounds", flush=True)
    profiled = os.environ.get("SPLIT_PROFILE", "softcap_builtin,causal_mask_mod").split(",")
    for name in [name for name in profiled if name in calls]:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(500):
            calls[name]()
        profile.disable()
        torch.cuda.synchronize()
        print(f"--- cProfile of {name}, 500 calls")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
