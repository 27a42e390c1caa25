"""Cross attention of one query against a few keys at huge batch (Triton).

Declares its capabilities now; the kernel comes in a later release.
"""

from fusedattn.backends.base import Backend

MAX_SEQLEN_KV = 16


class SmallSeqBackend(Backend):
    name = "small_seq"
    frameworks = ("torch", "jax")
    devices = ("cuda",)
    dtypes = ("float16", "bfloat16")
    implemented = False
    packages = (("triton", "triton"),)

    def _reasons(self, cfg):
        reasons = []
        if cfg.seqlen_q != 1:
            reasons.append(f"Sq={cfg.seqlen_q}: needs exactly one query per sequence")
        if cfg.seqlen_kv > MAX_SEQLEN_KV:
            reasons.append(f"Skv={cfg.seqlen_kv} > {MAX_SEQLEN_KV}")
        return reasons


__all__ = ["SmallSeqBackend"]
