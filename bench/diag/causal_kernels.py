"""Why a causal forward+backward at S=1024 is slower than a non-causal one: the kernels each call runs,
with their GPU time (torch.profiler), for ours and SDPA on cuDNN, B4 H16 S1024 bf16, D 64 and 128.

Also rebuilds our graphs under other heuristic modes (FUSEDATTN_DIAG_HEUR=B) to see whether the
engine cuDNN picks is the cause, and prints the engine the frontend selected for each graph.
"""
import sys
from pathlib import Path

import cudnn
import torch

import fusedattn.torch as fat
from fusedattn import cache
from fusedattn.backends.cudnn import graphs, runtime

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402


def kernels(fn, repeats=10):
    return {name: us for name, (_, us) in common.kernel_table(fn, repeats).items()}


def show(label, totals):
    print(f"  {label}: {sum(totals.values()):8.1f} us GPU per call", flush=True)
    for name, us in sorted(totals.items(), key=lambda item: -item[1])[:6]:
        print(f"      {us:8.1f} us  {name}", flush=True)


def run(d, causal, modes_label):
    q, k, v = (torch.randn(4, 1024, 16, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad = torch.randn_like(q)
    mask = "causal" if causal else "none"

    def ours():
        fat.attention(q, k, v, mask=mask).backward(grad)

    def sdpa():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), is_causal=causal).backward(grad.transpose(1, 2))

    print(f"D{d} {mask} ({modes_label})", flush=True)
    show("ours fwd+bwd", kernels(ours))
    for key, built in list(runtime.graph_cache()._items.items()):
        print(f"      graph {key[1] if isinstance(key, tuple) and len(key) > 1 else ''}: engine "
              f"{built.engine!r} workspace {built.workspace}", flush=True)
    show("sdpa cudnn fwd+bwd", kernels(sdpa))


def _with_modes(original, heuristic_modes):
    class Graph:  # the frontend's graph with create_execution_plans' modes replaced
        def __init__(self, *args, **kwargs):
            self._graph = original(*args, **kwargs)

        def __getattr__(self, name):
            if name == "create_execution_plans":
                return lambda _modes: self._graph.create_execution_plans(heuristic_modes)
            return getattr(self._graph, name)

    return Graph


def main():
    modes = {"A": [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK], "B": [cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK]}
    original = graphs.cudnn.pygraph
    for label in (sys.argv[1:] or ["A", "B"]):
        graphs.cudnn.pygraph = _with_modes(original, modes[label]) if label != "A" else original
        for d in (64, 128):
            for causal in (False, True):
                cache.clear_all()
                from fusedattn.backends.cudnn.native import torch_plans
                torch_plans._plans.clear()
                try:
                    run(d, causal, label)
                except Exception as error:  # a mode may not build; say so and go on
                    print(f"D{d} causal={causal} mode {label}: {type(error).__name__}: {error}"[:400], flush=True)
    graphs.cudnn.pygraph = original


if __name__ == "__main__":
    main()
