"""A score_mod with sequence lengths on the native operator against the Python path (B4 H16 D128 bf16, THD
with 4 sequences of up to 1024 tokens, and the same as a padded BSHD call): host enqueue time per call with
the GPU held and GPU time per call, of softcap and of the plain call, forward (no grad) and forward+backward.
The Python path is the same script in a process of its own with FUSEDATTN_TORCH_NATIVE=0.

    python bench/diag/scored_sequences_host.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402
from document_host import _Impl  # noqa: E402  (one timed call: fwd without grad, or fwd+bwd)

B, H, D = 4, 16, 128
LENGTHS = [1024, 700, 333, 901]


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def _impls(device) -> dict:
    offsets = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(LENGTHS)
    sequences = dict(cu_seqlens_q=offsets, cu_seqlens_kv=offsets, max_seqlen_q=longest, max_seqlen_kv=longest)
    tokens = [torch.randn(sum(LENGTHS), H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
              for _ in range(3)]
    dense = [torch.randn(B, longest, H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
             for _ in range(3)]
    thd = dict(layout="thd", mask="padding_causal", **sequences)
    padded = dict(mask="padding_causal", **sequences)
    return {
        "thd plain": _Impl(lambda q, k, v: fat.attention(q, k, v, **thd), (*tokens, torch.randn_like(tokens[0]))),
        "thd softcap": _Impl(lambda q, k, v: fat.attention(q, k, v, score_mod=_softcap, **thd),
                             (*tokens, torch.randn_like(tokens[0]))),
        "padded plain": _Impl(lambda q, k, v: fat.attention(q, k, v, **padded), (*dense, torch.randn_like(dense[0]))),
        "padded softcap": _Impl(lambda q, k, v: fat.attention(q, k, v, score_mod=_softcap, **padded),
                                (*dense, torch.randn_like(dense[0]))),
    }


def measure() -> dict:
    device = torch.device("cuda")
    impls = _impls(device)
    found = {}
    for mode in ("fwd", "fwd+bwd"):
        for impl in impls.values():
            for _ in range(10):
                impl.step(mode)()
        torch.cuda.synchronize()
        host = common.medians(common.interleaved_host_us(impls, mode=mode, rounds=9, calls=50, device=device))
        gpu = common.interleaved_ms(impls, mode=mode, rounds=5, warmup=3, repeats=20, device=device)
        for name in impls:
            found[f"{name} {mode}"] = {"host_us": round(host.get(name, float("nan")), 1),
                                       "ms": round(gpu.get(name, float("nan")), 4)}
    return found


def main() -> int:
    if os.environ.get("SCORED_CHILD") == "1":
        print(json.dumps(measure()))
        return 0
    native, python_path = common.with_python_path(measure, __file__, "SCORED_CHILD")
    print(f"{'call':>24} {'native host us':>15} {'python host us':>15} {'native ms':>10} {'python ms':>10}")
    for name, row in native.items():
        other = python_path.get(name, {})
        print(f"{name:>24} {row['host_us']:15.1f} {other.get('host_us', float('nan')):15.1f} "
              f"{row['ms']:10.4f} {other.get('ms', float('nan')):10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
