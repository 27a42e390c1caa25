"""Where a document mask_mod's host time goes (B4 H16 S1024 D128 bf16, 4 documents per row, run as THD):
the host's enqueue time per call with the GPU held, of the mask_mod call, the same THD call made
directly (cu_seqlens given) and a plain dense call, forward (no grad), training forward (inputs that
require grad) and forward+backward; then a
cProfile of 200 mask_mod calls of each mode (profile_overhead's).

    python bench/diag/document_host.py
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

import fusedattn.torch as fat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
import common  # noqa: E402
from bench_score_mod import document_lengths, flex_document, segment_ids  # noqa: E402
from profile_overhead import _profile  # noqa: E402  (cProfile of 200 calls, by own and cumulative time)

B, H, S, D = 4, 16, 1024, 128


class _Impl:
    def __init__(self, call, inputs):
        self.call, self.inputs = call, inputs

    def context(self):
        return contextlib.nullcontext()

    def step(self, mode: str):
        q, k, v, dout = self.inputs
        if mode == "fwd":
            def forward():
                with torch.no_grad():
                    self.call(q, k, v)
            return forward
        if mode == "training fwd":  # inputs that require grad: the graph is recorded (bench_score_mod's fwd)
            return lambda: self.call(q, k, v)

        def both():
            out = self.call(q, k, v)
            torch.autograd.grad(out, (q, k, v), dout)
        return both


def main() -> int:
    device = torch.device("cuda")
    lengths = document_lengths(S)
    ids = segment_ids(lengths, device)
    mask_mod = flex_document(ids)
    flat = [n for row in lengths for n in row]
    offsets = torch.tensor([0, *torch.tensor(flat).cumsum(0).tolist()], dtype=torch.int32, device=device)
    longest = max(flat)
    q, k, v = (torch.randn(B, S, H, D, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dout = torch.randn_like(q)
    tokens = [x.detach().reshape(B * S, H, D).requires_grad_() for x in (q, k, v)]

    def thd(q_, k_, v_):
        del q_, k_, v_
        return fat.attention(*tokens, layout="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                             max_seqlen_q=longest, max_seqlen_kv=longest)

    impls = {"document mask_mod": _Impl(lambda q_, k_, v_: fat.attention(q_, k_, v_, mask_mod=mask_mod),
                                        (q, k, v, dout)),
             "THD direct": _Impl(thd, (q, k, v, dout.reshape(B * S, H, D))),
             "plain": _Impl(lambda q_, k_, v_: fat.attention(q_, k_, v_), (q, k, v, dout))}
    impls["THD direct"].inputs = (*tokens, dout.reshape(B * S, H, D))
    for mode in ("fwd", "training fwd", "fwd+bwd"):
        for impl in impls.values():
            for _ in range(20):
                impl.step(mode)()
        torch.cuda.synchronize()  # (an implementation that raises in the timed rounds is left out below)
        host = common.medians(common.interleaved_host_us(impls, mode=mode, rounds=11, calls=60, device=device))
        print(f"{mode}: " + "  ".join(f"{name} {us:.1f} us" for name, us in host.items()), flush=True)
    for mode in ("fwd", "training fwd", "fwd+bwd"):
        _profile(f"document mask_mod, {mode}", impls["document mask_mod"].step(mode))
    return 0


if __name__ == "__main__":
    sys.exit(main())
