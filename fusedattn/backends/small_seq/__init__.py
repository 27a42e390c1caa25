"""Cross attention of one query against a few keys, at huge batch (Triton).

Recommendation and retrieval models attend from one query token to 2-16 keys per
sequence, for tens of thousands to millions of sequences. General flash kernels tile for
long sequences and waste most of their work here; these kernels read each key and value
once and run near memory bandwidth. The forward saves only the LSE: the backward
recomputes the few scores from q and k, which it reads anyway for dq and dk, so saving
the probabilities would only add traffic (MAX_SEQLEN_KV floats per query head instead of 1).
"""

from __future__ import annotations

import os

from fusedattn.backends.base import Backend, package_missing
from fusedattn.config import UNBOUNDED, BiasType, SoftmaxType

# The longest key sequence this backend takes: up to here it beat every other backend on
# an H200 (see the README's small_seq benchmarks); the kernels themselves handle up to 128.
# With one query head per KV head and D <= 128 the sweep (bench_small_seq.py --sweep) measured
# 2.6-3.5x the best peer at Skv=32 and 1.7-2.0x at 64, but 0.86x forward+backward at 128.
MAX_SEQLEN_KV = 16
MAX_SEQLEN_KV_MHA = 64
MHA_LONG_KEYS_MAX_HEAD_DIM = 128
MAX_HEAD_DIM = 512
_LAYOUTS = ("thd", "bshd", "thd_t2hd", "bshd_bs2hd")
ENV_ON_CPU = "FUSEDATTN_SMALL_SEQ_ON_CPU"


def max_seqlen_kv(cfg) -> int:
    """The longest key sequence small_seq takes for this config (the measured region)."""
    if cfg.heads_q == cfg.heads_kv and cfg.head_dim_qk <= MHA_LONG_KEYS_MAX_HEAD_DIM:
        return max(MAX_SEQLEN_KV, MAX_SEQLEN_KV_MHA)
    return MAX_SEQLEN_KV


class SmallSeqBackend(Backend):
    name = "small_seq"
    frameworks = ("torch", "jax")  # JAX through jax-triton (fusedattn/jax/small_seq_call.py), or else torch
    dtypes = ("float16", "bfloat16")
    max_head_dim = MAX_HEAD_DIM
    head_dim_multiple = 8
    packages = (("triton", "triton"),)
    array_framework = "torch"

    @property
    def devices(self) -> tuple[str, ...]:
        # On request, Triton's interpreter runs the kernels on the CPU (tests, debugging); it
        # must have been on (TRITON_INTERPRET=1) before triton was imported.
        on_cpu = os.environ.get(ENV_ON_CPU) == "1" and os.environ.get("TRITON_INTERPRET") == "1"
        return ("cuda", "cpu") if on_cpu else ("cuda",)

    def _reasons(self, cfg):
        reasons = []
        if cfg.framework == "jax" and package_missing("jax_triton") and package_missing("torch"):
            reasons.append("small_seq from JAX launches its Triton kernels through jax-triton, or else through torch, "
                           "and neither is installed (pip install jax-triton)")
        if cfg.layout.value not in _LAYOUTS:
            reasons.append(f"layout {cfg.layout.value!r}: reads {', '.join(_LAYOUTS)}")
        if cfg.seqlen_q != 1:
            reasons.append(f"Sq={cfg.seqlen_q}: needs Sq = 1 (THD: max_seqlen_q = 1, sequences of one query or none)")
        limit = max_seqlen_kv(cfg)
        if cfg.seqlen_kv > limit:
            reasons.append(f"Skv={cfg.seqlen_kv} > {limit} (longer key sequences are faster elsewhere; "
                           f"{max(MAX_SEQLEN_KV, MAX_SEQLEN_KV_MHA)} needs Hq == Hkv and "
                           f"D <= {MHA_LONG_KEYS_MAX_HEAD_DIM})")
        if cfg.head_dim_qk != cfg.head_dim_v:
            reasons.append(f"head_dim_qk={cfg.head_dim_qk} != head_dim_v={cfg.head_dim_v}")
        if cfg.window[0] != UNBOUNDED:
            reasons.append(f"window {cfg.window}: a left window bound is not supported")
        if cfg.bias is not BiasType.NONE:
            reasons.append(f"bias {cfg.bias.value}: not supported")
        if cfg.dropout_p > 0.0:
            reasons.append(f"dropout_p={cfg.dropout_p}: not supported")
        if cfg.softmax is not SoftmaxType.VANILLA:
            reasons.append(f"softmax_type {cfg.softmax.value}: not supported")
        if cfg.return_max_logit:
            reasons.append("return_max_logit: not supported")
        if cfg.score_mod_key is not None:
            reasons.append("score_mod: not supported")
        return reasons

    def forward(self, cfg, inputs):
        from fusedattn.backends.small_seq.torch_run import forward

        return forward(cfg, inputs), None

    def backward(self, cfg, inputs, saved, outputs, grad_out, grad_lse=None):
        from fusedattn.backends.small_seq.torch_run import backward

        return backward(cfg, inputs, outputs, grad_out, grad_lse)


__all__ = ["SmallSeqBackend", "MAX_SEQLEN_KV", "MAX_SEQLEN_KV_MHA", "max_seqlen_kv", "ENV_ON_CPU"]
