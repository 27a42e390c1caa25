"""Does bench_score_mod's forward+backward host extra (S=1024 rows) depend on the loop's length? The host's
enqueue time per step with the GPU held, for loops of 10 to 60 steps, of a plain call and the S=1024 D128
score_mod rows (B4 H16 bf16), and the kernel launches one step makes (torch profiler). If the extra grows
with the loop, the host waited for room in the launch queue, not for its own work.

    python bench/diag/host_loop_length.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from bench_score_mod import document_lengths, flex_document, flex_softcap, segment_ids  # noqa: E402
from common import held_loop, spin_cycles_per_us  # noqa: E402

B, H, S, D = 4, 16, 1024, 128
LOOPS = (10, 20, 40, 60)
ROUNDS = 9


def launches_per_step(step) -> dict[str, int]:
    """CUDA runtime/driver launch calls of one step, by name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for event in prof.events():
        if "aunch" in event.name:
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def main() -> None:
    device = torch.device("cuda")
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)
    ids = segment_ids(document_lengths(S), device)
    calls = {"plain": {}, "softcap_flex": {"score_mod": flex_softcap(20.0)},
             "softcap_builtin": {"score_mod": sm.softcap(20.0)},
             "document_builtin": {"score_mod": sm.document_mask(ids)},
             "document_mask_mod": {"mask_mod": flex_document(ids)}}
    cycles = spin_cycles_per_us()
    for name, options in calls.items():
        def step(options=options):
            torch.autograd.grad(fat.attention(q, k, v, **options), (q, k, v), grad)

        for _ in range(10):
            step()
        torch.cuda.synchronize()
        row = []
        for loop in LOOPS:
            hosts = []
            for _ in range(ROUNDS):
                host, _, held = held_loop(step, loop, int(cycles * (loop * 600 + 3000)))
                if held:
                    hosts.append(host)
            row.append(f"{loop}: {statistics.median(hosts):6.1f}" if hosts else f"{loop}: none held")
        print(f"{name:>18} host us/step by loop length  " + "  ".join(row)
              + f"   launches {launches_per_step(step)}", flush=True)


if __name__ == "__main__":
    main()
