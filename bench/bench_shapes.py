"""What a new shape costs on the cuDNN backend: first-call latency (graph builds) and THD bucketing.

cuDNN 9.19 graphs are fixed-shape, so each new (B, S, ...) builds new graphs (the frontend's
kernel cache gives wrong results on 9.19 and is not used). This measures that cost, and how
FUSEDATTN_THD_BUCKET lets packed batches with varying longest sequence share graphs.
Writes bench/results/shapes.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn import runtime  # noqa: E402


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def dense_rows(rows: list) -> None:
    for training in (False, True):
        for batch, seqlen in ((4, 1024), (4, 1536), (2, 2048), (4, 3072), (4, 1024)):
            q = torch.randn(batch, seqlen, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=training)
            k, v = torch.randn_like(q, requires_grad=training), torch.randn_like(q, requires_grad=training)
            grad = torch.randn_like(q)

            def call(q=q, k=k, v=v, grad=grad, training=training):
                out = fat.attention(q, k, v, mask="causal", backend="cudnn")
                if training:
                    torch.autograd.grad(out, (q, k, v), grad)

            builds = runtime.graph_cache().builds
            first = wall_ms(call)
            built = runtime.graph_cache().builds - builds
            steady = sorted(wall_ms(call) for _ in range(10))[5]
            rows.append({"workload": f"dense-b{batch}-s{seqlen}-{'fwd+bwd' if training else 'fwd'}",
                         "params": {"B": batch, "S": seqlen, "H": 16, "D": 128, "mask": "causal"},
                         "graphs_built": built, "first_call_ms": round(first, 2), "steady_ms": round(steady, 3)})
            print(rows[-1], flush=True)


def thd_rows(rows: list, batches: int) -> None:
    rng = random.Random(0)
    packings = [[rng.randint(200, 2048) for _ in range(4)] for _ in range(batches)]
    for setting in ("off", "pow2", "512"):
        os.environ["FUSEDATTN_THD_BUCKET"] = setting
        fusedattn.selection.clear_decisions()
        runtime.graph_cache().clear()
        builds = runtime.graph_cache().builds
        total = 0.0
        for lengths in packings:
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
            x = torch.randn(int(cu[-1]), 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            grad = torch.randn_like(x)

            def call(x=x, cu=cu, grad=grad):
                out = fat.attention(x, x, x, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, mask="causal",
                                    backend="cudnn")
                torch.autograd.grad(out, x, grad)

            total += wall_ms(call)
        rows.append({"workload": f"thd-{batches}-packings-bucket-{setting}",
                     "params": {"B": 4, "H": 16, "D": 128, "lengths": "uniform 200..2048", "bucket": setting},
                     "graphs_built": runtime.graph_cache().builds - builds,
                     "total_first_calls_ms": round(total, 1)})
        print(rows[-1], flush=True)
    os.environ.pop("FUSEDATTN_THD_BUCKET", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="bench/results/shapes.json")
    parser.add_argument("--thd-batches", type=int, default=12)
    args = parser.parse_args()
    rows: list = []
    dense_rows(rows)
    thd_rows(rows, args.thd_batches)
    result = {"suite": "shapes", "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
              "versions": {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                           "fusedattn": fusedattn.__version__}, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
