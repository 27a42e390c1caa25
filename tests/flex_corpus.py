"""A corpus of flex-style score_mods and mask_mods, each written once for torch and JAX.

Every entry is a factory `make(array, B, H, S) -> (score_mod | None, mask_mod | None)`: `array`
turns a NumPy array into the framework's own (a torch tensor or a JAX array) for the
tensors the callbacks capture. The callbacks use Python operators and the portable math of
fusedattn.score_mods only, so the same definition is traced by make_fx and by make_jaxpr.
Families follow attention-gym: softcap, ALiBi, relative position, T5 buckets, causal,
prefix-LM, sliding windows, documents, dilation, gating, padding and compositions. Every
row of every mask keeps at least its diagonal key (no empty rows), unless the entry says so.
"""

from __future__ import annotations

import numpy as np

from fusedattn import score_mods as sm

_RNG_SEED = 1234


def _rng(name: str) -> np.random.Generator:
    return np.random.default_rng([_RNG_SEED, sum(map(ord, name))])


def softcap(array, B, H, S):
    return (lambda s, b, h, q, kv: 20.0 * sm.tanh(s / 20.0)), None


def softcap_tight(array, B, H, S):
    cap = 2.0
    return (lambda s, b, h, q, kv: cap * sm.tanh(s / cap)), None


def alibi(array, B, H, S):
    slopes = array(2.0 ** (-np.arange(1, H + 1, dtype=np.float32)))
    return (lambda s, b, h, q, kv: s - slopes[h] * sm.abs(q - kv)), None


def alibi_causal(array, B, H, S):
    slopes = array(_rng("alibi_causal").uniform(0.05, 0.5, H).astype(np.float32))
    return (lambda s, b, h, q, kv: s + slopes[h] * (kv - q)), (lambda b, h, q, kv: q >= kv)


def relative_linear(array, B, H, S):
    return (lambda s, b, h, q, kv: s + (q - kv) * 0.05), None


def relative_table(array, B, H, S):
    reach = 3
    table = array(_rng("relative_table").standard_normal((H, 2 * reach + 1)).astype(np.float32))
    return (lambda s, b, h, q, kv: s + table[h, sm.clip(kv - q, -reach, reach) + reach]), None


def t5_buckets(array, B, H, S):
    buckets = 4
    table = array(_rng("t5_buckets").standard_normal((H, buckets)).astype(np.float32))
    return (lambda s, b, h, q, kv: s + table[h, sm.minimum(sm.abs(q - kv) // 2, buckets - 1)]), None


def head_bias(array, B, H, S):
    bias = array(_rng("head_bias").standard_normal(H).astype(np.float32))
    return (lambda s, b, h, q, kv: s + bias[h]), None


def query_bias(array, B, H, S):
    bias = array(_rng("query_bias").standard_normal((B, S)).astype(np.float32))
    return (lambda s, b, h, q, kv: s + bias[b, q]), None


def head_scale(array, B, H, S):
    scale = array(_rng("head_scale").uniform(0.5, 1.5, H).astype(np.float32))
    return (lambda s, b, h, q, kv: s * scale[h]), None


def head_temperature(array, B, H, S):
    temperature = array(_rng("head_temperature").uniform(0.5, 2.0, H).astype(np.float32))
    return (lambda s, b, h, q, kv: s / temperature[h]), None


def causal(array, B, H, S):
    return None, (lambda b, h, q, kv: q >= kv)


def causal_shifted(array, B, H, S):
    shift = 2  # the diagonal moved right: every query also sees the next two keys
    return None, (lambda b, h, q, kv: kv <= q + shift)


def prefix_lm(array, B, H, S):
    prefix = array(np.array([min(3, S - 1), S // 2][:B] + [1] * max(0, B - 2), dtype=np.int32))
    return None, (lambda b, h, q, kv: (kv <= prefix[b]) | (q >= kv))


def sliding_window(array, B, H, S):
    window = 3
    return None, (lambda b, h, q, kv: (q - kv <= window) & (q >= kv))


def sliding_window_both(array, B, H, S):
    return None, (lambda b, h, q, kv: sm.abs(q - kv) <= 2)


def document(array, B, H, S):
    ids = np.sort(_rng("document").integers(0, 3, (B, S)), axis=1).astype(np.int32)
    doc = array(ids)
    return None, (lambda b, h, q, kv: doc[b, q] == doc[b, kv])


def document_causal(array, B, H, S):
    ids = np.sort(_rng("document_causal").integers(0, 4, (B, S)), axis=1).astype(np.int32)
    doc = array(ids)
    return None, (lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv))


def dilated(array, B, H, S):
    return None, (lambda b, h, q, kv: ((q - kv) % 2 == 0) & (q >= kv))


def padding(array, B, H, S):
    lengths = array(np.array([max(1, S - 3)] + [S] * (B - 1), dtype=np.int32))
    return None, (lambda b, h, q, kv: kv < lengths[b])


def tanh_gated(array, B, H, S):
    return (lambda s, b, h, q, kv: s * (0.5 + 0.5 * sm.tanh(s / 4.0))), None


def leaky(array, B, H, S):
    return (lambda s, b, h, q, kv: sm.where(s > 0.0, s, 0.1 * s)), None


def clipped(array, B, H, S):
    return (lambda s, b, h, q, kv: sm.clip(s, -0.75, 0.75)), None


def softplus(array, B, H, S):
    return (lambda s, b, h, q, kv: sm.log(1.0 + sm.exp(s))), None


def block_position(array, B, H, S):
    return (lambda s, b, h, q, kv: s + (q // 4 - kv // 4) * 0.05), None


def head_parity(array, B, H, S):
    return (lambda s, b, h, q, kv: sm.where(h % 2 == 0, s, s * 0.5)), None


def softcap_causal(array, B, H, S):
    return (lambda s, b, h, q, kv: 10.0 * sm.tanh(s / 10.0)), (lambda b, h, q, kv: q >= kv)


def softcap_alibi(array, B, H, S):
    slopes = array(2.0 ** (-np.arange(1, H + 1, dtype=np.float32) / 2))

    def score_mod(s, b, h, q, kv):
        biased = s - slopes[h] * sm.abs(q - kv)
        return 5.0 * sm.tanh(biased / 5.0)

    return score_mod, None


def window_document_softcap(array, B, H, S):
    ids = np.sort(_rng("window_document_softcap").integers(0, 2, (B, S)), axis=1).astype(np.int32)
    doc = array(ids)
    return ((lambda s, b, h, q, kv: 8.0 * sm.tanh(s / 8.0)),
            (lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (q >= kv) & (q - kv <= 4)))


CORPUS = {fn.__name__: fn for fn in (
    softcap, softcap_tight, alibi, alibi_causal, relative_linear, relative_table, t5_buckets, head_bias, query_bias,
    head_scale, head_temperature, causal, causal_shifted, prefix_lm, sliding_window, sliding_window_both, document,
    document_causal, dilated, padding, tanh_gated, leaky, clipped, softplus, block_position, head_parity,
    softcap_causal, softcap_alibi, window_document_softcap,
)}
# Entries whose graph has a dense (., ., Sq, Skv) gather from a captured table.
DENSE = frozenset({"relative_table", "t5_buckets"})


def torch_array(values: np.ndarray, device: str = "cpu"):
    import torch

    return torch.as_tensor(values, device=device)


def jax_array(values: np.ndarray):
    import jax.numpy as jnp

    return jnp.asarray(values)
