"""Which GPU kernels a padded call launches, and how long each takes, on the native operator and on the
Python path (a child process with FUSEDATTN_TORCH_NATIVE=0): the padded plain forward took 0.35 ms on the
operator against 0.24-0.28 ms on the Python path (scored_sequences_host.py, B4 S1024 H16 D128).

    python bench/diag/padded_kernels.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scored_sequences_host import _impls  # noqa: E402

CALLS = 20


def kernels() -> dict:
    impls = _impls(torch.device("cuda"))
    found = {}
    for name in ("padded plain", "padded softcap", "thd plain"):
        for mode in ("fwd", "fwd+bwd"):
            step = impls[name].step(mode)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    step()
                torch.cuda.synchronize()
            table = defaultdict(lambda: [0, 0.0])
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    row = table[event.name[:90]]
                    row[0] += 1
                    row[1] += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
            found[f"{name} {mode}"] = {k: (n / CALLS, us / CALLS) for k, (n, us) in table.items()}
    return found


def main() -> int:
    if os.environ.get("KERNELS_CHILD") == "1":
        print(json.dumps(kernels()))
        return 0
    native = kernels()
    env = dict(os.environ, KERNELS_CHILD="1", FUSEDATTN_TORCH_NATIVE="0")
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=400)
    python_path = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 else {}
    if child.returncode:
        print(child.stderr[-2000:])
    for label, result in (("native operator", native), ("python path", python_path)):
        print(f"== {label}: per call, (launches, GPU us)")
        for call, table in result.items():
            total = sum(us for _, us in table.values())
            print(f"  {call}: {total:.1f} us")
            for kernel, (count, us) in sorted(table.items(), key=lambda kv: -kv[1][1]):
                print(f"    {count:5.1f} x {us:8.1f} us  {kernel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
