"""Host time of repeat calls answered in C against the Python path, on any host (CPU tensors): the native
library is built here and its ops get CPU kernels that only allocate their outputs, as
tests/test_warm_entries.py wires them, so what is timed is the call up to the operator and back. Rows:
a plain call, closures and built-ins made once and made anew at each call (a composition too), and one
closure per layer (8 layers of equal closures), B1 S16 H2 D8, no grad, median of 7 loops of 500 calls.

    python bench/diag/warm_entries_cpu.py
"""

from __future__ import annotations

import ctypes
import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import build, torch_plans
from fusedattn.torch import functional, warm_entries

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from common import plain_loop  # noqa: E402


def wire_library():
    """The library's operator with CPU kernels, its warm entries on, and one real plan per config."""
    path = build.library_path("torch")
    operator = torch_plans.load_operator(path)
    module = torch_plans.python_module(path)
    if module is None:
        raise SystemExit("this interpreter has no C headers: the library has no Python entry")
    kernels = torch.library.Library("fusedattn_native", "IMPL", "CPU")
    kernels.impl("forward", lambda plan, q, k, v, *rest: [torch.empty_like(q), q.new_empty(q.shape[0], q.shape[2],
                                                                                            q.shape[1])])
    for name in ("warm_call", "warm_remember", "warm_clear", "warm_size"):
        setattr(torch_plans, name, getattr(module, name))
    torch_plans.entry, torch_plans.tensor_key = module.attention, module.tensor_key
    warm_entries.configure(module)
    plans: dict = {}

    def plan_on(cfg, name, device):
        if cfg not in plans:
            shape = torch_plans.plan_shape(cfg, True)
            plans[cfg] = operator.fusedattn_torch_plan(0, -1, (ctypes.c_int64 * len(shape))(*shape), len(shape),
                                                       cfg.scale)
        return plans[cfg]

    functional._native_plan_on = plan_on
    return kernels


def closure(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)
    return softcap


def rows(q: torch.Tensor) -> dict:
    once, builtin, slopes = closure(20.0), sm.softcap(20.0), torch.rand(q.shape[2])
    layers = [closure(20.0) for _ in range(8)]
    return {"plain": lambda: fat.attention(q, q, q, mask="causal"),
            "closure made once": lambda: fat.attention(q, q, q, mask="causal", score_mod=once),
            "closure made each call": lambda: fat.attention(q, q, q, mask="causal", score_mod=closure(20.0)),
            "8 layers' closures (per call)": lambda: [fat.attention(q, q, q, mask="causal", score_mod=fn)
                                                      for fn in layers] and None,
            "built-in made once": lambda: fat.attention(q, q, q, mask="causal", score_mod=builtin),
            "built-in made each call": lambda: fat.attention(q, q, q, mask="causal", score_mod=sm.softcap(20.0)),
            "compose(softcap, alibi) made each call": lambda: fat.attention(
                q, q, q, mask="causal", score_mod=sm.compose(sm.softcap(20.0), sm.alibi(slopes)))}


def main() -> None:
    kernels = wire_library()
    q = torch.randn(1, 16, 2, 8, dtype=torch.bfloat16)
    calls = rows(q)
    in_c = torch_plans.warm_call
    with torch.no_grad():
        for route in ("c", "python"):
            torch_plans.warm_call = in_c if route == "c" else None
            for name, fn in calls.items():
                for _ in range(200):
                    fn()
                loops = [plain_loop(fn, 500, torch.device("cpu"))[0] for _ in range(7)]
                per = 8 if name.startswith("8 layers") else 1
                print(f"{route:>6} {name:>30}: {statistics.median(loops) / per:6.1f} us/call "
                      f"(warm entries {warm_entries.size()})", flush=True)
    torch_plans.warm_call = in_c
    del kernels


if __name__ == "__main__":
    main()
