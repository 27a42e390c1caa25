"""fusedattn.jax.attention on CPU (the reference backend) against the float64 naive attention.

Every case checks the forward (out, lse, max_logit) and every gradient (q, k, v or the
packed tensors, bias, ALiBi slopes, sink) against a float64 naive attention, on fresh random
inputs from fixed jax.random keys: `tests/naive.py` (torch, gradients by torch autograd) where
torch is installed, else its twin `tests/naive_jax.py` (jax.numpy, gradients by jax.vjp), which
tests/test_naive_twins.py checks against it. So the comparisons run in `make test`'s
torch-free .venv-notorch too. Every call is proven to run on the reference backend, forward
and backward (STYLE 17).

JAX runs op by op very slowly on CPU (each primitive compiles), so the comparisons run
under `jax.jit` with the offsets closed over (concrete, so the frontend still checks
their values); the eager path and traced offsets have their own tests.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from needs_torch import HAS_TORCH, requires_torch  # noqa: E402

import fusedattn  # noqa: E402
import fusedattn.jax as fj  # noqa: E402
from fusedattn import score_mods  # noqa: E402
from fusedattn.backends import BACKENDS  # noqa: E402
from fusedattn.backends.reference.math import dropout_keep  # noqa: E402
from fusedattn.xp.jax_ops import OPS as JAX_OPS  # noqa: E402

try:
    import naive_jax
except ImportError:  # tests/ collected as a package
    from tests import naive_jax

if HAS_TORCH:  # the torch naive (the ground truth, preferred where it runs) and the torch frontend
    import torch

    import fusedattn.torch as ft

    try:
        from naive import naive_attention
    except ImportError:  # tests/ collected as a package
        from tests.naive import naive_attention

needs_torch_frontend = requires_torch("compares with the torch frontend")

pytestmark = pytest.mark.usefixtures("fresh_selection")

F32 = jnp.float32
DIFFERENTIABLE = ("q", "k", "v", "bias", "alibi_slopes", "sink")
NAIVE_OPTIONS = ("mask", "window", "bias_type", "softmax_type", "scale")
RTOL = 1e-5  # float32 against float64


# ----------------------------------------------------------------------------- helpers

_POOL = 1 << 14
_draw = jax.jit(lambda key: jax.random.normal(key, (_POOL,), F32))


def rand(seed: int, shape, dtype=F32, scale: float = 1.0):
    """Standard normal values from jax.random.key(seed) (one compiled draw, sliced on the host)."""
    n = math.prod(shape)
    assert n <= _POOL, f"test shape {shape} too large for the pool"
    x = np.asarray(_draw(jax.random.key(seed)))[:n].reshape(shape) * scale
    return jnp.asarray(x, dtype=dtype)


def i32(values):
    return jnp.asarray(np.asarray(values, dtype=np.int32))


def cumulative(lengths, gaps=None):
    """cu_seqlens from lengths; with gaps, the padded start offsets (lengths + gaps)."""
    sizes = np.asarray(lengths) + (0 if gaps is None else np.asarray(gaps))
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


def to_f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def to_torch(x, requires_grad=False):
    return torch.tensor(to_f64(x), dtype=torch.float64, requires_grad=requires_grad)


def assert_close(actual, expected, what: str, rtol: float = RTOL):
    """|actual - expected| <= rtol * (|expected| + max(1, max|expected|)), infinities equal."""
    a, e = to_f64(actual), to_f64(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != expected {e.shape}"
    assert not np.isnan(a).any(), f"{what}: NaN in the result"
    assert not np.isnan(e).any(), f"{what}: NaN in the expected values (naive)"
    inf_a, inf_e = np.isinf(a), np.isinf(e)
    assert (inf_a == inf_e).all() and (a[inf_a] == e[inf_e]).all(), \
        f"{what}: infinities differ at {np.argwhere(inf_a != inf_e)[:5].tolist()}"
    a, e = a[~inf_a], e[~inf_e]
    if not a.size:
        return
    scale = max(1.0, float(np.abs(e).max()))
    err = np.abs(a - e)
    bound = rtol * (np.abs(e) + scale)
    worst = int(np.argmax(err - bound))
    assert (err <= bound).all(), (f"{what}: max abs error {err.max():.3g} (scale {scale:.3g}); "
                                  f"worst {a[worst]!r} vs {e[worst]!r}")



def assert_reference_ran(calls, phases=("forward", "backward"), framework="jax"):
    """The selection result is part of the test: only the reference backend ran, in every phase."""
    mine = [(name, phase, cfg) for name, phase, cfg in calls if cfg.framework == framework]
    assert mine, f"no {framework} backend call was recorded"
    assert {name for name, _, _ in mine} == {"reference"}, [name for name, _, _ in mine]
    assert set(phases) <= {phase for _, phase, _ in mine}
    assert all(cfg.device == "cpu" for _, _, cfg in mine)


# ------------------------------------------------------------------ inputs by layout

def make_inputs(layout: str, seed: int, *, b=2, sq=6, skv=6, hq=4, hkv=2, d=8, dv=None,
                lens_q=None, lens_kv=None, gaps_q=None, gaps_kv=None, dtype=F32):
    """(arrays, offsets) for `layout`: float inputs by keyword and the int32 cu_seqlens.

    Dense layouts get cu_seqlens only when lens are given (padding masks). THD layouts
    pack sequences of lens_q/lens_kv tokens, with gaps (padded offsets) when given.
    """
    dv = d if dv is None else dv
    arrays, offsets = {}, {}
    ragged = layout.startswith("t")
    if ragged:
        cu_q, cu_kv = cumulative(lens_q), cumulative(lens_kv)
        offsets.update(cu_seqlens_q=i32(cu_q), cu_seqlens_kv=i32(cu_kv))
        if gaps_q is not None:
            pad_q, pad_kv = cumulative(lens_q, gaps_q), cumulative(lens_kv, gaps_kv)
            offsets.update(cu_seqlens_q_padded=i32(pad_q), cu_seqlens_kv_padded=i32(pad_kv))
            tq, tkv = int(pad_q[-1]) + 1, int(pad_kv[-1]) + 1  # plus one token after the last slot
        else:
            tq, tkv = int(cu_q[-1]), int(cu_kv[-1])
        lead_q, lead_kv = (tq,), (tkv,)
    else:
        if lens_q is not None:
            offsets.update(cu_seqlens_q=i32(cumulative(lens_q)), cu_seqlens_kv=i32(cumulative(lens_kv)))
        lead_q, lead_kv = ((sq, b), (skv, b)) if layout.startswith("sb") else ((b, sq), (b, skv))
    if layout in ("bshd", "sbhd", "thd"):
        arrays["q"] = rand(seed, (*lead_q, hq, d), dtype)
        arrays["k"] = rand(seed + 1, (*lead_kv, hkv, d), dtype)
        arrays["v"] = rand(seed + 2, (*lead_kv, hkv, dv), dtype)
    elif layout == "bhsd":
        arrays["q"] = rand(seed, (b, hq, sq, d), dtype)
        arrays["k"] = rand(seed + 1, (b, hkv, skv, d), dtype)
        arrays["v"] = rand(seed + 2, (b, hkv, skv, dv), dtype)
    elif layout in ("bs3hd", "sb3hd", "t3hd"):
        arrays["q"] = rand(seed, (*lead_q, 3, hq, d), dtype)
    else:  # bshd_bs2hd, sbhd_sb2hd, thd_t2hd: q and a packed kv passed as k
        arrays["q"] = rand(seed, (*lead_q, hq, d), dtype)
        arrays["k"] = rand(seed + 1, (*lead_kv, 2, hkv, d), dtype)
    return arrays, offsets


# ------------------------------------------------------------------ the comparison

def naive_run(layout, arrays, offsets, options, g_out, g_lse, *, score_mod=None, score_mod_t=None, keep=None):
    """(out, lse, max_logit, grads) of the float64 naive with the given output cotangents: tests/naive.py
    (given score_mod_t, the score_mod in torch) where torch is installed, else tests/naive_jax.py (given
    score_mod, the score_mod in jax.numpy)."""
    if not HAS_TORCH:
        kwargs = {name: options[name] for name in NAIVE_OPTIONS if options.get(name) is not None}
        if keep is not None:
            kwargs.update(dropout_keep=np.asarray(keep), dropout_p=options["dropout_p"])
        return naive_jax.value_and_grads(arrays, g_out, g_lse, layout=layout, score_mod=score_mod, **kwargs,
                                         **{n: np.asarray(x).astype(np.int64) for n, x in offsets.items()})
    tensors = {name: to_torch(x, requires_grad=True) for name, x in arrays.items()}
    kwargs = {name: options[name] for name in NAIVE_OPTIONS if options.get(name) is not None}
    if keep is not None:
        kwargs.update(dropout_keep=torch.tensor(np.asarray(keep)), dropout_p=options["dropout_p"])
    out, lse, max_logit = naive_attention(
        **tensors, **{n: torch.tensor(np.asarray(x).astype(np.int64)) for n, x in offsets.items()},
        layout=layout, score_mod=score_mod_t, **kwargs)
    if g_out is None:
        return out.detach(), lse.detach(), max_logit, None
    loss = (out * to_torch(g_out)).sum()
    loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * to_torch(g_lse)).sum()
    grads = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True)
    grads = {name: (torch.zeros_like(t) if g is None else g) for (name, t), g in zip(tensors.items(), grads)}
    return out.detach(), lse.detach(), max_logit, grads


def jax_run(layout, arrays, offsets, options, g_out, g_lse):
    """(out, lse, max_logit, grads) of fusedattn.jax.attention under jit, by jax.vjp."""
    names = [name for name in DIFFERENTIABLE if name in arrays]

    def attention(*xs):
        result = fj.attention(**dict(zip(names, xs)), **offsets, layout=layout,
                              return_lse=True, return_max_logit=True, **options)
        return result.out, result.lse, result.max_logit

    @jax.jit
    def run(xs, g_out, g_lse):
        (out, lse, max_logit), pullback = jax.vjp(attention, *xs)
        return out, lse, max_logit, pullback((g_out, g_lse, jnp.zeros_like(max_logit)))

    out, lse, max_logit, grads = run([arrays[n] for n in names], g_out, g_lse)
    return out, lse, max_logit, dict(zip(names, grads))


def compare_with_naive(calls, layout, arrays, offsets, options, seed, *, naive_score_mod=(None, None),
                       keep=None, rtol=RTOL):
    """Forward and every gradient of fusedattn.jax.attention against the float64 naive (naive_score_mod: the
    call's score_mod in jax.numpy and in torch, for the naive)."""
    out_shape, lse_shape = naive_jax.output_shapes(layout, arrays)
    g_out = rand(seed + 101, out_shape, arrays["q"].dtype)
    g_lse = rand(seed + 102, lse_shape)
    score_mod, score_mod_t = naive_score_mod
    out_n, lse_n, max_n, grads_n = naive_run(layout, arrays, offsets, options, g_out, g_lse,
                                             score_mod=score_mod, score_mod_t=score_mod_t, keep=keep)
    out, lse, max_logit, grads = jax_run(layout, arrays, offsets, options, g_out, g_lse)

    assert_reference_ran(calls)
    stats = jnp.float64 if out.dtype == jnp.float64 else F32  # float64 calls keep float64 statistics
    assert out.dtype == arrays["q"].dtype and lse.dtype == stats and max_logit.dtype == stats
    assert_close(out, out_n, "out", rtol)
    assert_close(lse, lse_n, "lse", rtol)
    assert_close(max_logit, max_n, "max_logit", rtol)
    assert set(grads) == set(grads_n)
    for name, grad in grads.items():
        assert grad.shape == arrays[name].shape and grad.dtype == arrays[name].dtype, name
        assert_close(grad, grads_n[name], f"d{name}", rtol)
    return out, lse, grads


MASKS = ("none", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")


def dense_case(seed, *, mask="none", b=3, sq=6, skv=6, hq=4, hkv=2, d=8, dv=None, layout="bshd"):
    """Dense inputs; padding masks get a full sequence, one whose queries see no key, one with no query."""
    lens = {}
    if mask.startswith("padding"):
        lens_q = [sq, max(sq - 2, 1), 0][:b]
        lens_kv = [skv, 0, max(skv - 3, 1)][:b]
        lens = dict(lens_q=lens_q, lens_kv=lens_kv)
    return make_inputs(layout, seed, b=b, sq=sq, skv=skv, hq=hq, hkv=hkv, d=d, dv=dv, **lens)


# ------------------------------------------------------------------ selection

def test_cpu_jax_selection_is_reference():
    cfg = fusedattn.AttentionConfig(
        dtype="bfloat16", layout="bshd", batch=2, seqlen_q=1, seqlen_kv=8, heads_q=4, heads_kv=2,
        head_dim_qk=64, head_dim_v=64, mask="causal", framework="jax", device="cpu", is_training=True)
    selection = fusedattn.select_backend(cfg)
    assert selection.name == "reference" and selection.forced_by is None
    others = {b.name for b in BACKENDS} - {"reference"}
    assert set(selection.rejected) == others
    for name in others:
        assert any("device cpu" in reason for reason in selection.rejected[name]), selection.rejected[name]


def test_forced_reference_matches_default(ran):
    arrays, _ = make_inputs("bshd", 11, sq=5, skv=7)
    run = jax.jit(lambda q, k, v: (fj.attention(q, k, v, mask="causal"),
                                   fj.attention(q, k, v, mask="causal", backend="reference")))
    default, forced = run(arrays["q"], arrays["k"], arrays["v"])
    np.testing.assert_array_equal(np.asarray(default), np.asarray(forced))
    assert_reference_ran(ran, phases=("forward",))


# ------------------------------------------------------------------ features against the naive

MASK_CASES = [(mask, sq, skv) for mask in MASKS for sq, skv in ((5, 9), (9, 5))]  # Sq == Skv: layouts


@pytest.mark.parametrize("mask,sq,skv", MASK_CASES)
def test_masks(ran, mask, sq, skv):
    seed = 1000 + 10 * MASK_CASES.index((mask, sq, skv))
    arrays, offsets = dense_case(seed, mask=mask, sq=sq, skv=skv)
    compare_with_naive(ran, "bshd", arrays, offsets, {"mask": mask}, seed)


WINDOW_CASES = [
    ("none", (2, 1), 6, 9),
    ("none", (0, 0), 9, 6),  # bottom-right diagonal: the first rows see no key
    ("none", (-1, 0), 6, 9),
    ("causal", (3, 0), 8, 8),
    ("causal", (2, -1), 6, 10),
    ("causal_bottom_right", (1, 0), 9, 6),
    ("padding_causal", (2, 0), 9, 7),
    ("padding_causal_bottom_right", (0, -1), 7, 9),
]


@pytest.mark.parametrize("mask,window,sq,skv", WINDOW_CASES)
def test_windows(ran, mask, window, sq, skv):
    seed = 2000 + 10 * WINDOW_CASES.index((mask, window, sq, skv))
    arrays, offsets = dense_case(seed, mask=mask, sq=sq, skv=skv)
    compare_with_naive(ran, "bshd", arrays, offsets, {"mask": mask, "window": window}, seed)


B, H, SQ, SKV = 3, 4, 5, 7
BIAS_CASES = [
    ("pre_scale", (B, H, SQ, SKV), "none"),
    ("post_scale", (1, H, SQ, SKV), "causal_bottom_right"),
    ("pre_scale", (B, 1, SQ, SKV), "padding"),
    ("post_scale", (1, 1, 1, SKV), "none"),
    ("pre_scale", (B, H, SQ, 1), "padding_causal_bottom_right"),
    ("post_scale", (SQ, SKV), "padding_causal"),  # 2-D, broadcast from the right
    (None, (1, H, 1, SKV), "none"),  # bias_type defaults to post_scale
]


@pytest.mark.parametrize("bias_type,shape,mask", BIAS_CASES)
def test_bias(ran, bias_type, shape, mask):
    seed = 3000 + 10 * BIAS_CASES.index((bias_type, shape, mask))
    arrays, offsets = dense_case(seed, mask=mask, b=B, sq=SQ, skv=SKV, hq=H, hkv=2)
    arrays["bias"] = rand(seed + 5, shape)
    options = {"mask": mask, **({"bias_type": bias_type} if bias_type else {})}
    compare_with_naive(ran, "bshd", arrays, offsets, options, seed)


ALIBI_CASES = [("heads", "causal", 6, 9), ("batch_heads", "causal_bottom_right", 6, 9),
               ("heads", "none", 9, 6), ("batch_heads", "padding_causal_bottom_right", 6, 9)]


@pytest.mark.parametrize("slopes,mask,sq,skv", ALIBI_CASES)
def test_alibi(ran, slopes, mask, sq, skv):
    seed = 4000 + 10 * ALIBI_CASES.index((slopes, mask, sq, skv))
    arrays, offsets = dense_case(seed, mask=mask, sq=sq, skv=skv, hq=4, hkv=2)
    shape = (4,) if slopes == "heads" else (3, 4)
    arrays["alibi_slopes"] = jnp.abs(rand(seed + 5, shape)) * 0.5
    compare_with_naive(ran, "bshd", arrays, offsets, {"mask": mask}, seed)


HEAD_CASES = [(4, 4, 8, 8, None), (4, 2, 8, 16, None), (4, 1, 16, 4, None), (3, 1, 5, 7, 0.3)]


@pytest.mark.parametrize("hq,hkv,d,dv,scale", HEAD_CASES)
def test_gqa_mqa_and_head_dims(ran, hq, hkv, d, dv, scale):
    seed = 5000 + 10 * HEAD_CASES.index((hq, hkv, d, dv, scale))
    arrays, offsets = make_inputs("bshd", seed, b=2, sq=5, skv=8, hq=hq, hkv=hkv, d=d, dv=dv)
    compare_with_naive(ran, "bshd", arrays, offsets, {"mask": "causal", "scale": scale}, seed)


SOFTMAX_CASES = [("off_by_one", "none", 6, 8), ("off_by_one", "causal_bottom_right", 9, 5),
                 ("learnable", "causal", 7, 7), ("learnable", "padding", 6, 8),
                 ("learnable", "causal_bottom_right", 9, 5)]


@pytest.mark.parametrize("softmax_type,mask,sq,skv", SOFTMAX_CASES)
def test_softmax_types(ran, softmax_type, mask, sq, skv):
    seed = 6000 + 10 * SOFTMAX_CASES.index((softmax_type, mask, sq, skv))
    arrays, offsets = dense_case(seed, mask=mask, sq=sq, skv=skv, hq=4, hkv=2)
    if softmax_type == "learnable":
        arrays["sink"] = rand(seed + 5, (4,), scale=2.0)
    compare_with_naive(ran, "bshd", arrays, offsets, {"mask": mask, "softmax_type": softmax_type}, seed)


# THD: sequence 1 has no query, sequence 2 no key (its queries see nothing).
THD_LENS = dict(lens_q=[3, 0, 5], lens_kv=[5, 2, 0])
THD_GAPS = dict(gaps_q=[1, 2, 0], gaps_kv=[0, 1, 2])
SELF_LENS = dict(lens_q=[4, 0, 6], lens_kv=[4, 0, 6])  # for t3hd: one tensor, one set of offsets
LAYOUT_CASES = {
    "bshd": dict(mask="causal_bottom_right", inputs=dict(sq=5, skv=7, dv=6)),
    "sbhd": dict(mask="padding_causal", inputs=dict(b=3, sq=7, skv=5, lens_q=[7, 4, 0], lens_kv=[5, 0, 3])),
    "bhsd": dict(mask="padding_causal_bottom_right",
                 inputs=dict(b=3, sq=5, skv=7, lens_q=[5, 2, 3], lens_kv=[7, 4, 0]), bias=(1, 4, 5, 7)),
    "thd": dict(mask="padding_causal", inputs=dict(**THD_LENS, **THD_GAPS, dv=6)),
    "bs3hd": dict(mask="causal", inputs=dict(sq=6, skv=6, hq=3, hkv=3)),
    "sb3hd": dict(mask="padding", inputs=dict(b=3, sq=6, skv=6, hq=2, hkv=2,
                                              lens_q=[6, 3, 0], lens_kv=[6, 3, 0])),
    "t3hd": dict(mask="padding_causal", inputs=dict(**SELF_LENS, gaps_q=[2, 1, 0], gaps_kv=[2, 1, 0],
                                                    hq=2, hkv=2)),
    "bshd_bs2hd": dict(mask="none", window=(1, 2), inputs=dict(sq=5, skv=8)),
    "sbhd_sb2hd": dict(mask="causal_bottom_right", inputs=dict(sq=8, skv=5, hkv=1)),
    "thd_t2hd": dict(mask="padding_causal_bottom_right", inputs=dict(**THD_LENS)),
}


@pytest.mark.parametrize("layout", list(LAYOUT_CASES))
def test_layouts(ran, layout):
    case = LAYOUT_CASES[layout]
    seed = 7000 + 10 * list(LAYOUT_CASES).index(layout)
    arrays, offsets = make_inputs(layout, seed, **case["inputs"])
    if "bias" in case:
        arrays["bias"] = rand(seed + 5, case["bias"])
    options = {"mask": case["mask"], "window": case.get("window")}
    out, _, grads = compare_with_naive(ran, layout, arrays, offsets, options, seed)
    if "cu_seqlens_q_padded" in offsets:  # tokens in the gaps: out 0, no gradient
        cu, padded = np.asarray(offsets["cu_seqlens_q"]), np.asarray(offsets["cu_seqlens_q_padded"])
        inside = np.zeros(out.shape[0], bool)
        for start, length in zip(padded[:-1], np.diff(cu)):
            inside[start:start + length] = True
        assert not np.asarray(out)[~inside].any()
        assert not np.asarray(grads["q"])[~inside].any()


THD_CASES = [
    ("thd", "causal", None, {}),  # THD always masks padding: 'causal' means 'padding_causal'
    ("thd", "padding_causal_bottom_right", (2, 0), {"padded": True}),
    ("thd", "padding", (1, 1), {"alibi": True, "padded": True}),
    ("thd", "padding_causal", None, {"sink": True, "padded": True}),
    ("thd_t2hd", "padding", None, {"padded": True, "off_by_one": True}),
]


@pytest.mark.parametrize("layout,mask,window,extra", THD_CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in
                                                                     enumerate(THD_CASES)])
def test_thd_features(ran, layout, mask, window, extra):
    seed = 7500 + 10 * THD_CASES.index((layout, mask, window, extra))
    gaps = THD_GAPS if extra.get("padded") else {}
    arrays, offsets = make_inputs(layout, seed, **THD_LENS, **gaps)
    options = {"mask": mask, "window": window}
    if extra.get("alibi"):
        arrays["alibi_slopes"] = jnp.abs(rand(seed + 5, (3, 4))) * 0.5
    if extra.get("sink"):
        arrays["sink"] = rand(seed + 6, (4,), scale=2.0)
        options["softmax_type"] = "learnable"
    if extra.get("off_by_one"):
        options["softmax_type"] = "off_by_one"
    compare_with_naive(ran, layout, arrays, offsets, options, seed)


def _softcap(s, b, h, q_idx, kv_idx):
    return 3.0 * jnp.tanh(s / 3.0)


def _softcap_t(s, b, h, q_idx, kv_idx):
    return 3.0 * torch.tanh(s / 3.0)


def _relative(s, b, h, q_idx, kv_idx):
    return s + 0.25 * (kv_idx - q_idx).astype(s.dtype)


def _relative_t(s, b, h, q_idx, kv_idx):
    return s + 0.25 * (kv_idx - q_idx).to(s.dtype)


def _by_head(s, b, h, q_idx, kv_idx):
    return jnp.where(h % 2 == 0, s, 0.5 * s) + 0.1 * b.astype(s.dtype)


def _by_head_t(s, b, h, q_idx, kv_idx):
    return torch.where(h % 2 == 0, s, 0.5 * s) + 0.1 * b.to(s.dtype)


def _band(s, b, h, q_idx, kv_idx):  # masks inside score_mod: every row keeps key 0
    return jnp.where(kv_idx <= q_idx + 1, s, -jnp.inf)


def _band_t(s, b, h, q_idx, kv_idx):
    return torch.where(kv_idx <= q_idx + 1, s, torch.tensor(float("-inf"), dtype=s.dtype))


_TABLE = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


def _table(s, b, h, q_idx, kv_idx):  # reads a (Hq,) array it closes over
    return s + jnp.asarray(_TABLE)[h]


def _table_t(s, b, h, q_idx, kv_idx):
    return s + torch.tensor(_TABLE, dtype=torch.float64)[h]


SCORE_MOD_CASES = [("softcap", _softcap, _softcap_t, "causal"),
                   ("relative", _relative, _relative_t, "padding_causal_bottom_right"),
                   ("by_head", _by_head, _by_head_t, "none"),
                   ("band", _band, _band_t, "none"),
                   ("table", _table, _table_t, "causal_bottom_right")]


@pytest.mark.parametrize("name,score_mod,score_mod_t,mask", SCORE_MOD_CASES, ids=[c[0] for c in SCORE_MOD_CASES])
def test_score_mod(ran, name, score_mod, score_mod_t, mask):
    seed = 8000 + 10 * [c[0] for c in SCORE_MOD_CASES].index(name)
    arrays, offsets = dense_case(seed, mask=mask, sq=6, skv=8)
    if name == "relative":
        arrays["bias"] = rand(seed + 5, (1, 4, 6, 8))
    compare_with_naive(ran, "bshd", arrays, offsets, {"mask": mask, "score_mod": score_mods.eager(score_mod)}, seed,
                       naive_score_mod=(score_mod, score_mod_t))


# ------------------------------------------------------------------ outputs and masked rows

def test_return_values_structure():
    arrays, _ = make_inputs("bshd", 9000, b=2, sq=5, skv=7, hq=4, hkv=2, dtype=jnp.bfloat16)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    bare = jax.eval_shape(lambda: fj.attention(q, k, v))
    assert isinstance(bare, jax.ShapeDtypeStruct) and bare.shape == (2, 5, 4, 8) and bare.dtype == jnp.bfloat16
    lse_only = jax.eval_shape(lambda: fj.attention(q, k, v, return_lse=True))
    assert isinstance(lse_only, fj.AttentionResult) and lse_only.max_logit is None
    assert lse_only.lse.shape == (2, 4, 5) and lse_only.lse.dtype == jnp.float32
    max_only = jax.eval_shape(lambda: fj.attention(q, k, v, return_max_logit=True))
    assert max_only.lse is None and max_only.max_logit.shape == (4,) and max_only.max_logit.dtype == jnp.float32
    thd, offsets = make_inputs("thd", 9001, **THD_LENS, **THD_GAPS)
    both = jax.eval_shape(lambda: fj.attention(**thd, **offsets, layout="thd", return_lse=True,
                                               return_max_logit=True))
    assert both.out.shape == thd["q"].shape and both.lse.shape == thd["q"].shape[:2]
    assert both.max_logit.shape == (4,)


MASKED_CASES = [
    ("causal_bottom_right", None, "vanilla", "bshd"),  # Sq > Skv: the first rows see nothing
    ("none", (0, 0), "vanilla", "bshd"),
    ("padding", None, "learnable", "bshd"),  # sequence 1 has no key
    ("padding", None, "off_by_one", "thd"),  # sequence 2 has no key
]


@pytest.mark.parametrize("mask,window,softmax_type,layout", MASKED_CASES)
def test_fully_masked_rows(ran, mask, window, softmax_type, layout):
    """Rows that see no key: out 0, lse -inf (log of the sink term with a sink), finite zero grads."""
    seed = 9100 + 10 * MASKED_CASES.index((mask, window, softmax_type, layout))
    if layout == "thd":
        arrays, offsets = make_inputs("thd", seed, **THD_LENS)
        dead = np.zeros((8, 4), bool)  # (Tq, Hq)
        dead[3:8] = True  # the queries of sequence 2, which has no key
    else:
        arrays, offsets = dense_case(seed, mask=mask, b=3, sq=9, skv=5)
        dead = np.zeros((3, 4, 9), bool)  # (B, Hq, Sq)
        if mask == "padding":
            dead[1, :, :7] = True  # lens_q 7, lens_kv 0
        else:
            dead[:, :, :4] = True  # diagonal i + (5 - 9) < 0
    options = {"mask": mask, "window": window, "softmax_type": softmax_type}
    sink = rand(seed + 5, (4,), scale=2.0)
    if softmax_type == "learnable":
        arrays["sink"] = sink

    def loss(arrays):
        result = fj.attention(**arrays, **offsets, layout=layout, return_lse=True, **options)
        finite_lse = jnp.where(jnp.isfinite(result.lse), result.lse, 0.0)
        return (result.out ** 2).sum() + finite_lse.sum(), result

    (_, result), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(arrays)
    assert_reference_ran(ran)
    # Rows indexed like out: (Tq, Hq) for thd, (B, Sq, Hq) for bshd (lse is (B, Hq, Sq) there).
    dead_rows = dead if layout == "thd" else np.moveaxis(dead, 1, 2)
    lse = np.asarray(result.lse) if layout == "thd" else np.moveaxis(np.asarray(result.lse), 1, 2)
    assert dead.any() and not np.asarray(result.out)[dead_rows].any(), "fully masked rows must give out 0"
    expected = {"vanilla": np.full(lse.shape, -np.inf), "off_by_one": np.zeros(lse.shape),
                "learnable": np.broadcast_to(np.asarray(sink), lse.shape)}[softmax_type]
    np.testing.assert_allclose(lse[dead_rows], expected[dead_rows], rtol=1e-6)
    if mask == "padding" and layout == "bshd":  # sequence 2 has no query: padding rows, even with a sink
        assert not np.asarray(result.out)[2].any() and (lse[2] == -np.inf).all(), lse[2]
    for name, grad in grads.items():
        assert np.isfinite(np.asarray(grad)).all(), f"d{name} has NaN/inf"
    assert not np.asarray(grads["q"])[dead_rows].any(), "queries that see no key have no gradient"


# ------------------------------------------------------------------ bfloat16 / float16

def plain_attention(q, k, v, *, mask="none", bias=None, sink=None, lens_q=None, lens_kv=None):
    """Attention with every step in q's dtype (bshd): the same-dtype baseline of STYLE rule 15."""
    dtype = q.dtype
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * jnp.asarray(1.0 / math.sqrt(q.shape[-1]), dtype)
    if bias is not None:
        s = s + bias.astype(dtype)
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    visible = jnp.ones(s.shape, bool)
    if "causal" in mask:
        visible = visible & (j <= i)
    if mask.startswith("padding"):
        visible = visible & (i < jnp.asarray(lens_q)[:, None, None, None]) \
            & (j < jnp.asarray(lens_kv)[:, None, None, None])
    s = jnp.where(visible, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    if sink is not None:
        sink = sink.astype(dtype)[None, :, None, None]
        m = jnp.maximum(m, jax.lax.stop_gradient(sink))
    m = jnp.where(jnp.isfinite(m), m, 0.0).astype(dtype)
    e = jnp.exp(s - m)
    denominator = e.sum(-1, keepdims=True)
    if sink is not None:
        denominator = denominator + jnp.exp(sink - m)
    out = jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(denominator > 0, denominator, 1), v)
    lse = jnp.where(denominator > 0, jnp.log(jnp.where(denominator > 0, denominator, 1)) + m, -jnp.inf)
    return out, lse[..., 0]


LOW_CASES = [("bfloat16", "causal_gqa"), ("bfloat16", "sink"), ("float16", "causal_gqa"), ("float16", "bias")]


@pytest.mark.parametrize("dtype,feature", LOW_CASES)
def test_low_precision_error_within_plain_same_dtype(ran, dtype, feature):
    """fusedattn's error vs float64 within 2x a plain same-dtype computation's error (+ one ulp)."""
    seed = 9500 + 10 * LOW_CASES.index((dtype, feature))
    dt = jnp.dtype(dtype)
    mask = {"causal_gqa": "causal", "bias": "none", "sink": "padding_causal"}[feature]
    lens = dict(lens_q=[12, 9], lens_kv=[12, 5]) if mask.startswith("padding") else {}
    arrays, offsets = make_inputs("bshd", seed, b=2, sq=12, skv=12, hq=4, hkv=2 if feature == "causal_gqa" else 4,
                                  d=16, dtype=dt, **lens)
    options = {"mask": mask}
    if feature == "bias":
        arrays["bias"] = rand(seed + 5, (1, 4, 12, 12), dt)
    if feature == "sink":
        arrays["sink"] = rand(seed + 6, (4,), dt, scale=2.0)
        options["softmax_type"] = "learnable"
    names = [n for n in DIFFERENTIABLE if n in arrays]

    out_shape, lse_shape = naive_jax.output_shapes("bshd", arrays)
    g_out = rand(seed + 101, out_shape, dt)
    g_lse = rand(seed + 102, lse_shape)
    out_n, lse_n, _, grads_n = naive_run("bshd", arrays, offsets, options, g_out, g_lse)
    out, lse, _, grads = jax_run("bshd", arrays, offsets, options, g_out, g_lse)
    assert_reference_ran(ran)

    def plain(*xs):
        named = dict(zip(names, xs))
        return plain_attention(named["q"], named["k"], named["v"], mask=mask, bias=named.get("bias"),
                               sink=named.get("sink"), **lens)

    @jax.jit
    def run_plain(xs):
        (out, lse), pullback = jax.vjp(plain, *xs)
        return out, lse, pullback((g_out, g_lse.astype(dt)))

    out_p, lse_p, grads_p = run_plain([arrays[n] for n in names])
    grads_p = dict(zip(names, grads_p))
    eps = float(jnp.finfo(dt).eps)

    def check(what, fused, plain_value, reference):
        f, p, r = to_f64(fused), to_f64(plain_value), to_f64(reference)
        assert not np.isnan(f).any() and (f[np.isinf(r)] == r[np.isinf(r)]).all(), what
        keep = np.isfinite(r)
        err_f, err_p = np.abs(f[keep] - r[keep]).max(), np.abs(p[keep] - r[keep]).max()
        atol = eps * max(1.0, np.abs(r[keep]).max())
        assert err_f <= 2 * err_p + atol, \
            f"{what}: error {err_f:.3g} > 2 x plain {dtype} error {err_p:.3g} + {atol:.3g}"

    assert out.dtype == dt and lse.dtype == (jnp.float64 if dt == jnp.float64 else F32)
    check("out", out, out_p, out_n)
    check("lse", lse, lse_p, lse_n)
    for name in names:
        assert grads[name].dtype == dt
        check(f"d{name}", grads[name], grads_p[name], grads_n[name])


# ------------------------------------------------------------------ transformations

def _feature_case(seed):
    """bshd, causal, GQA, Dv != D, post-scale bias and learnable sink."""
    arrays, _ = make_inputs("bshd", seed, b=2, sq=5, skv=6, hq=4, hkv=2, d=8, dv=6)
    arrays["bias"] = rand(seed + 5, (1, 4, 5, 6))
    arrays["sink"] = rand(seed + 6, (4,))
    return arrays, {"mask": "causal", "softmax_type": "learnable"}


def test_eager_matches_jit(ran):
    """Outside jit (op by op, slow on CPU: one featureful forward and one plain gradient)."""
    arrays, options = _feature_case(9600)
    eager = fj.attention(**arrays, **options, return_lse=True)
    jitted = jax.jit(lambda a: fj.attention(**a, **options, return_lse=True))(arrays)
    np.testing.assert_allclose(eager.out, jitted.out, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(eager.lse, jitted.lse, rtol=1e-6, atol=1e-6)
    qkv = {name: arrays[name] for name in "qkv"}
    loss = lambda a: (fj.attention(**a, mask="causal") * a["q"][..., :6]).sum()  # noqa: E731
    eager_grads = jax.grad(loss)(qkv)
    jit_grads = jax.jit(jax.grad(loss))(qkv)
    assert_reference_ran(ran)
    for name in qkv:
        np.testing.assert_allclose(eager_grads[name], jit_grads[name], rtol=1e-5, atol=1e-6)


def test_jit_thd_traced_offsets_need_static_max_seqlen(ran):
    arrays, offsets = make_inputs("thd", 9700, **THD_LENS, **THD_GAPS)

    def attention(q, k, v, offsets, **static):
        return fj.attention(q, k, v, **offsets, layout="thd", mask="padding_causal", **static)

    loss = lambda q, k, v, offsets, **static: (attention(q, k, v, offsets, **static) ** 2).sum()  # noqa: E731
    traced = jax.jit(jax.value_and_grad(lambda q, k, v, o: loss(q, k, v, o, max_seqlen_q=5, max_seqlen_kv=5),
                                        argnums=(0, 1, 2)))
    closed = jax.jit(jax.value_and_grad(lambda q, k, v: loss(q, k, v, offsets), argnums=(0, 1, 2)))
    value_t, grads_t = traced(arrays["q"], arrays["k"], arrays["v"], offsets)
    value_c, grads_c = closed(arrays["q"], arrays["k"], arrays["v"])
    assert_reference_ran(ran)
    np.testing.assert_allclose(value_t, value_c, rtol=1e-6)
    for grad_t, grad_c in zip(grads_t, grads_c):
        np.testing.assert_allclose(grad_t, grad_c, rtol=1e-6, atol=1e-7)
    # A static max_seqlen longer than every sequence only adds padding.
    longer = jax.jit(lambda q, k, v, o: attention(q, k, v, o, max_seqlen_q=8, max_seqlen_kv=7))
    np.testing.assert_allclose(longer(arrays["q"], arrays["k"], arrays["v"], offsets),
                               jax.jit(lambda q, k, v: attention(q, k, v, offsets))(
                                   arrays["q"], arrays["k"], arrays["v"]), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        jax.jit(lambda q, k, v, o: attention(q, k, v, o))(arrays["q"], arrays["k"], arrays["v"], offsets)


VMAP_CASES = ("gqa_causal", "bias_sink", "padding_traced_offsets", "thd_traced_offsets")


@pytest.mark.parametrize("order", ["jit_of_vmap", "vmap_of_jit"])
@pytest.mark.parametrize("case", VMAP_CASES)
def test_vmap_matches_loop(ran, case, order):
    """jax.vmap over an extra leading axis equals a Python loop, forward and gradients; also when vmap
    batches an already traced jit (whose trace saw no vmap tracer)."""
    n = 2
    seed = 9800 + 100 * VMAP_CASES.index(case)
    layout, options, shared = "bshd", {"mask": "causal"}, {}
    if case == "thd_traced_offsets":
        layout = "thd"
        options = {"mask": "padding_causal_bottom_right", "max_seqlen_q": 5, "max_seqlen_kv": 6}
    samples = []
    for i in range(n):
        if case == "thd_traced_offsets":
            lens = [dict(lens_q=[3, 0, 5], lens_kv=[5, 2, 0]), dict(lens_q=[5, 2, 1], lens_kv=[1, 5, 1])][i]
            arrays, offsets = make_inputs("thd", seed + 10 * i, **lens)
        elif case == "padding_traced_offsets":
            lens = [dict(lens_q=[6, 2, 0], lens_kv=[4, 0, 6]), dict(lens_q=[1, 6, 3], lens_kv=[6, 6, 2])][i]
            arrays, offsets = make_inputs("bshd", seed + 10 * i, b=3, sq=6, skv=6, **lens)
            options = {"mask": "padding_causal_bottom_right"}
        else:
            arrays, offsets = make_inputs("bshd", seed + 10 * i, b=2, sq=5, skv=7, hkv=2)
        if case == "bias_sink":
            arrays["bias"] = rand(seed + 10 * i + 5, (2, 1, 5, 7))
        samples.append({**arrays, **offsets})
    if case == "bias_sink":
        shared = {"sink": rand(seed + 7, (4,))}  # not batched: in_axes None
        options = {"mask": "causal_bottom_right", "softmax_type": "learnable"}
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *samples)
    float_names = [k for k in stacked if k in DIFFERENTIABLE]
    g_out = rand(seed + 99, (n,) + jax.eval_shape(
        lambda s: fj.attention(**s, **shared, layout=layout, **options), samples[0]).shape)

    def one(sample, g):
        def f(floats):
            return fj.attention(**floats, **{k: v for k, v in sample.items() if k not in float_names},
                                **shared, layout=layout, **options)
        out, pullback = jax.vjp(f, {k: sample[k] for k in float_names})
        return out, pullback(g)[0]

    vmapped = jax.jit(jax.vmap(one)) if order == "jit_of_vmap" else jax.vmap(jax.jit(one))
    out_v, grads_v = vmapped(stacked, g_out)
    looped = jax.jit(one)
    for i, sample in enumerate(samples):
        out_i, grads_i = looped(sample, g_out[i])
        np.testing.assert_allclose(out_v[i], out_i, rtol=1e-5, atol=1e-6)
        for name in float_names:
            np.testing.assert_allclose(grads_v[name][i], grads_i[name], rtol=1e-5, atol=1e-6)
    assert_reference_ran(ran)
    if case.endswith("traced_offsets"):  # and the loop itself is right: check one sample against the naive
        sample = samples[1]
        offsets = {k: v for k, v in sample.items() if k.startswith("cu_")}
        naive_options = {k: v for k, v in options.items() if not k.startswith("max_")}
        out_n = naive_run(layout, {k: sample[k] for k in float_names}, offsets, naive_options, None, None)[0]
        assert_close(out_v[1], out_n, "vmapped out")


@pytest.mark.parametrize("dropout", [False, True])
def test_checkpoint_same_grads(ran, dropout):
    arrays, options = _feature_case(9900 + dropout)
    if dropout:
        options = {**options, "dropout_p": 0.25, "dropout_rng": jax.random.key(3)}
    target = rand(9905, (2, 5, 4, 6))

    def loss(a):
        return ((fj.attention(**a, **options) - target) ** 2).sum()

    plain = jax.jit(jax.grad(loss))(arrays)
    remat = jax.jit(jax.grad(jax.checkpoint(loss)))(arrays)
    assert_reference_ran(ran)
    for name in arrays:
        np.testing.assert_allclose(remat[name], plain[name], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ dropout

DROPOUT_CASES = [  # (layout, options, inputs); the seeds are the case's own
    ("bshd", dict(mask="causal", dropout_p=0.3, dropout_seed=1234, dropout_offset=5), {}),
    ("thd", dict(mask="padding_causal_bottom_right", dropout_p=0.5, dropout_seed=7, dropout_offset=0),
     dict(**THD_LENS, **THD_GAPS)),
    ("bshd", dict(mask="none", dropout_p=0.2, dropout_seed=2024, dropout_offset=99,
                  softmax_type="learnable", bias_type="pre_scale"), dict(sq=5, skv=7)),
]


@pytest.mark.parametrize("index", range(len(DROPOUT_CASES)), ids=["bshd", "thd", "bshd-bias-sink"])
def test_dropout_forward_and_backward_share_the_mask(ran, index):
    """Gradients match the naive given the reference's keep mask: backward drops what forward did."""
    layout, options, inputs = DROPOUT_CASES[index]
    seed = 10000 + 10 * index
    arrays, offsets = make_inputs(layout, seed, **inputs)
    if options.get("softmax_type") == "learnable":
        arrays["sink"] = rand(seed + 5, (4,))
        arrays["bias"] = rand(seed + 6, (2, 1, 5, 7))
    if layout == "thd":
        batch, sq, skv = 3, max(THD_LENS["lens_q"]), max(THD_LENS["lens_kv"])
    else:
        batch, sq, skv = arrays["q"].shape[0], arrays["q"].shape[1], arrays["k"].shape[1]
    keep = dropout_keep(JAX_OPS, jnp.asarray(options["dropout_seed"], jnp.uint32),
                        jnp.asarray(options["dropout_offset"], jnp.uint32),
                        (batch, arrays["q"].shape[-2], sq, skv), options["dropout_p"])
    fraction = float(np.asarray(keep).mean())
    assert abs(fraction - (1 - options["dropout_p"])) < 0.15, fraction
    compare_with_naive(ran, layout, arrays, offsets, options, seed, keep=keep)


def _dropout_runner(options):
    """A jitted (arrays, dropout arguments) -> (out, grads); one compile per argument structure."""
    def loss(a, dropout):
        out = fj.attention(**a, **options, dropout_p=0.4, **dropout)
        return (out * jnp.cos(out)).sum(), out

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))

    def run(arrays, **dropout):
        (_, out), grads = step(arrays, dropout)
        return np.asarray(out), {k: np.asarray(g) for k, g in grads.items()}

    return run


def test_dropout_rng_is_reproducible(ran):
    arrays, options = _feature_case(10100)
    run = _dropout_runner(options)
    out_a, grads_a = run(arrays, dropout_rng=jax.random.key(1))
    out_b, grads_b = run(arrays, dropout_rng=jax.random.key(1))
    out_c, grads_c = run(arrays, dropout_rng=jax.random.key(2))
    np.testing.assert_array_equal(out_a, out_b)
    for name in arrays:
        np.testing.assert_array_equal(grads_a[name], grads_b[name])
    assert not np.allclose(out_a, out_c) and not np.allclose(grads_a["q"], grads_c["q"])
    plain = jax.jit(lambda a: fj.attention(**a, **options))(arrays)
    assert not np.allclose(out_a, plain)
    # A key closed over (concrete) equals the traced one; legacy uint32[2] keys work too.
    closed = jax.jit(lambda a: fj.attention(**a, **options, dropout_p=0.4, dropout_rng=jax.random.key(1)))(arrays)
    np.testing.assert_array_equal(np.asarray(closed), out_a)
    legacy, _ = run(arrays, dropout_rng=jax.random.PRNGKey(1))
    assert np.isfinite(legacy).all() and not np.allclose(legacy, plain)
    assert_reference_ran(ran)


def test_dropout_seed_and_offset(ran):
    arrays, options = _feature_case(10200)
    run = _dropout_runner(options)
    out_a, grads_a = run(arrays, dropout_seed=42, dropout_offset=3)
    out_b, grads_b = run(arrays, dropout_seed=42, dropout_offset=3)
    out_offset, _ = run(arrays, dropout_seed=42, dropout_offset=4)
    out_seed, _ = run(arrays, dropout_seed=43, dropout_offset=3)
    np.testing.assert_array_equal(out_a, out_b)
    for name in arrays:
        np.testing.assert_array_equal(grads_a[name], grads_b[name])
    assert not np.allclose(out_a, out_offset) and not np.allclose(out_a, out_seed)
    explicit_zero, _ = run(arrays, dropout_seed=42, dropout_offset=0)
    default_offset, _ = run(arrays, dropout_seed=42)
    np.testing.assert_array_equal(default_offset, explicit_zero)
    assert_reference_ran(ran)


BEYOND_INT32 = dict(dropout_p=0.3, dropout_seed=2**31 + 12345, dropout_offset=2**32 - 3)


def _beyond_int32_as_uint32(arrays, options):
    seed, offset = jnp.uint32(BEYOND_INT32["dropout_seed"]), jnp.uint32(BEYOND_INT32["dropout_offset"])
    return jax.jit(lambda a: fj.attention(**a, **options, dropout_p=BEYOND_INT32["dropout_p"], dropout_seed=seed,
                                          dropout_offset=offset))(arrays)


def test_dropout_seed_and_offset_beyond_int32(ran):
    """The mask hashes 32-bit unsigned (seed, offset): Python ints up to 2**32 - 1 are accepted and mean
    the same as uint32 arrays of those values."""
    arrays, options = _feature_case(10250)
    as_int = jax.jit(lambda a: fj.attention(**a, **options, **BEYOND_INT32))(arrays)
    np.testing.assert_array_equal(np.asarray(as_int), np.asarray(_beyond_int32_as_uint32(arrays, options)))


@needs_torch_frontend
def test_dropout_seed_and_offset_beyond_int32_as_by_the_torch_frontend(ran):
    arrays, options = _feature_case(10250)
    tensors = {n: torch.tensor(np.asarray(x)) for n, x in arrays.items()}
    torch_out = ft.attention(**tensors, **options, **BEYOND_INT32)
    assert_close(torch_out.numpy(), _beyond_int32_as_uint32(arrays, options), "out (torch int seed vs jax uint32 seed)")


def test_dropout_rng_mask_recovered_from_forward_drives_backward(ran):
    """Without the library's hash: with v square and invertible, out = P_dropped @ v reveals the
    kept weights; the naive given that mask must reproduce every gradient."""
    p, seed = 0.5, 10300
    arrays, _ = make_inputs("bshd", seed, b=2, sq=6, skv=8, hq=2, hkv=2, d=8, dv=8)
    arrays["q"], arrays["k"] = arrays["q"] * 0.5, arrays["k"] * 0.5
    options = {"mask": "none", "dropout_p": p, "dropout_rng": jax.random.key(77)}
    out = np.asarray(jax.jit(lambda a: fj.attention(**a, **options))(arrays)).astype(np.float64)
    v = to_f64(arrays["v"])  # (B, Skv, H, Dv), Skv == Dv
    weights = np.einsum("bqhd,bhdk->bhqk", out, np.linalg.inv(np.moveaxis(v, 2, 1)))
    keep = np.abs(weights) > 1e-3
    assert np.abs(weights[~keep]).max() < 1e-4, "dropped weights must be exactly dropped"
    assert abs(keep.mean() - (1 - p)) < 0.15
    compare_with_naive(ran, "bshd", arrays, {}, {**options, "dropout_p": p}, seed, keep=keep)


def test_dropout_vmap_over_keys(ran):
    arrays, options = _feature_case(10400)
    keys = jax.random.split(jax.random.key(5), 3)
    f = lambda key: fj.attention(**arrays, **options, dropout_p=0.3, dropout_rng=key)  # noqa: E731
    batched = jax.jit(jax.vmap(f))(keys)
    single = jax.jit(f)
    for i in range(3):
        np.testing.assert_allclose(batched[i], single(keys[i]), rtol=1e-6, atol=1e-7)
    assert not np.allclose(batched[0], batched[1])
    assert_reference_ran(ran, phases=("forward",))


def test_dropout_needs_a_key_or_seed():
    arrays, options = _feature_case(10500)
    with pytest.raises(ValueError, match="dropout_rng"):
        jax.eval_shape(lambda: fj.attention(**arrays, **options, dropout_p=0.1))


# ------------------------------------------------------------------ torch and JAX agree

AGREE_CASES = {
    "gqa_causal_dv": ("bshd", dict(mask="causal"), dict(sq=5, skv=7, hkv=1, dv=6)),
    "dropout": ("bshd", dict(mask="causal_bottom_right", dropout_p=0.3, dropout_seed=987, dropout_offset=11),
                dict(sq=6, skv=8)),
    "thd_padded_dropout": ("thd", dict(mask="padding_causal", window=(2, 0), dropout_p=0.25, dropout_seed=3,
                                       dropout_offset=17), dict(**THD_LENS, **THD_GAPS)),
    "bias_sink": ("sbhd", dict(mask="none", bias_type="pre_scale", softmax_type="learnable"),
                  dict(b=3, sq=6, skv=5)),
    "alibi_window_off_by_one": ("bshd", dict(mask="padding_causal_bottom_right", window=(2, 0),
                                             softmax_type="off_by_one"),
                                dict(b=3, sq=6, skv=8, lens_q=[6, 2, 0], lens_kv=[8, 0, 5])),
    "packed_qkv_dropout": ("bs3hd", dict(mask="causal", dropout_p=0.1, dropout_seed=5), dict(hq=2, hkv=2)),
}


@needs_torch_frontend
@pytest.mark.parametrize("case", list(AGREE_CASES))
def test_torch_and_jax_agree(ran, case):
    layout, options, inputs = AGREE_CASES[case]
    seed = 11000 + 10 * list(AGREE_CASES).index(case)
    arrays, offsets = make_inputs(layout, seed, **inputs)
    if case == "bias_sink":
        arrays["bias"] = rand(seed + 5, (3, 1, 6, 5))
        arrays["sink"] = rand(seed + 6, (4,))
    if case.startswith("alibi"):
        arrays["alibi_slopes"] = jnp.abs(rand(seed + 7, (4,)))
    probe = jax.eval_shape(lambda: fj.attention(**arrays, **offsets, layout=layout, return_lse=True, **options))
    g_out, g_lse = rand(seed + 101, probe.out.shape), rand(seed + 102, probe.lse.shape)
    out_j, lse_j, _, grads_j = jax_run(layout, arrays, offsets, options, g_out, g_lse)

    tensors = {n: torch.tensor(np.asarray(x), requires_grad=True) for n, x in arrays.items()}
    result = ft.attention(**tensors, **{n: torch.tensor(np.asarray(x)) for n, x in offsets.items()},
                          layout=layout, return_lse=True, **options)
    grads_t = torch.autograd.grad((result.out, result.lse), list(tensors.values()),
                                  (torch.tensor(np.asarray(g_out)), torch.tensor(np.asarray(g_lse))))
    assert_reference_ran(ran, framework="torch")
    assert_reference_ran(ran, framework="jax")
    assert result.out.dtype == torch.float32 and result.lse.dtype == torch.float32
    assert_close(result.out.detach().numpy(), out_j, "out (torch vs jax)")
    assert_close(result.lse.detach().numpy(), lse_j, "lse (torch vs jax)")
    for (name, _), grad_t in zip(tensors.items(), grads_t):
        assert_close(grad_t.numpy(), grads_j[name], f"d{name} (torch vs jax)")


def test_segment_ids_are_another_way_to_give_thd_sequences():
    lens = [3, 0, 5]
    ids = jnp.asarray(np.repeat(np.arange(3), lens).tolist() + [3, 3], jnp.int32)  # two trailing padding tokens
    cu = jnp.asarray([0, 3, 3, 8], jnp.int32)
    q, k, v = (jax.random.normal(jax.random.key(i), (10, 2, 8)) for i in range(3))
    by_ids = jax.jit(lambda q: fj.attention(q, k, v, layout="thd", mask="padding_causal", segment_ids_q=ids,
                                            segment_ids_kv=ids, num_sequences=3, max_seqlen_q=5,
                                            max_seqlen_kv=5))(q)
    by_offsets = fj.attention(q, k, v, layout="thd", mask="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    np.testing.assert_allclose(np.asarray(by_ids), np.asarray(by_offsets), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="num_sequences: expected a static int"):
        fj.attention(q, k, v, layout="thd", mask="padding", segment_ids_q=ids, segment_ids_kv=ids)
    with pytest.raises(ValueError, match="segment_ids_kv: expected a"):
        fj.attention(q, k, v, layout="thd", mask="padding", segment_ids_q=ids, num_sequences=3)
