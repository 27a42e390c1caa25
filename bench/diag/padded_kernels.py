"""Which GPU kernels a padded call launches, and how long each takes, on the native operator and on the
Python path (a child process with FUSEDATTN_TORCH_NATIVE=0): the padded plain forward took 0.35 ms on the
operator against 0.24-0.28 ms on the Python path (scored_sequences_host.py, B4 S1024 H16 D128).

    python bench/diag/padded_kernels.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from scored_sequences_host import _impls  # noqa: E402

CALLS = 20


def kernels() -> dict:
    impls = _impls(torch.device("cuda"))
    return {f"{name} {mode}": common.kernel_table(impls[name].step(mode), repeats=CALLS, warmup=5)
            for name in ("padded plain", "padded softcap", "thd plain") for mode in ("fwd", "fwd+bwd")}


def main() -> int:
    if os.environ.get("KERNELS_CHILD") == "1":
        print(json.dumps(kernels()))
        return 0
    native, python_path = common.with_python_path(kernels, __file__, "KERNELS_CHILD")
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
