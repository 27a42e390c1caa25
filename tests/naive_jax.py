"""tests/naive.py's twin in jax.numpy: a float64 naive attention for the torch-free run (.venv-notorch).

The same call and contract as tests/naive.py's naive_attention (its docstring states the semantics:
scores, bias, scale, score_mod, ALiBi, masks and diagonals, windows, sinks, dropout, max_logit, THD
offsets, rows that see no key), written again from that text, not translated, and sharing no code
with fusedattn.

How: every sequence b gets a grid of rows i (its queries) and columns j (its keys). Which pairs a mask
and a window leave visible is decided in Python, pair by pair, from the lengths and the diagonal
(`_visibility`, concrete numbers); THD tokens are gathered into the grid by their index in the packed
tensor and scattered back. Then plain jax.numpy on the (B, Hq, Sq, Skv) scores: masked entries -inf, a
softmax over each row's attended keys plus the sink term. The jax.numpy part takes the Python part's
arrays as arguments, so `value_and_grads` compiles it once per shape and reuses it (XLA compiles slowly
on CPU).

Gradients: jax.vjp / jax.grad on float64 inputs, inside `jax.enable_x64(True)` (`value_and_grads` enters
it and leaves the setting as it was). tests/test_naive_twins.py checks the twins agree.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["naive_attention", "value_and_grads", "output_shapes", "BASE_LAYOUT"]

F64 = jnp.float64
NEG_INF = -math.inf
MASKED_AT_OR_BELOW = -1e8  # a score_mod result this low masks its entry

# The layout of q (and of the output) once packed tensors are split.
BASE_LAYOUT = {
    "bshd": "bshd", "sbhd": "sbhd", "bhsd": "bhsd", "thd": "thd",
    "bs3hd": "bshd", "sb3hd": "sbhd", "t3hd": "thd",
    "bshd_bs2hd": "bshd", "sbhd_sb2hd": "sbhd", "thd_t2hd": "thd",
}
PACKED_QKV = ("bs3hd", "sb3hd", "t3hd")
PACKED_KV = ("bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd")
DIFFERENTIABLE = ("q", "k", "v", "bias", "alibi_slopes", "sink")


# ----------------------------------------------------------------------- the Python part: who sees whom

def _ints(offsets):
    """Concrete offsets (any array or list) as Python ints."""
    return [int(x) for x in np.asarray(offsets).reshape(-1)]


def _visibility(rows, cols, len_q, len_kv, *, padding, causal, bottom_right, window):
    """((rows, cols) booleans: whether query i sees key j by the mask and the window, the diagonal offset)."""
    left, right = window
    if causal:  # the causal masks see no key right of the diagonal
        right = 0
    diagonal = len_kv - len_q if bottom_right else 0  # query i's diagonal is key i + diagonal
    visible = np.zeros((rows, cols), dtype=bool)
    for i in range(rows):
        for j in range(cols):
            if padding and (i >= len_q or j >= len_kv):
                continue
            if left >= 0 and j < i + diagonal - left:
                continue
            if right >= 0 and j > i + diagonal + right:
                continue
            visible[i, j] = True
    return visible, diagonal


def _plan(layout, q_shape, k_shape, mask, window, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
          cu_seqlens_kv_padded):
    """The grid of every sequence as NumPy arrays (B rows of Sq x Skv, Sq and Skv the longest):

    visible (B, Sq, Skv); distance (B, Sq, Skv) = |i + diagonal - j| (ALiBi); is_query (B, Sq): row i is
    one of the sequence's queries (else padding: out 0, lse -inf); THD only: token_q (B, Sq) and
    token_kv (B, Skv), the index of row i / column j in the packed tensor (the tensor's length if none).
    """
    ragged = BASE_LAYOUT[layout] == "thd"
    padding = ragged or mask.startswith("padding")  # THD layouts always mask padding
    causal = "causal" in mask
    bottom_right = mask.endswith("bottom_right") or not causal  # top-left: causal and padding_causal only
    window = (-1, -1) if window is None else tuple(window)
    plan = {}
    if ragged:
        cu_q, cu_kv = _ints(cu_seqlens_q), _ints(cu_seqlens_kv)
        batch = len(cu_q) - 1
        lens_q = [cu_q[b + 1] - cu_q[b] for b in range(batch)]
        lens_kv = [cu_kv[b + 1] - cu_kv[b] for b in range(batch)]
        starts_q = _ints(cu_seqlens_q_padded) if cu_seqlens_q_padded is not None else cu_q
        starts_kv = _ints(cu_seqlens_kv_padded) if cu_seqlens_kv_padded is not None else cu_kv
        rows, cols = max(lens_q, default=0), max(lens_kv, default=0)
        plan["token_q"] = np.full((batch, rows), q_shape[0], np.int64)
        plan["token_kv"] = np.full((batch, cols), k_shape[0], np.int64)
        for b in range(batch):
            plan["token_q"][b, :lens_q[b]] = starts_q[b] + np.arange(lens_q[b])
            plan["token_kv"][b, :lens_kv[b]] = starts_kv[b] + np.arange(lens_kv[b])
    else:
        base = BASE_LAYOUT[layout]
        batch = q_shape[{"bshd": 0, "sbhd": 1, "bhsd": 0}[base]]
        seq_axis = {"bshd": 1, "sbhd": 0, "bhsd": -2}[base]  # of q/k after unpacking
        rows, cols = q_shape[seq_axis], k_shape[seq_axis]
        if padding:
            cu_q, cu_kv = _ints(cu_seqlens_q), _ints(cu_seqlens_kv)
            lens_q = [cu_q[b + 1] - cu_q[b] for b in range(batch)]
            lens_kv = [cu_kv[b + 1] - cu_kv[b] for b in range(batch)]
        else:
            lens_q, lens_kv = [rows] * batch, [cols] * batch
    plan["visible"] = np.zeros((batch, rows, cols), bool)
    plan["distance"] = np.zeros((batch, rows, cols))
    plan["is_query"] = np.zeros((batch, rows), bool)
    for b in range(batch):
        plan["visible"][b], diagonal = _visibility(rows, cols, lens_q[b], lens_kv[b], padding=padding,
                                                   causal=causal, bottom_right=bottom_right, window=window)
        plan["distance"][b] = np.abs(np.arange(rows)[:, None] + diagonal - np.arange(cols)[None, :])
        plan["is_query"][b] = np.arange(rows) < lens_q[b] if padding else True
    return plan


# ----------------------------------------------------------------------- the jax.numpy part: the math

def _unpack(layout, q, k, v):
    """(q, k, v) in the base layout; a packed tensor holds q, k, v (or k, v) on the axis just before H."""
    if layout in PACKED_QKV:
        assert k is None and v is None, f"{layout} takes one tensor"
        return q[..., 0, :, :], q[..., 1, :, :], q[..., 2, :, :]
    if layout in PACKED_KV:
        assert v is None, f"{layout} takes q and the packed kv (as k)"
        return q, k[..., 0, :, :], k[..., 1, :, :]
    return q, k, v


def _to_grid(x, base, tokens=None):
    """A tensor of `base` as (B, S, H, D): THD tokens gathered by their index (zeros for none), dense transposed."""
    if base == "thd":  # index len(x), no token, reads a row of zeros appended to x
        return jnp.concatenate([x, jnp.zeros((1, *x.shape[1:]), x.dtype)])[tokens]
    return {"bshd": x, "sbhd": jnp.swapaxes(x, 0, 1), "bhsd": jnp.swapaxes(x, 1, 2)}[base]


def _attention(arrays, plan, *, layout, bias_type, softmax_type, scale, dropout_p, score_mod):
    """(out, lse, max_logit) from the float64 arrays and the plan's NumPy (or traced) arrays."""
    base = BASE_LAYOUT[layout]
    q, k, v = _unpack(layout, arrays["q"], arrays.get("k"), arrays.get("v"))
    q = _to_grid(q, base, plan.get("token_q"))  # (B, Sq, Hq, D)
    k, v = _to_grid(k, base, plan.get("token_kv")), _to_grid(v, base, plan.get("token_kv"))  # (B, Skv, Hkv, .)
    heads_q, heads_kv, head_dim = q.shape[2], k.shape[2], q.shape[3]
    assert heads_q % heads_kv == 0, (heads_q, heads_kv)
    kv_head = np.arange(heads_q) // (heads_q // heads_kv)  # the k/v head query head h reads (GQA, MQA)
    k, v = k[:, :, kv_head], v[:, :, kv_head]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    batch, rows, cols = plan["visible"].shape
    bias = arrays.get("bias")
    if bias is not None:  # broadcast from the right to (B, Hq, Sq, Skv)
        bias = jnp.broadcast_to(bias.reshape((1,) * (4 - bias.ndim) + bias.shape), (batch, heads_q, rows, cols))

    s = jnp.einsum("bihd,bjhd->bhij", q, k)  # (B, Hq, Sq, Skv)
    if bias is not None and bias_type == "pre_scale":
        s = s + bias
    s = s * scale
    if score_mod is not None:  # called with one (b, h) at a time, as the contract says; q_idx, kv_idx positions
        q_idx, kv_idx = jnp.arange(rows).reshape(rows, 1), jnp.arange(cols).reshape(1, cols)

        def one(s_bh, b, h):
            return jnp.broadcast_to(score_mod(s_bh, b, h, q_idx, kv_idx), (rows, cols)).astype(F64)

        by_head = jax.vmap(one, in_axes=(0, None, 0))
        s = jax.vmap(by_head, in_axes=(0, 0, None))(s, jnp.arange(batch), jnp.arange(heads_q))
        s = jnp.where(s <= MASKED_AT_OR_BELOW, NEG_INF, s)
    if bias is not None and bias_type != "pre_scale":  # post_scale, the default
        s = s + bias
    slopes = arrays.get("alibi_slopes")
    if slopes is not None:  # (Hq,) or (B, Hq)
        s = s - slopes.reshape((-1, heads_q, 1, 1)) * jnp.asarray(plan["distance"])[:, None]

    # The keys a row attends: visible by the masks and not masked by the score_mod (a score of -inf).
    attended = jnp.asarray(plan["visible"])[:, None] & (s != NEG_INF)
    logits = jnp.where(attended, s, NEG_INF)
    max_logit = jnp.max(jax.lax.stop_gradient(logits), axis=(0, 2, 3), initial=NEG_INF)  # (Hq,)

    # lse = log(sum of exp(logit) over the attended keys + the sink term); a row with no term: -inf.
    peak = jnp.max(jax.lax.stop_gradient(logits), axis=3, initial=NEG_INF)  # (B, Hq, Sq): for stability only
    has_term = jnp.any(attended, axis=3)
    if softmax_type == "vanilla":
        sink = None
    else:
        sink = jnp.zeros(heads_q, F64) if softmax_type == "off_by_one" else arrays["sink"].reshape(heads_q)
        sink = sink.reshape(1, heads_q, 1)
        peak = jnp.maximum(peak, jax.lax.stop_gradient(sink))
        has_term = jnp.ones_like(has_term)  # the sink term is in every row
    peak = jnp.where(has_term, peak, 0.0)
    total = jnp.sum(jnp.exp(logits - peak[..., None]), axis=3)
    if sink is not None:
        total = total + jnp.exp(sink - peak)
    lse = jnp.where(has_term, jnp.log(jnp.where(has_term, total, 1.0)) + peak, NEG_INF)
    weights = jnp.exp(logits - jnp.where(has_term, lse, 0.0)[..., None])  # 0 off the attended keys
    if "dropout_keep" in plan:
        weights = weights * jnp.asarray(plan["dropout_keep"])[:, :, :rows, :cols].astype(F64) / (1.0 - dropout_p)
    out = jnp.einsum("bhij,bjhd->bihd", weights, v)  # (B, Sq, Hq, Dv)

    is_query = jnp.asarray(plan["is_query"])  # padding rows: out 0, lse -inf (even with a sink)
    out = jnp.where(is_query[:, :, None, None], out, 0.0)
    lse = jnp.where(is_query[:, None, :], lse, NEG_INF)
    if base != "thd":
        out = {"bshd": out, "sbhd": jnp.swapaxes(out, 0, 1), "bhsd": jnp.swapaxes(out, 1, 2)}[base]
        return out, lse, max_logit
    # THD: each row back to its token; tokens outside every sequence: out 0, lse 0.
    tokens = plan["token_q"].reshape(-1)
    length = arrays["q"].shape[0]
    out_thd = jnp.zeros((length, heads_q, out.shape[-1]), F64)
    out_thd = out_thd.at[tokens].set(out.reshape(-1, heads_q, out.shape[-1]), mode="drop")
    lse_thd = jnp.zeros((length, heads_q), F64).at[tokens].set(jnp.swapaxes(lse, 1, 2).reshape(-1, heads_q),
                                                                mode="drop")
    return out_thd, lse_thd, max_logit


# ----------------------------------------------------------------------- the entry points

def _prepare(q, k, v, *, layout, mask, window, bias_type, softmax_type, scale, cu_seqlens_q, cu_seqlens_kv,
             cu_seqlens_q_padded, cu_seqlens_kv_padded, dropout_keep, dropout_p, score_mod, **arrays):
    """(arrays, plan, static options) of a naive_attention call."""
    q_shape, k_shape = jax.eval_shape(lambda q, k, v: _unpack(layout, q, k, v)[:2], q, k, v)
    plan = _plan(layout, q_shape.shape, k_shape.shape, mask, window, cu_seqlens_q, cu_seqlens_kv,
                 cu_seqlens_q_padded, cu_seqlens_kv_padded)
    if dropout_keep is not None:
        plan["dropout_keep"] = np.asarray(dropout_keep, bool)
    arrays = {name: x for name, x in dict(q=q, k=k, v=v, **arrays).items() if x is not None}
    static = dict(layout=layout, bias_type=bias_type, softmax_type=softmax_type, scale=scale, dropout_p=dropout_p,
                  score_mod=score_mod)
    return arrays, plan, static


def naive_attention(q, k=None, v=None, *, layout="bshd", mask="none", window=(-1, -1), bias=None,
                    bias_type="post_scale", alibi_slopes=None, softmax_type="vanilla", sink=None,
                    scale=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                    cu_seqlens_kv_padded=None, dropout_keep=None, dropout_p=0.0, score_mod=None):
    """(out, lse, max_logit) of attention on float64 arrays in `layout`'s shapes (tests/naive.py's contract).

    out in q's base layout (..., Hq, Dv); lse (B, Hq, Sq), or (Tq, Hq) for THD; max_logit (Hq,), no gradient.
    dropout_keep: boolean (B, Hq, Sq, Skv) (the longest sequences for THD), with dropout_p. Offsets and
    dropout_keep must be concrete; the float arrays may be traced (jax.jit, jax.vjp).
    """
    for name, x in dict(q=q, k=k, v=v, bias=bias, alibi_slopes=alibi_slopes, sink=sink).items():
        assert x is None or x.dtype == F64, f"naive_attention takes float64 arrays (under jax.enable_x64): {name}"
    arrays, plan, static = _prepare(
        q, k, v, layout=layout, mask=mask, window=window, bias_type=bias_type, softmax_type=softmax_type,
        scale=scale, cu_seqlens_q=cu_seqlens_q, cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
        cu_seqlens_kv_padded=cu_seqlens_kv_padded, dropout_keep=dropout_keep, dropout_p=dropout_p,
        score_mod=score_mod, bias=bias, alibi_slopes=alibi_slopes, sink=sink)
    return _attention(arrays, plan, **static)


def _value_and_pullback(arrays, plan, g_out, g_lse, **static):
    """out, lse, max_logit and, with g_out, the gradients."""
    (out, lse, max_logit), pullback = jax.vjp(lambda a: _attention(a, plan, **static), arrays)
    if g_out is None:
        return out, lse, max_logit, None
    g_lse = jnp.where(jnp.isfinite(lse), g_lse, 0.0)  # the loss reads only the finite lse
    return out, lse, max_logit, pullback((g_out, g_lse, jnp.zeros_like(max_logit)))[0]


# XLA's CPU compiler takes about 0.6 s for one call's program by default and 0.1 s with these options (no
# fusion emitters, no LLVM optimization): the naive runs once per test case, so compiling is its whole cost.
# They change how the code is generated, not what it computes (IEEE float64 either way).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


@functools.cache
def _compiled_run():
    """_value_and_pullback under jax.jit on the CPU, compiled once per shape and options; FAST_COMPILE when
    this jaxlib knows its options."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=FAST_COMPILE).lower(np.float32(0)).compile()
        options = FAST_COMPILE
    except Exception:  # noqa: BLE001 (an option this jaxlib does not have: compile as usual)
        options = None
    return jax.jit(_value_and_pullback, static_argnames=("layout", "bias_type", "softmax_type", "scale",
                                                         "dropout_p", "score_mod"), compiler_options=options)


def output_shapes(layout, arrays):
    """(out shape, lse shape) of naive_attention on `arrays` (q, k, v by keyword, any dtype) in `layout`."""
    q, _, v = jax.eval_shape(lambda a: _unpack(layout, a["q"], a.get("k"), a.get("v")), arrays)
    base = BASE_LAYOUT[layout]
    out = (*q.shape[:-1], v.shape[-1])
    batch_seq_heads = {"bshd": (0, 1, 2), "sbhd": (1, 0, 2), "bhsd": (0, 2, 1)}
    if base == "thd":
        return out, q.shape[:2]  # (Tq, Hq)
    b, s, h = (q.shape[axis] for axis in batch_seq_heads[base])
    return out, (b, h, s)


def value_and_grads(arrays, g_out=None, g_lse=None, **call):
    """(out, lse, max_logit, grads) of naive_attention(**arrays, **call) in float64, as NumPy arrays.

    arrays: the differentiable inputs by keyword (q, k, v, bias, alibi_slopes, sink: any float dtype, taken
    as float64); call: the other keywords, concrete. grads (None without g_out): by array name, the gradient
    of sum(out * g_out) + sum(lse * g_lse over the finite lse).
    """
    assert set(arrays) <= set(DIFFERENTIABLE), sorted(arrays)
    keywords = dict(layout="bshd", mask="none", window=(-1, -1), bias_type="post_scale", softmax_type="vanilla",
                    scale=None, cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None,
                    cu_seqlens_kv_padded=None, dropout_keep=None, dropout_p=0.0, score_mod=None)
    keywords.update(call)
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True), jax.default_device(cpu):
        as_f64 = {name: jnp.asarray(np.asarray(x, dtype=np.float64)) for name, x in arrays.items()}
        as_f64, plan, static = _prepare(**{"k": None, "v": None, **as_f64}, **keywords)
        cotangents = [None if g is None else jnp.asarray(np.asarray(g, dtype=np.float64)) for g in (g_out, g_lse)]
        out, lse, max_logit, grads = jax.device_get(_compiled_run()(as_f64, plan, *cotangents, **static))
    return out, lse, max_logit, grads
