"""The expert path: softcap written as cuDNN graph callbacks, with its derivative by hand.

`fusedattn.score_mods.softcap(cap)` is the same modification in flex form (traced, derivative
derived); this one builds the graph ops itself, as a callback that cuDNN's pointwise ops can express
but our tracer cannot (or one tuned by hand) would. The benchmarks time it beside the flex form
(bench/bench_score_mod.py, row softcap_native), and a GPU test checks the two agree.

    from native_softcap import native_softcap
    out = fusedattn.torch.attention(q, k, v, score_mod=native_softcap(30.0))
"""

from __future__ import annotations

from fusedattn.score_mods import ScoreMod


def _forward(graph, score, tensors):
    x = graph.div(a=score, b=tensors["cap"])
    tensors["softcap_input"] = x  # kept for the derivative: the backward graph reads the forward's value
    return graph.mul(a=graph.tanh(input=x), b=tensors["cap"])


def _bprop(graph, dscore, tensors):
    # d/ds cap * tanh(s / cap) = 1 - tanh(s / cap)^2, applied to dLoss/d(output)
    return graph.tanh_backward(loss=dscore, input=tensors["softcap_input"])


def native_softcap(cap: float) -> ScoreMod:
    """cap * tanh(score / cap) as cuDNN graph callbacks; cap is a runtime scalar (a new cap never rebuilds)."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0:
        raise ValueError(f"native_softcap: cap: expected a positive number, got {cap!r}")
    return ScoreMod(_forward, _bprop, {"cap": float(cap)}, masks=False, name=f"native_softcap({cap:g})")
