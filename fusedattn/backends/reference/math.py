"""Unfused attention on (B, H, S, D) arrays, written once for torch and JAX.

Accumulates in float32 (float64 for float64 inputs). Every feature of the config
is applied to the materialised score matrix, in this order:
    s = q k^T;  pre_scale bias;  * scale;  score_mod;  post_scale bias or ALiBi;  masks;
    softmax (with an optional sink logit in the denominator);  dropout;  @ v.
"""

from __future__ import annotations

from fusedattn.config import UNBOUNDED, AttentionConfig, BiasType, SoftmaxType
from fusedattn.score_mods.core import apply_eager

NEG_INF = float("-inf")


def compute_dtype(ops, x) -> str:
    return "float64" if ops.dtype_name(x) == "float64" else "float32"


def _index(ops, n: int, axis: int, like):
    """arange(n) shaped to broadcast along `axis` of a 4-D (B, H, Sq, Skv) array."""
    shape = [1, 1, 1, 1]
    shape[axis] = n
    return ops.reshape(ops.arange(n, like=like, dtype="int32"), shape)


def _lengths(ops, seqlens, default: int, like):
    """Per-batch lengths as (B|1, 1, 1, 1) integers."""
    if seqlens is None:
        return ops.full((1, 1, 1, 1), default, like, "int32")
    return ops.reshape(ops.astype(seqlens, "int32"), (-1, 1, 1, 1))


def visible_keys(ops, cfg: AttentionConfig, q_idx, kv_idx, len_q, len_kv):
    """Boolean (B|1, 1, Sq, Skv) of the keys each query may see, or None when all are."""
    visible = None

    def both(a, b):
        return b if a is None else ops.logical_and(a, b)

    if cfg.mask.is_padding:
        visible = both(visible, ops.logical_and(q_idx < len_q, kv_idx < len_kv))
    left, right = cfg.window
    if left != UNBOUNDED or right != UNBOUNDED:
        diagonal = q_idx + (len_kv - len_q if cfg.diagonal_bottom_right else 0)
        if right != UNBOUNDED:
            visible = both(visible, kv_idx <= diagonal + right)
        if left != UNBOUNDED:
            visible = both(visible, kv_idx >= diagonal - left)
    return visible


def alibi_bias(ops, cfg: AttentionConfig, slopes, q_idx, kv_idx, len_q, len_kv, dtype: str):
    """-slope * |query's diagonal position - key position|, aligned like the mask's diagonal."""
    slopes = ops.astype(slopes, dtype)
    slopes = ops.reshape(slopes, (-1 if len(slopes.shape) == 2 else 1, slopes.shape[-1], 1, 1))
    diagonal = q_idx + (len_kv - len_q if cfg.diagonal_bottom_right else 0)
    return -slopes * ops.astype(ops.abs(diagonal - kv_idx), dtype)


def dropout_keep(ops, seed, offset, shape, p: float):
    """Keep-mask of `shape` from a counter hash of (seed, offset, b, h, i, j).

    The same (seed, offset) gives the same mask in forward and backward and in
    torch and JAX. Other backends use their own generators: masks differ between
    backends, not between passes.
    """
    def mix(x):
        x = ops.u32_xor(x, ops.u32_shr(x, 16))
        x = ops.u32_mul(x, 0x7FEB352D)
        x = ops.u32_xor(x, ops.u32_shr(x, 15))
        x = ops.u32_mul(x, 0x2C1B3C6D)
        return ops.u32_xor(x, ops.u32_shr(x, 16))

    x = mix(ops.u32_add(ops.u32(seed), 0x5BD1E995))
    x = mix(ops.u32_xor(x, ops.u32(offset)))
    for axis, n in enumerate(shape):
        x = mix(ops.u32_xor(x, ops.u32(_index(ops, n, axis, like=seed))))
    return ops.u32_to_unit_float(x) >= p


def attention_bhsd(ops, cfg: AttentionConfig, q, k, v, *, bias=None, alibi_slopes=None, sink=None,
                   seqlens_q=None, seqlens_kv=None, dropout_seed=None, dropout_offset=None,
                   score_mod=None):
    """Attention of q (B, Hq, Sq, D), k (B, Hkv, Skv, D), v (B, Hkv, Skv, Dv).

    Returns (out (B, Hq, Sq, Dv), lse (B, Hq, Sq), max_logit (Hq,)) in the compute dtype.
    Rows that see no key give out 0 and lse -inf (log of the sink term with a sink).
    """
    dtype = compute_dtype(ops, q)
    q, k, v = (ops.astype(x, dtype) for x in (q, k, v))
    batch, heads, seqlen_q, _ = q.shape
    seqlen_kv = k.shape[2]
    if cfg.gqa_group > 1:
        k, v = ops.repeat(k, cfg.gqa_group, axis=1), ops.repeat(v, cfg.gqa_group, axis=1)

    q_idx, kv_idx = _index(ops, seqlen_q, 2, q), _index(ops, seqlen_kv, 3, q)
    len_q = _lengths(ops, seqlens_q, seqlen_q, q)
    len_kv = _lengths(ops, seqlens_kv, seqlen_kv, q)
    if seqlens_q is not None or seqlens_kv is not None:
        # Positions past each sequence's end are read as 0, as the fused kernels never load them: an
        # uninitialised cache tail (NaN, inf) there must not reach a visible row through 0 * NaN.
        q = ops.where(q_idx < len_q, q, 0)
        keys_within = _index(ops, seqlen_kv, 2, q) < len_kv
        k, v = ops.where(keys_within, k, 0), ops.where(keys_within, v, 0)

    s = ops.einsum("bhqd,bhkd->bhqk", q, k)
    if cfg.bias is BiasType.PRE_SCALE:
        s = s + ops.astype(bias, dtype)
    s = s * cfg.scale
    if score_mod is not None:  # a BoundScoreMod; it sees the scaled score, as in cuDNN
        b_idx, h_idx = _index(ops, batch, 0, q), _index(ops, heads, 1, q)
        s = apply_eager(ops, score_mod, s, b_idx, h_idx, q_idx, kv_idx, dtype)
    if cfg.bias is BiasType.POST_SCALE:
        s = s + ops.astype(bias, dtype)
    elif cfg.bias is BiasType.ALIBI:
        s = s + alibi_bias(ops, cfg, alibi_slopes, q_idx, kv_idx, len_q, len_kv, dtype)
    visible = visible_keys(ops, cfg, q_idx, kv_idx, len_q, len_kv)
    if visible is not None:
        s = ops.where(visible, s, NEG_INF)

    # max_logit: per head over every visible score of every sequence (no gradient).
    if seqlen_q * seqlen_kv * batch:
        max_logit = ops.stop_gradient(ops.amax(s, axis=(0, 2, 3)))
    else:
        max_logit = ops.full((heads,), NEG_INF, q, dtype)

    sink_logit = None
    if cfg.softmax is SoftmaxType.LEARNABLE:
        sink_logit = ops.reshape(ops.astype(sink, dtype), (1, heads, 1, 1))
    elif cfg.softmax is SoftmaxType.OFF_BY_ONE:
        sink_logit = ops.full((1, heads, 1, 1), 0.0, q, dtype)

    # The row max only stabilises exp; the result does not depend on it, so no gradient.
    if seqlen_kv:
        m = ops.stop_gradient(ops.amax(s, axis=-1, keepdims=True))
    else:
        m = ops.full((batch, heads, seqlen_q, 1), NEG_INF, q, dtype)
    if sink_logit is not None:
        m = ops.maximum(m, ops.stop_gradient(sink_logit))
    m = ops.where(ops.isfinite(m), m, 0.0)
    e = ops.exp(s - m)
    denominator = ops.sum(e, axis=-1, keepdims=True)
    if sink_logit is not None:
        denominator = denominator + ops.exp(sink_logit - m)
    has_mass = ~(denominator <= 0)  # (a NaN, from a NaN input or sink, has mass: it propagates)
    safe = ops.where(has_mass, denominator, 1.0)
    p = e / safe
    lse = ops.where(has_mass, ops.log(safe) + m, NEG_INF)
    if seqlens_q is not None:
        # Rows past a sequence's end are not queries: no output, no sink mass, lse -inf.
        is_query = q_idx < len_q
        p = ops.where(is_query, p, 0.0)
        lse = ops.where(is_query, lse, NEG_INF)
    lse = lse[..., 0]

    if cfg.dropout_p > 0.0:
        keep = dropout_keep(ops, dropout_seed, dropout_offset, p.shape, cfg.dropout_p)
        p = ops.where(keep, p * (1.0 / (1.0 - cfg.dropout_p)), 0.0)
    out = ops.einsum("bhqk,bhkd->bhqd", p, v)
    return out, lse, max_logit
