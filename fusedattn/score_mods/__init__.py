"""score_mod: rewrite attention scores inside the fused kernel (flex attention).

    attention(q, k, v, score_mod=lambda score, b, h, q_idx, kv_idx: 30 * tanh(score / 30))
    attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx)
    attention(q, k, v, score_mod=softcap(30.0))
    attention(q, k, v, score_mod=my_mod, score_mod_tensors={"scale": 0.5, "table": t})

A flex-style score_mod(score, b, h, q_idx, kv_idx) or mask_mod(b, h, q_idx, kv_idx), in
torch or jax.numpy (or this package's portable math: tanh, exp, where, minimum, ...), is
traced and lowered (see flex.py); its derivative is derived. The expert form, a callback
`score_mod(graph, score, tensors) -> tensor`, builds cuDNN graph ops on the
scaled score (B, Hq, Sq, Skv) (see the README for the op list and graph_ops for helpers);
`score_mod_bprop(graph, dscore, tensors)` gives its derivative when it is not additive.
The reference backend runs the same callbacks eagerly. `eager(fn)` wraps a
FlexAttention-style fn(score, b, h, q_idx, kv_idx) for the reference backend only.
"""

from fusedattn.score_mods.builtins import (
    additive_bias,
    alibi,
    causal,
    clamp,
    compose,
    document_mask,
    relative_position_bias,
    sliding_window,
    softcap,
)
from fusedattn.score_mods.core import MASKED, ScoreMod, eager
from fusedattn.score_mods.graph_ops import both, col_index, compare, data_type, keep_where, row_index
from fusedattn.score_mods.portable import abs, ceil, clip, exp, floor, log, maximum, minimum, sigmoid, sqrt, tanh, where

__all__ = ["ScoreMod", "eager", "MASKED", "softcap", "clamp", "causal", "sliding_window", "alibi",
           "relative_position_bias", "additive_bias", "document_mask", "compose", "row_index", "col_index",
           "compare", "both", "keep_where", "data_type",
           # portable math for flex-style callbacks (torch and JAX alike)
           "tanh", "exp", "log", "sqrt", "abs", "sigmoid", "where", "minimum", "maximum", "floor", "ceil", "clip"]
