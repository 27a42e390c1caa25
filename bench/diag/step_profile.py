"""Where a step's time goes: torch.profiler tables for bench_model's steps (ours against a peer) and for
one THD forward+backward, printed to stdout (a diagnosis, not a benchmark).

    python bench/diag/step_profile.py --config gpt2-small --mode compile --peer sdpa_cudnn
    python bench/diag/step_profile.py --thd
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import bench_model  # noqa: E402


def table(prof, sort: str, rows: int) -> str:
    return prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70)


def profile_steps(name: str, config, mode: str, steps: int) -> None:
    device = torch.device("cuda")
    args = SimpleNamespace(ours_backend=None, compile_backend="inductor")
    torch.manual_seed(0)
    x = torch.randn(config.B, config.S, config.d_model, device=device, dtype=bench_model.DTYPE)
    contestant, _ = bench_model.build(name, config, mode, x, args, device)
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()
    bench_model.warm_up(contestant, 3)
    breaks = {k: dict(v) for k, v in dynamo_utils.counters.items() if "break" in k or k == "stats"}
    torch.cuda.synchronize()
    with contestant.context():
        start = time.perf_counter()
        for _ in range(steps):
            contestant.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps * 1e3
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                contestant.step()
            torch.cuda.synchronize()
    print(f"\n===== {name} {config.name} {mode}: {wall:.2f} ms/step wall; dynamo counters {breaks}")
    print(table(prof, "cuda_time_total", 25))
    print(table(prof, "self_cpu_time_total", 25))


def profile_thd(calls: int) -> None:
    import fusedattn.torch as fat

    device = "cuda"
    lengths, H, D = (1024, 768, 512, 256), 16, 128
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = int(sum(lengths))
    q, k, v = (torch.randn(total, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(total, H, D, device=device, dtype=torch.bfloat16)

    def call():
        return fat.attention(q, k, v, layout="thd", mask="causal", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                             max_seqlen_q=1024, max_seqlen_kv=1024)

    for _ in range(3):
        torch.autograd.grad(call(), (q, k, v), grad)
    print(fat.explain(q, k, v, layout="thd", mask="causal", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                      max_seqlen_q=1024, max_seqlen_kv=1024))
    torch.cuda.synchronize()
    for label, grads in (("forward", False), ("forward+backward", True)):
        start = time.perf_counter()
        for _ in range(calls):
            out = call()
            if grads:
                torch.autograd.grad(out, (q, k, v), grad)
        host = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        whole = (time.perf_counter() - start) / calls * 1e6
        print(f"THD {label}: host {host:.1f} us/call, with the queue drained {whole:.1f} us/call")
    # The sequence kernels' launches alone (backends/cudnn/sequences.py).
    from fusedattn.backends.cudnn.sequences import SequenceTable, layout_of
    from fusedattn.config import AttentionConfig

    cfg = AttentionConfig(layout="thd", batch=len(lengths), seqlen_q=1024, seqlen_kv=1024, heads_q=H, heads_kv=H,
                          head_dim_qk=D, head_dim_v=D, dtype="bfloat16", mask="padding_causal")
    layout = layout_of(cfg, {name: H * D for name in ("q", "o", "dq", "k", "v", "dk", "dv")} | {"stats": H})
    built = SequenceTable.build(layout, offsets, offsets, None, None, (total, total))
    out, lse = torch.empty(total, H, D, device=device, dtype=torch.bfloat16), torch.empty(total, H, device=device)
    for label, launch in (("sequence table", lambda: SequenceTable.build(layout, offsets, offsets, None, None,
                                                                         (total, total))),
                          ("fix_rows with lse", lambda: built.fix_rows("q", out, lse=lse, stats=lse, seqlen=1024)),
                          ("fix_rows", lambda: built.fix_rows("kv", out, out, seqlen=1024))):
        launch()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            launch()
        print(f"{label}: {(time.perf_counter() - start) / 200 * 1e6:.1f} us/launch (host)")
        torch.cuda.synchronize()
    # Python's share, function by function (tottime: time in the function itself).
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls * 5):
        torch.autograd.grad(call(), (q, k, v), grad)
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            torch.autograd.grad(call(), (q, k, v), grad)
        torch.cuda.synchronize()
    print(table(prof, "cuda_time_total", 25))
    print(table(prof, "self_cpu_time_total", 30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="gpt2-small", choices=sorted(bench_model.CONFIGS))
    parser.add_argument("--mode", default="compile", choices=bench_model.MODES)
    parser.add_argument("--peer", default="sdpa_cudnn", choices=bench_model.PEERS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--thd", action="store_true", help="profile the THD call instead")
    args = parser.parse_args()
    if args.thd:
        profile_thd(20)
        return
    torch._dynamo.config.cache_size_limit = bench_model.RECOMPILE_LIMIT
    config = bench_model.CONFIGS[args.config]
    for name in (bench_model.OURS, args.peer):
        profile_steps(name, config, args.mode, args.steps)


if __name__ == "__main__":
    main()
