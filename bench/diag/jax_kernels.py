"""Where a JAX feature call's device time goes: every kernel XLA launches for one jitted call (CUPTI through
torch's profiler, which records the whole process), with its time, and the optimized program's kernel count.

    python bench/diag/jax_kernels.py [--features padding,thd,sink] [--seqlens 1024,4096] [--peer]

Prints per row and mode: the kernels of one call (name, us, count per call), their sum, and the loop time
per call (back-to-back, as bench_jax times it). --peer adds jax.nn's cuDNN call where it can express the row.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU for the profiler
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import bench_jax  # noqa: E402
import common  # noqa: E402
import feature_rows  # noqa: E402
import jax  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

CALLS = 5


def _kernels(step, args) -> dict:
    """{kernel name: (total us, launches)} over CALLS calls."""
    jax.block_until_ready(step(*args))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            out = step(*args)
        jax.block_until_ready(out)
    found = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            found[event.name][0] += event.device_time
            found[event.name][1] += 1
    return found


def _report(label: str, step, args) -> None:
    found = _kernels(step, args)
    loop = feature_rows.loop_ms(step, args, jax.block_until_ready, 5, 200) * 1e3
    total = sum(us for us, _ in found.values()) / CALLS
    launches = sum(n for _, n in found.values()) / CALLS
    print(f"{label}: kernels {total:8.1f} us in {launches:4.1f} launches a call; loop {loop:8.1f} us", flush=True)
    for name, (us, n) in sorted(found.items(), key=lambda item: -item[1][0]):
        print(f"    {us / CALLS:8.1f} us  x{n / CALLS:4.1f}  {name[:110]}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--features", default="plain,padding,thd,sink,softcap")
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--peer", action="store_true")
    args = parser.parse_args()
    device = jax.devices("gpu")[0]
    for seqlen in map(int, args.seqlens.split(",")):
        for feature in args.features.split(","):
            case = feature_rows.FeatureCase(feature, 4, 16, seqlen, 128)
            arrays = bench_jax.to_jax(feature_rows.numpy_inputs(case), device)
            contestants = {"ours": bench_jax.ours_fn(case, arrays, "cudnn")}
            if args.peer and feature not in bench_jax.PEER_CANNOT:
                contestants["jax_cudnn"] = bench_jax.peer_fn("jax_cudnn", case, arrays)
            for mode in (common.FWD, common.FWD_BWD):
                for name, (fn, traced) in contestants.items():
                    step = bench_jax.jitted(fn, mode)
                    _report(f"{case.name}-{mode} {name}", step, bench_jax.step_inputs(arrays, mode, traced))


if __name__ == "__main__":
    main()
