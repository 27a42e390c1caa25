"""Why a built-in score_mod's forward+backward costs more host time than the same mod written as a flex
function (bench_score_mod's S=1024 rows): per step host time, launches by route (core.replay_counts) and
the binding each call uses, for softcap and ALiBi, built-in and flex, B4 H16 S1024 D128 bf16, grad."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import core, torch_plans
from fusedattn.torch import score_mod_bindings, warm_entries

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its timing loops
from common import held_loop, spin_cycles_per_us  # noqa: E402


def main() -> None:
    q, k, v = (torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    slopes = torch.tensor(__import__("fusedattn").standard_alibi_slopes(16), device="cuda")

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * sm.tanh(score / 30.0)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    mods = {"plain": None, "softcap_builtin": sm.softcap(30.0), "softcap_flex": softcap,
            "alibi_builtin": sm.alibi(slopes), "alibi_flex": alibi}
    cycles = spin_cycles_per_us()
    in_c = torch_plans.warm_call
    for route in ("c", "python"):
        torch_plans.warm_call = in_c if route == "c" else None
        for name, mod in mods.items():
            options = {} if mod is None else {"score_mod": mod}

            def step(options=options):
                out = fat.attention(q, k, v, **options)
                torch.autograd.grad(out, (q, k, v), grad)

            for _ in range(5):
                step()
            torch.cuda.synchronize()
            before = core.replay_counts()
            hosts = []
            for _ in range(9):
                host, _, held = held_loop(step, 20, int(cycles * 60_000))
                if held:
                    hosts.append(host)
            after = core.replay_counts()
            routes = {key: after[key] - before[key] for key in after}
            bindings = list(score_mod_bindings._BINDINGS._items.values())
            print(f"{route:>6} {name:>16}: {statistics.median(hosts):7.1f} us/step host ({len(hosts)} held), "
                  f"routes {routes}, warm entries {warm_entries.size()}, "
                  f"last binding empty_rows {[b.empty_rows for b in bindings][-1:]}", flush=True)
    torch_plans.warm_call = in_c

if __name__ == "__main__":
    main()
