"""Reference backend: layouts around `attention_bhsd`; backward by the framework's autodiff."""

from __future__ import annotations

from fusedattn.backends.base import DIFFERENTIABLE, AttentionInputs, AttentionOutputs, Backend
from fusedattn.backends.reference.math import attention_bhsd
from fusedattn.config import AttentionConfig
from fusedattn.layout import from_bhsd, layout_spec, padded_to_thd, thd_to_padded, to_bhsd
from fusedattn.xp import namespace


def _seqlens(cu_seqlens):
    return None if cu_seqlens is None else cu_seqlens[1:] - cu_seqlens[:-1]


def reference_forward(cfg: AttentionConfig, inputs: AttentionInputs) -> AttentionOutputs:
    """Differentiable forward in the framework of the inputs; outputs in the layout of q."""
    ops = namespace(inputs.q)
    base = layout_spec(cfg.layout).base
    q, k, v = inputs.q, inputs.k, inputs.v
    if cfg.layout.is_ragged:
        q = to_bhsd(thd_to_padded(q, inputs.cu_seqlens_q, cfg.seqlen_q, inputs.cu_seqlens_q_padded), "bshd")
        k = to_bhsd(thd_to_padded(k, inputs.cu_seqlens_kv, cfg.seqlen_kv, inputs.cu_seqlens_kv_padded), "bshd")
        v = to_bhsd(thd_to_padded(v, inputs.cu_seqlens_kv, cfg.seqlen_kv, inputs.cu_seqlens_kv_padded), "bshd")
    else:
        q, k, v = to_bhsd(q, base), to_bhsd(k, base), to_bhsd(v, base)
    seqlens_q = _seqlens(inputs.cu_seqlens_q) if cfg.mask.is_padding else None
    seqlens_kv = _seqlens(inputs.cu_seqlens_kv) if cfg.mask.is_padding else None
    out, lse, max_logit = attention_bhsd(
        ops, cfg, q, k, v, bias=inputs.bias, alibi_slopes=inputs.alibi_slopes, sink=inputs.sink,
        seqlens_q=seqlens_q, seqlens_kv=seqlens_kv, dropout_seed=inputs.dropout_seed,
        dropout_offset=inputs.dropout_offset, score_mod=inputs.score_mod,
    )
    out = ops.astype(out, cfg.out_dtype)
    lse = ops.astype(lse, cfg.stats_dtype)
    if cfg.layout.is_ragged:
        total = inputs.q.shape[0]
        out = padded_to_thd(from_bhsd(out, "bshd"), inputs.cu_seqlens_q, total, inputs.cu_seqlens_q_padded)
        lse = padded_to_thd(ops.moveaxis(lse, 1, 2), inputs.cu_seqlens_q, total, inputs.cu_seqlens_q_padded)
    else:
        out = from_bhsd(out, base)
        if ops.name == "torch":  # contiguous in q's layout, as the fused backends return it
            out = out.contiguous()
    if not cfg.return_max_logit:  # the same contract as every backend: empty unless asked for
        max_logit = max_logit[:0]
    return AttentionOutputs(out, lse, ops.astype(max_logit, cfg.stats_dtype))


class ReferenceBackend(Backend):
    name = "reference"
    score_mod_gradient = True  # its forward is the framework's own ops: autodiff reaches the score_mod's tensors
    runs_empty_batch = True
    backward_differentiable = True  # (torch: its backward is autograd over its own forward)

    def forward(self, cfg: AttentionConfig, inputs: AttentionInputs):
        return reference_forward(cfg, inputs), None

    def backward(self, cfg, inputs, saved, outputs, grad_out, grad_lse=None) -> dict:
        # Recompute the forward under the framework's autodiff and pull the cotangents back.
        ops = namespace(inputs.q)
        primals = {name: getattr(inputs, name) for name in DIFFERENTIABLE}

        def forward(**arrays):
            result = reference_forward(cfg, inputs.replace(**arrays))
            return result.out, result.lse

        return ops.vjp(forward, primals, (grad_out, grad_lse))
