"""`dot_product_attention`: `jax.nn.dot_product_attention`'s signature and semantics, run by fusedattn.

A thin translation into `fusedattn.jax.attention` keywords: causal masks, windows and sequence
lengths become the native mask/window/padding where fusedattn spells them the same way; boolean
masks (and windows it cannot spell) become an additive bias in q's dtype.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.checks import check_scale, number_from_array
from fusedattn.jax.functional import _is_torch, _type_name, attention

__all__ = ["dot_product_attention"]

API = "fusedattn.jax.dot_product_attention"

# implementation= (jax.nn's names) -> fusedattn backend= (None: our selection).
_IMPLEMENTATIONS = {None: None, "xla": "reference", "cudnn": "cudnn"}


def _error(name: str, expected: str, got) -> ValueError:
    return ValueError(f"{API}: {name}: expected {expected}, got {got}")


def _as_4d(x, name: str):
    """jax.nn's rule: arrays of rank < 4 gain leading unit axes; rank > 4 is refused."""
    if _is_torch(x) or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise _error(name, "a JAX array", _type_name(x))
    x = jnp.asarray(x)
    if x.ndim > 4:
        raise _error(name, "a 4-D array (or fewer dimensions, padded on the left)", f"shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _lengths(x, name: str, batch: int, limit: int):
    """(B,) int32 lengths clipped to [0, limit] (beyond the array, jax.nn masks nothing more)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.shape != (batch,) or x.dtype != jnp.int32:
        raise _error(name, f"an int32 array of shape ({batch},)", f"shape {x.shape}, dtype {x.dtype}")
    return jnp.clip(x, 0, limit)


def _cu_seqlens(lengths, batch: int, full: int):
    lengths = jnp.full((batch,), full, jnp.int32) if lengths is None else lengths
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths, dtype=jnp.int32)])


def _window_size(size) -> int | None:
    """size as a Python int if it is an integer scalar (int, NumPy integer, concrete 0-d JAX integer array)."""
    if isinstance(size, bool | np.bool_):  # ints to Python, yet no window size
        return None
    try:
        return operator.index(size)  # NumPy and JAX define it for integer scalars only; tracers raise
    except TypeError:
        return None


def _window(local_window_size):
    """(left, right) Python ints, or None; it shapes the mask, so it must be known when tracing."""
    if local_window_size is None:
        return None
    is_pair = isinstance(local_window_size, tuple | list)
    sizes = tuple(local_window_size) if is_pair else (local_window_size,)
    if any(isinstance(w, jax.core.Tracer) for w in sizes):
        raise _error("local_window_size", "a value known when tracing (it shapes the mask)",
                     "a traced value; mark it static in jax.jit (static_argnames)")
    ints = tuple(_window_size(w) for w in sizes)
    if None not in ints and len(ints) == (2 if is_pair else 1):
        return ints if is_pair else ints * 2
    raise _error("local_window_size", "an int or a (left, right) pair of ints (Python or NumPy integers, "
                 "or concrete JAX integer scalars)", repr(local_window_size))


def _check_broadcast(x, name: str, full: tuple[int, int, int, int]):
    if x is not None and any(n not in (1, f) for n, f in zip(x.shape, full)):
        raise _error(name, f"a shape broadcastable to (B, N, T, S) = {full}", f"shape {x.shape}")


def _translate(is_causal: bool, window, padded: bool, sq: int, skv: int):
    """(mask name, native window or None, window left to a bias or None) for jax.nn's top-left rules."""
    causal, native, leftover = is_causal, None, None
    if window is not None:
        left, right = window
        if left >= 0 and right >= 0 and (is_causal or right == 0):
            # jax.nn's window ANDs with its causal mask; right=0 is itself causal (j <= i).
            causal, native = True, (left, 0)
        elif not is_causal and not padded and min(left + skv - sq, right - skv + sq) >= 0:
            # fusedattn aligns non-causal windows bottom-right (j - i shifted by Skv - Sq).
            native = (left + skv - sq, right - skv + sq)
        else:  # negative sizes, or per-sequence bottom-right alignment under padding: spell it as a mask
            leftover = window
    mask = {(False, False): "none", (True, False): "causal", (False, True): "padding",
            (True, True): "padding_causal"}[(causal, padded)]
    return mask, native, leftover


def _structure(is_causal: bool, window, sq: int, skv: int) -> np.ndarray | None:
    """(Sq, Skv) keys visible under jax.nn's causal mask and window (top-left), or None for all."""
    if not is_causal and window is None:
        return None
    i, j = np.arange(sq)[:, None], np.arange(skv)[None, :]
    visible = np.ones((sq, skv), bool)
    if is_causal:
        visible &= j <= i
    if window is not None:
        visible &= (i - window[0] <= j) & (j <= i + window[1])
    return visible


def _empty_rows(mask, structure, kv_lengths, q_lengths, sq: int, skv: int):
    """(B|1, Sq, N|1) rows that are queries yet see no key, or None when there are none by construction.

    jax.nn gives such rows the mean of v over all Skv keys (every logit equals its large negative);
    fusedattn gives 0. Rows past query_seq_lengths are 0 in both."""
    if mask is None and kv_lengths is None and (structure is None or structure.any(-1).all()):
        return None
    if mask is None:  # intervals per row, no (Sq, Skv) array per batch
        first = np.where(structure.any(-1), structure.argmax(-1), skv) if structure is not None else np.zeros(sq, int)
        empty = jnp.asarray(first >= skv)[None, :]
        if kv_lengths is not None:
            empty = empty | (jnp.asarray(first)[None, :] >= kv_lengths[:, None])
        empty = empty[:, :, None]
    else:
        visible = mask if structure is None else mask & jnp.asarray(structure)
        if kv_lengths is not None:
            visible = visible & (jnp.arange(skv)[None, None, None, :] < kv_lengths[:, None, None, None])
        empty = jnp.transpose(~jnp.any(visible, axis=-1), (0, 2, 1))
    if q_lengths is not None:
        empty = empty & (jnp.arange(sq)[None, :, None] < q_lengths[:, None, None])
    return empty


# The logit jax.nn gives a masked position (-0.7 * float32's largest value): its residual's value in rows
# that see no key.
_MASKED_LOGIT = -0.7 * float(np.finfo(np.float32).max)


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                          implementation=None, return_residual=False):
    """`jax.nn.dot_product_attention`, run by fusedattn: same arguments, same results.

    Args:
        query: (B, T, N, H) or (T, N, H).
        key, value: (B, S, K, H) or (S, K, H), K dividing N (GQA/MQA); value's shape and all
            three dtypes equal.
        bias: added to the scaled logits (`q kᵀ * scale + bias`), broadcastable to (B, N, T, S)
            (fewer dimensions gain leading unit axes); cast to query's dtype (jax.nn adds it in
            float32), with a gradient.
        mask: boolean, True = takes part, broadcastable to (B, N, T, S).
        scale: multiplies `q kᵀ`; default 1/sqrt(H). A number, or a concrete 0-d array (1 / jnp.sqrt(H),
            read once per call); under jit it must be static (a traced scale raises). Zero or negative
            scales raise, as in fusedattn.jax.attention (jax.nn takes them).
        is_causal: query i sees keys j <= i (top-left diagonal, also when T != S).
        query_seq_lengths, key_value_seq_lengths: (B,) int32; rows past a query length give 0,
            keys past a key length are masked.
        local_window_size: int w (= (w, w)) or (left, right): query i sees keys
            i - left <= j <= i + right (top-left diagonal, as jax.nn; ANDed with is_causal).
            Python or NumPy integers, or concrete JAX integer scalars; not traced values.
        implementation: None: fusedattn selects the backend (cuDNN on a GPU, the reference on
            CPU); 'xla': fusedattn's jax.numpy reference (plain XLA math, no custom call);
            'cudnn': the cudnn backend forced (raises with its reasons where it cannot run, as
            jax.nn raises for shapes cuDNN refuses).
        return_residual: also return the log-sum-exp of the scaled logits, (B, T, N) (or (T, N)),
            in query's dtype, as jax.nn does (taken in float32, then cast): rows without a visible
            key or past a query length hold -0.7 * float32's largest value, jax.nn's masked logit
            (-inf in float16, as in jax.nn). Like jax.nn's, it passes no gradient.

    Rows that see no key (fully masked, or a key length of 0) give the mean of value over all
    S keys, as jax.nn does (its masked logits all equal one large negative number), with the
    matching gradients; rows past a query length give 0. Causal masks, windows and lengths run
    as fusedattn's native masks where they align; boolean masks become an additive bias.

    Returns:
        An array of query's shape; with return_residual, (that array, the residual).

    Example:
        >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 128, 8, 64))
        >>> out = dot_product_attention(q, k, v, is_causal=True, local_window_size=(32, 0))
    """
    if implementation not in _IMPLEMENTATIONS:
        raise _error("implementation", "None, 'xla' or 'cudnn'", repr(implementation))
    scale = number_from_array(scale, f"{API}: scale")  # (1 / jnp.sqrt(d), as jax.nn takes it)
    try:
        check_scale(scale)
    except ValueError as error:
        raise ValueError(f"{API}: {error}") from None
    out_shape = getattr(query, "shape", None)
    q, k, v = (_as_4d(x, name) for x, name in ((query, "query"), (key, "key"), (value, "value")))
    batch, skv, heads_kv, dim = k.shape
    if v.shape != k.shape or v.dtype != k.dtype:
        raise _error("value", f"key's shape {k.shape} and dtype {k.dtype}", f"shape {v.shape}, dtype {v.dtype}")
    if q.shape[0] != batch or q.shape[3] != dim or q.dtype != k.dtype:
        raise _error("query", f"shape ({batch}, T, N, {dim}) and dtype {k.dtype} like key",
                     f"shape {q.shape}, dtype {q.dtype}")
    sq, heads = q.shape[1], q.shape[2]
    if (heads_kv == 0 and heads) or (heads_kv and heads % heads_kv):
        raise _error("query", f"a number of heads N that is a multiple of key's K={heads_kv}", f"N={heads}")
    full = (batch, heads, sq, skv)
    if bias is not None:
        bias = _as_4d(bias, "bias")
        _check_broadcast(bias, "bias", full)
    if mask is not None:
        mask = _as_4d(mask, "mask")
        if mask.dtype != jnp.bool_:
            raise _error("mask", "a boolean array (True = takes part); pass additive masks as bias",
                         f"dtype {mask.dtype}")
        _check_broadcast(mask, "mask", full)
    q_lengths = _lengths(query_seq_lengths, "query_seq_lengths", batch, sq)
    kv_lengths = _lengths(key_value_seq_lengths, "key_value_seq_lengths", batch, skv)
    window = _window(local_window_size)
    padded = q_lengths is not None or kv_lengths is not None
    if batch == 0 or sq == 0 or heads == 0:  # nothing to compute (every argument checked): jax.nn answers empty
        out = jnp.zeros(out_shape, q.dtype)
        return (out, jnp.zeros((*out_shape[:-1],), q.dtype)) if return_residual else out

    mask_name, native_window, leftover = _translate(bool(is_causal), window, padded, sq, skv)
    if leftover is not None:
        extra = jnp.asarray(_structure(False, leftover, sq, skv))[None, None]
        mask = extra if mask is None else mask & extra
    if mask is not None:
        # -inf where masked: fusedattn gives rows with no visible key 0 and no NaN; fixed up below.
        base = jnp.zeros((), q.dtype) if bias is None else bias.astype(q.dtype)
        bias = jnp.where(mask, base, jnp.array(-jnp.inf, q.dtype))
    if bias is not None:
        bias = jnp.broadcast_to(bias.astype(q.dtype), (*bias.shape[:2], sq, skv))

    out = attention(q, k, v, layout="bshd", mask=mask_name, window=native_window, bias=bias, scale=scale,
                    cu_seqlens_q=_cu_seqlens(q_lengths, batch, sq) if padded else None,
                    cu_seqlens_kv=_cu_seqlens(kv_lengths, batch, skv) if padded else None,
                    backend=_IMPLEMENTATIONS[implementation], return_lse=bool(return_residual))
    residual = None
    if return_residual:
        out, lse = out.out, out.lse
        # No gradient through it, as jax.nn gives none: a loss that reads it trains the same after the switch.
        lse = jax.lax.stop_gradient(lse)
        residual = jnp.where(jnp.isfinite(lse), lse, jnp.float32(_MASKED_LOGIT)).transpose(0, 2, 1)
        residual = residual.astype(q.dtype)  # jax.nn casts its float32 log-sum-exp to the inputs' dtype
        residual = residual.reshape((*out_shape[:-1],))  # (B, T, N), or (T, N) for 3-D inputs

    empty = _empty_rows(mask, _structure(bool(is_causal), window, sq, skv), kv_lengths, q_lengths, sq, skv)
    if empty is not None:
        # Summed in float32 at least (bfloat16 loses keys), in float64 for float64 inputs.
        mean = jnp.mean(v.astype(jnp.promote_types(v.dtype, jnp.float32)), axis=1).astype(out.dtype)  # (B, K, H)
        mean = jnp.repeat(mean, heads // heads_kv, axis=1)[:, None]  # (B, 1, N, H)
        out = jnp.where(empty[..., None], mean, out)
    out = out.reshape(out_shape)
    return out if residual is None else (out, residual)
