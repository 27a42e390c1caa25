"""Where the host time of a warm call goes on this host: the prologue's pieces and cProfile of repeat
public forward calls (B1 S128 H8 D64 causal bf16, no_grad) beside the operator alone; then the
dispatcher's view (torch.profiler) of forward+backward calls, ours beside SDPA on cuDNN."""

import cProfile
import gc
import pstats
import statistics

import torch
from native_smoke import per_call_us  # this folder: the same timing loop

import fusedattn.torch as fat
from fusedattn import settings
from fusedattn.backends.cudnn.native import torch_plans
from fusedattn.selection import ENV_BACKEND, recall_call
from fusedattn.torch import functional

PLAIN = (None, None, None, None, [], [], False, [])  # sink, seed, offset, bias, aux, scalars, empty_rows, offsets


def interleaved(rows: dict, rounds: int = 15, calls: int = 300) -> dict:
    """Median over rounds of each row's host time per call; the rows take turns within a round, so a
    slow spell of the host touches all of them."""
    times = {name: [] for name in rows}
    for _ in range(rounds):
        for name, fn in rows.items():
            times[name].append(per_call_us(fn, n=calls)[0])
    return {name: statistics.median(values) for name, values in times.items()}


def sdpa_default(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                            is_causal=True)


def main():
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    options = {"mask": "causal"}  # the keywords of the call timed below
    with torch.no_grad():
        fat.attention(q, k, v, **options)
        signature = functional._signature(q, k, v, None, None, (), options, None)
        planned = recall_call(signature)
        print("planned:", None if planned is None else (planned[1].name, planned[2]), flush=True)
        plan = planned[2]
        op = torch.ops.fusedattn_native.attention.default
        def lean():  # the warm path's steps without the rest of attention's body
            signature = functional._signature(q, k, v, None, None, (), options, None)
            return functional._native_call(plan, signature, recall_call(signature), q, k, v, None, None, None,
                                           options)

        def public_without_gc():
            gc.disable()
            try:
                return fat.attention(q, k, v, **options)
            finally:
                gc.enable()

        rows = {"public": lambda: fat.attention(q, k, v, **options),
                "public, gc off": public_without_gc,
                "lean": lean,
                "operator": lambda: op(plan, q, k, v, *PLAIN),
                "_native_call": lambda: functional._native_call(plan, signature, planned, q, k, v, None, None, None,
                                                                options),
                "sdpa (default)": lambda: sdpa_default(q, k, v),
                "_signature": lambda: functional._signature(q, k, v, None, None, (), options, None),
                "recall_call": lambda: recall_call(signature),
                "is_compiling": torch.compiler.is_compiling,
                "is_grad_enabled": torch.is_grad_enabled,
                "_explaining": functional._explaining.get,
                "q.device": lambda: q.device,
                "q.shape": lambda: q.shape,
                "settings.value": lambda: settings.value(ENV_BACKEND),
                "empty_like": lambda: torch.empty_like(q),
                "ops.empty_like": lambda: torch.ops.aten.empty_like.default(q)}
        if torch_plans.entry is not None:
            rows["entry"] = lambda: torch_plans.entry(plan, q, k, v, *PLAIN)
        for name, us in interleaved(rows).items():
            print(f"{name:>16}: {us:6.2f} us/call (host, median of rounds)", flush=True)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3000):
            fat.attention(q, k, v, **options)
        profiler.disable()
        torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
    dispatcher_view(q, k, v)


def dispatcher_view(q, k, v):
    """torch.profiler's CPU view of 200 forward+backward calls, ours and SDPA on cuDNN: which operators
    (ours, aten's allocations, autograd's nodes) take the host time."""
    from torch.profiler import ProfilerActivity, profile

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    grad = torch.randn_like(q)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend = torch.nn.attention.SDPBackend.CUDNN_ATTENTION
    calls = {"ours": lambda: torch.autograd.grad(fat.attention(*leaves, mask="causal"), leaves, grad),
             "sdpa cudnn": lambda: torch.autograd.grad(
                 sdpa(*(x.transpose(1, 2) for x in leaves), is_causal=True), leaves, grad.transpose(1, 2))}
    calls["ours"]()
    plan = list(torch_plans._plans._items.values())[-1]  # the training plan just registered
    operator = torch.ops.fusedattn_native.attention.default
    rows = {**calls,
            "operator": lambda: torch.autograd.grad(operator(plan, *leaves, *PLAIN)[0], leaves, grad)}
    with torch.nn.attention.sdpa_kernel(backend):
        for name, us in interleaved(rows, calls=100).items():
            print(f"fwd+bwd {name:>12}: {us:6.2f} us/call (host, median of rounds)", flush=True)
    for name, call in calls.items():
        with torch.nn.attention.sdpa_kernel(backend):
            for _ in range(20):
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(200):
                    call()
            torch.cuda.synchronize()
        print(f"--- {name}: fwd+bwd, 200 calls", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


if __name__ == "__main__":
    main()
