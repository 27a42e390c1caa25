"""Host time of a warm forward (no grad) at a shape where the GPU is slower than the host, by piece: the
public call, the operator's Python entry alone, torch.ops' boxed call, the Python prologue alone (the
operator replaced by a stub), and SDPA (default dispatch, and forced to cuDNN). Every loop runs with the
GPU held by a spin kernel (common.held_loop), so the enqueue time is the host's alone.

    python bench/diag/host_pieces.py 8,1024,12,64          # B,S,H,D (causal, bf16, bshd)
    FUSEDATTN_NATIVE_PROFILE=1 python bench/diag/host_pieces.py 8,1024,12,64   # plus the operator's steps
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  (bench/)

import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn.native import torch_plans  # noqa: E402
from fusedattn.selection import recall_call  # noqa: E402
from fusedattn.torch import functional  # noqa: E402

CALLS, ROUNDS = 50, 15


def main():
    batch, seqlen, heads, dim = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8,1024,12,64").split(","))
    q, k, v = (torch.randn(batch, seqlen, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    options = {"mask": "causal"}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    cudnn = torch.nn.attention.SDPBackend.CUDNN_ATTENTION
    with torch.no_grad():
        for _ in range(3):
            fat.attention(q, k, v, **options)
        planned = recall_call(functional._signature(q, k, v, None, None, (), options, None))
        print("planned:", None if planned is None else (planned[1].name, planned[2]), flush=True)
        plan = planned[2]
        op = torch.ops.fusedattn_native.attention.default
        plain = (None, None, None)

        def sdpa_cudnn():
            with torch.nn.attention.sdpa_kernel(cudnn):
                return sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)

        operator = functional._operator
        stub = lambda plan, q, *rest: (q, q)  # noqa: E731

        def prologue():  # the public call with the operator replaced: Python's part alone
            functional._operator = stub
            try:
                return fat.attention(q, k, v, **options)
            finally:
                functional._operator = operator

        rows = {"public": lambda: fat.attention(q, k, v, **options),
                "entry": lambda: torch_plans.entry(plan, q, k, v, *plain),
                "torch.ops": lambda: op(plan, q, k, v, *plain, None, [], [], False, []),
                "prologue (stub op)": prologue,
                "sdpa default": lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True),
                "sdpa cudnn (in ctx)": sdpa_cudnn,
                "3 transposes": lambda: (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)),
                "empty_like": lambda: torch.empty_like(q)}
        cycles = common.spin_cycles_per_us()
        times = {name: [] for name in rows}
        for _ in range(ROUNDS):
            for name, fn in rows.items():
                for _ in range(5):
                    fn()
                hold = int(cycles * (2000 + 100 * CALLS))
                host, _, _ = common.held_loop(fn, CALLS, hold)
                times[name].append(host)
        for name, values in times.items():
            print(f"{name:>22}: {statistics.median(values):7.2f} us/call (host, GPU held, median of {ROUNDS})",
                  flush=True)


if __name__ == "__main__":
    main()
