"""A document mask_mod with a softcap score_mod (Gemma-2's pair over packed documents), B4 H16 D128 bf16,
4 documents per row: run as THD since 1d50f04, against the same pair written as one score_mod (the mask a
select in the dense graph, what ran before) and a causal softcap: GPU ms per call (interleaved medians)
and host us per call with the GPU held, forward and forward+backward, at S=1024 and 4096.

    python bench/diag/document_softcap.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import fusedattn.torch as fat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402
from bench_score_mod import document_lengths, flex_document, segment_ids  # noqa: E402
from document_host import _Impl  # noqa: E402

B, H, D = 4, 16, 128


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * torch.tanh(score / 30.0)


def main() -> int:
    device = torch.device("cuda")
    for seqlen in (1024, 4096):
        ids = segment_ids(document_lengths(seqlen), device)
        same = flex_document(ids)

        def selected(score, b, h, q_idx, kv_idx, same=same):
            return torch.where(same(b, h, q_idx, kv_idx), _softcap(score, b, h, q_idx, kv_idx), -float("inf"))

        q, k, v = (torch.randn(B, seqlen, H, D, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        inputs = (q, k, v, torch.randn_like(q))
        impls = {"document+softcap (THD)": _Impl(lambda *x, same=same: fat.attention(*x, mask_mod=same,
                                                                                     score_mod=_softcap), inputs),
                 "one select score_mod": _Impl(lambda *x: fat.attention(*x, score_mod=selected), inputs),
                 "causal softcap": _Impl(lambda *x: fat.attention(*x, mask="causal", score_mod=_softcap), inputs)}
        for mode in ("fwd", "fwd+bwd"):
            for impl in impls.values():
                for _ in range(5):
                    impl.step(mode)()
            torch.cuda.synchronize()
            gpu = common.interleaved_ms(impls, mode=mode, rounds=5, warmup=3, repeats=10, device=device)
            host = common.medians(common.interleaved_host_us(impls, mode=mode, rounds=7, calls=30, device=device))
            rows = (f"{name} {gpu[name]:.3f} ms / {host.get(name, float('nan')):.0f} us" for name in impls)
            print(f"S={seqlen} {mode}: " + "  ".join(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
