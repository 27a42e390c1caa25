"""Our torch path on one bench_jax.py feature case, in a process of its own (torch sets up no CUDA in the JAX one).

fusedattn.torch.attention with the case's keywords (feature_rows.ours_keywords) on tensors made from the same
NumPy data as the JAX rows (feature_rows.numpy_inputs: the same bfloat16 bits). "fwd" is the forward under
torch.no_grad(), "fwd+bwd" the forward then torch.autograd.grad of (q, k, v) for the case's cotangent; each
asked-for mode is measured in turn on the same tensors. Timed as bench_jax times JAX: wall clock, median over
`repeats` loops of back-to-back calls then one torch.cuda.synchronize(), per call, after the first call and
`warmup` more. Writes {"modes": {mode: {"ms", "calls_per_loop"} or {"error"}}, "timing", "jax_loaded"} (or
{"error"}) to --out and the sampled outputs (feature_rows.sample of out and, in fwd+bwd, dq, dk, dv, float32,
named <mode>_<index>) to --samples.

    python bench/torch_path_peer.py --request '{"case": {...}, "modes": ["fwd"], ...}' --out r.json --samples s.npz
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial

import numpy as np
import torch

try:  # python -m bench.torch_path_peer
    from . import common, feature_rows
except ImportError:  # python bench/torch_path_peer.py
    import common
    import feature_rows

TIMING = "wall clock: median of loops of back-to-back calls then one torch.cuda.synchronize(), per call"


def tensors(case: feature_rows.FeatureCase, device: torch.device) -> dict[str, torch.Tensor]:
    """The case's NumPy arrays as tensors on `device` (bit patterns viewed as bfloat16); q, k, v require grad."""
    made = {}
    for name, array in feature_rows.numpy_inputs(case).items():
        tensor = torch.from_numpy(array)
        made[name] = (tensor.view(torch.bfloat16) if feature_rows.is_bf16(name) else tensor).to(device)
    for name in ("q", "k", "v"):
        made[name].requires_grad_()
    return made


def time_mode(impl: common.Impl, mode: str, request: dict, device: torch.device) -> tuple[dict, list[np.ndarray]]:
    """({"ms", "calls_per_loop"}, sampled outputs) of one mode."""
    samples = [feature_rows.sample(t).float().cpu().numpy() for t in impl.outputs(mode)]
    step = impl.step(mode)
    for _ in range(request["warmup"]):
        step()
    wait = (lambda _: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda _: None)
    calls = feature_rows.loop_calls(step, (), wait, request["loop_ms"])
    return {"ms": feature_rows.loop_ms(step, (), wait, request["repeats"], calls), "calls_per_loop": calls}, samples


def measure(request: dict) -> tuple[dict, dict[str, np.ndarray]]:
    """(result, samples by name) of the request's case in each of its modes; a failing mode is its error entry."""
    import fusedattn.torch as fat

    case = feature_rows.FeatureCase(**request["case"])
    device = torch.device(request["device"])
    x = tensors(case, device)
    static, traced = feature_rows.ours_keywords(case, x)
    call = partial(fat.attention, x["q"], x["k"], x["v"], backend=request["backend"], **static, **traced)
    impl = common.Impl("torch_path", call, (x["q"], x["k"], x["v"]), x["cotangent"], forward_no_grad=True)
    modes, samples = {}, {}
    for mode in request["modes"]:
        try:
            modes[mode], outputs = time_mode(impl, mode, request, device)
        except Exception as error:  # the row records it
            modes[mode] = common.error_entry(error)
            continue
        samples.update({f"{mode}_{i}": output for i, output in enumerate(outputs)})
    return {"modes": modes, "timing": TIMING, "jax_loaded": "jax" in sys.modules}, samples


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torch_path_peer.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--request", required=True, help="JSON: case (FeatureCase fields), modes, backend, device, "
                        "repeats, warmup, loop_ms")
    parser.add_argument("--out", required=True, help="the result, JSON")
    parser.add_argument("--samples", required=True, help="the sampled outputs, .npz")
    args = parser.parse_args(argv)
    try:
        result, samples = measure(json.loads(args.request))
        np.savez(args.samples, **samples)
    except Exception as error:  # the rows record it
        result = common.error_entry(error)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
