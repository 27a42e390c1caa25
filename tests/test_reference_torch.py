"""fusedattn.torch.attention on CPU (the reference backend) against the naive float64 attention.

Every test runs the public API on fresh seeded random inputs, proves that the reference
backend ran forward and backward (STYLE rule 17), and compares the output, lse, max_logit
and every gradient with tests/naive.py, which shares no code with fusedattn. float32 and
float64 results get tight tolerances; bfloat16/float16 results must be within a small
multiple of the error of the same-dtype computation (STYLE rule 15).
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch
from naive import BASE_LAYOUT, naive_attention

import fusedattn
from fusedattn import score_mods
from fusedattn.backends import BACKENDS
from fusedattn.backends.reference.math import dropout_keep  # only to know the dropout mask
from fusedattn.torch import AttentionResult, DotProductAttention, attention
from fusedattn.xp import namespace

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16
LAYOUTS = ("bshd", "sbhd", "bhsd", "thd", "bs3hd", "sb3hd", "t3hd", "bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd")
MASKS = ("none", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")
INF = float("inf")


# --------------------------------------------------------------------------------------------
# Fixtures and helpers
# --------------------------------------------------------------------------------------------

@pytest.fixture
def gen(request):
    """A generator seeded from the test's id: fresh inputs per test, the same on every run."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))




def assert_reference_ran(ran, backward=True):
    """Only the reference backend ran (forward, and backward when asked), and selection picks it."""
    expected = {("reference", "forward")} | ({("reference", "backward")} if backward else set())
    assert {(name, method) for name, method, _ in ran} == expected
    for _, _, cfg in ran:
        selection = fusedattn.select_backend(cfg)
        assert selection.name == "reference"
        assert all(selection.rejected[b.name] for b in BACKENDS if b.name != "reference")
    ran.clear()


def randn(gen, shape, dtype=F32, scale=1.0, grad=True):
    x = (torch.randn(shape, generator=gen, dtype=F64) * scale).to(dtype)
    return x.requires_grad_(grad)


def assert_matches(actual, expected, what=""):
    """actual (any dtype) against the float64 `expected`: same non-finite entries, then
    float32/64: a tight tolerance; bfloat16/float16: error <= 2x the same-dtype rounding error."""
    assert actual is not None, f"{what}: missing"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}"
    a, e = actual.detach().to(F64), expected.detach().to(F64)
    assert not a.isnan().any(), f"{what}: NaN"
    finite = torch.isfinite(e)
    same = torch.equal(torch.isfinite(a), finite) and torch.equal(a[~finite], e[~finite])
    assert same, f"{what}: non-finite entries differ at {(torch.isfinite(a) != finite).nonzero().tolist()}:\n{a}\n{e}"
    a, e = a[finite], e[finite]
    if not e.numel():
        return
    err, peak = (a - e).abs().max().item(), e.abs().max().item()
    if actual.dtype in (F32, F64):
        tol = (1e-5 if actual.dtype == F32 else 1e-10) * max(1.0, peak)
        assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"
    else:
        same_dtype = (e.to(actual.dtype).to(F64) - e).abs().max().item()
        tol = 2 * same_dtype + 1e-5 * peak
        assert err <= tol, f"{what}: max error {err:.3g} > 2 x {same_dtype:.3g} (same-dtype error) + atol"


def gradients(outputs, inputs, cotangents):
    """d(sum outputs * cotangents)/d inputs; zeros for inputs the outputs do not depend on."""
    pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
    if not pairs:
        return [torch.zeros_like(x) for x in inputs]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [c for _, c in pairs], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def offsets(lens, gaps):
    """(cu_seqlens, padded offsets or None, total tokens) of packed sequences of `lens`."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if not gaps:
        return cu, None, cu[-1] + 1  # one trailing token outside every sequence
    padded = [1]  # a gap before the first sequence, then gaps of 0, 1, 2, ... tokens
    for b, n in enumerate(lens):
        padded.append(padded[-1] + n + b % 3)
    return cu, padded, padded[-1] + 2


def base_shape(base, B, S, H, D):
    return {"bshd": (B, S, H, D), "sbhd": (S, B, H, D), "bhsd": (B, H, S, D)}[base]


@dataclasses.dataclass
class Call:
    """One attention call: the differentiable leaves and the options fusedattn and naive share."""

    layout: str
    leaves: dict  # name -> tensor: q, k, v / qkv / q, kv; bias; alibi_slopes; sink
    positional: tuple  # names of the leaves passed as q, k, v
    options: dict  # mask, window, bias_type, softmax_type, scale, cu_seqlens*, score_mod
    grid: tuple  # (Sq, Skv) of the padded score grid (the longest sequences for THD)
    batch: int
    heads_q: int
    fused_options: dict = dataclasses.field(default_factory=dict)  # max_seqlen_q/kv

    def fused(self, leaves=None, **extra):
        leaves = self.leaves if leaves is None else leaves
        options = dict(self.options)
        if options.get("score_mod") is not None:  # the naive's FlexAttention-style functions
            options["score_mod"] = score_mods.eager(options["score_mod"])
        return attention(*(leaves[n] for n in self.positional), layout=self.layout,
                         bias=leaves.get("bias"), alibi_slopes=leaves.get("alibi_slopes"),
                         sink=leaves.get("sink"), **options, **self.fused_options, **extra)

    def naive(self, leaves=None, **extra):
        leaves = self.leaves if leaves is None else leaves
        leaves = {n: x.detach().to(F64).requires_grad_(x.requires_grad) for n, x in leaves.items()}
        options = {n: (x.tolist() if isinstance(x, torch.Tensor) else x) for n, x in self.options.items()}
        result = naive_attention(*(leaves[n] for n in self.positional), layout=self.layout,
                                 bias=leaves.get("bias"), alibi_slopes=leaves.get("alibi_slopes"),
                                 sink=leaves.get("sink"), **options, **extra)
        return result, leaves

    def keep(self, seed, offset, p):
        """The dropout mask the reference draws for (seed, offset), as (B, Hq, Sq, Skv)."""
        seed, offset = torch.tensor(seed, dtype=torch.int64), torch.tensor(offset, dtype=torch.int64)
        return dropout_keep(namespace(seed), seed, offset, (self.batch, self.heads_q) + self.grid, p)


def make_call(gen, *, layout="bshd", B=2, Sq=5, Skv=7, Hq=4, Hkv=2, D=8, Dv=None, mask="none", window=None,
              bias_shape=None, bias_type=None, alibi_shape=None, softmax_type="vanilla", lens_q=None,
              lens_kv=None, gaps=False, score_mod=None, scale=None, dtype=F32, q_scale=1.0,
              max_seqlen=None, bias_grad=True) -> Call:
    Dv = D if Dv is None else Dv
    base = BASE_LAYOUT[layout]
    options = dict(mask=mask)
    fused_options = {}
    for name, value in (("window", window), ("bias_type", bias_type), ("scale", scale),
                        ("score_mod", score_mod)):
        if value is not None:
            options[name] = value
    if softmax_type != "vanilla":
        options["softmax_type"] = softmax_type
    if layout in ("bs3hd", "sb3hd", "t3hd"):
        assert Hq == Hkv and D == Dv and (Sq == Skv or base == "thd")
    if base == "thd":
        lens_q = list(lens_q)
        lens_kv = list(lens_q if layout == "t3hd" else lens_kv)
        B = len(lens_q)
        cu_q, padded_q, tq = offsets(lens_q, gaps)
        cu_kv, padded_kv, tkv = offsets(lens_kv, gaps)
        int32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        options.update(cu_seqlens_q=int32(cu_q), cu_seqlens_kv=int32(cu_kv))
        if gaps:
            options.update(cu_seqlens_q_padded=int32(padded_q), cu_seqlens_kv_padded=int32(padded_kv))
        Sq, Skv = max(lens_q), max(lens_kv)
        if max_seqlen is not None:
            Sq, Skv = max_seqlen
            fused_options.update(max_seqlen_q=Sq, max_seqlen_kv=Skv)
        q_shape, k_shape, v_shape = (tq, Hq, D), (tkv, Hkv, D), (tkv, Hkv, Dv)
    else:
        if mask.startswith("padding"):
            lens_q = lens_q if lens_q is not None else [Sq - b % 3 for b in range(B)]
            lens_kv = lens_kv if lens_kv is not None else [Skv - (b + 1) % 3 for b in range(B)]
            options.update(cu_seqlens_q=torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()]),
                           cu_seqlens_kv=torch.tensor([0, *torch.tensor(lens_kv).cumsum(0).tolist()]))
        q_shape, k_shape, v_shape = (base_shape(base, B, Sq, Hq, D), base_shape(base, B, Skv, Hkv, D),
                                     base_shape(base, B, Skv, Hkv, Dv))
    leaves = {}
    if layout in ("bs3hd", "sb3hd", "t3hd"):
        packed = list(q_shape)
        packed.insert(-2, 3)
        leaves["qkv"] = randn(gen, tuple(packed), dtype, q_scale)
        positional = ("qkv",)
    elif layout in ("bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd"):
        assert D == Dv
        packed = list(k_shape)
        packed.insert(-2, 2)
        leaves["q"] = randn(gen, q_shape, dtype, q_scale)
        leaves["kv"] = randn(gen, tuple(packed), dtype)
        positional = ("q", "kv")
    else:
        leaves["q"] = randn(gen, q_shape, dtype, q_scale)
        leaves["k"] = randn(gen, k_shape, dtype)
        leaves["v"] = randn(gen, v_shape, dtype)
        positional = ("q", "k", "v")
    if bias_shape is not None:
        leaves["bias"] = randn(gen, bias_shape, dtype, grad=bias_grad)
    if alibi_shape is not None:
        # Positive slopes of different sizes per head (and per sequence for (B, Hq)).
        leaves["alibi_slopes"] = (0.1 + torch.rand(alibi_shape, generator=gen, dtype=F64)).to(dtype)
        leaves["alibi_slopes"].requires_grad_()
    if softmax_type == "learnable":
        leaves["sink"] = randn(gen, (Hq,), dtype)
    return Call(layout, leaves, positional, options, (Sq, Skv), B, Hq, fused_options)


def check(gen, ran, *, backend=None, dropout=None, **case):
    """Run one case through fusedattn and naive; compare out, lse, max_logit and every gradient.

    dropout: (p, seed, offset). Returns (call, fused result, naive result).
    """
    call = make_call(gen, **case)
    extra = {}
    naive_extra = {}
    if dropout is not None:
        p, seed, offset = dropout
        extra.update(dropout_p=p, dropout_seed=seed, dropout_offset=offset)
        naive_extra.update(dropout_keep=call.keep(seed, offset, p), dropout_p=p)
    result = call.fused(return_lse=True, return_max_logit=True, backend=backend, **extra)
    assert isinstance(result, AttentionResult)
    (out, lse, max_logit), leaves64 = call.naive(**naive_extra)
    assert result.out.dtype == case.get("dtype", F32)
    stats = F64 if result.out.dtype == F64 else F32  # float64 calls keep float64 statistics
    assert result.lse.dtype == stats and result.max_logit.dtype == stats
    assert_matches(result.out, out, "out")
    assert_matches(result.lse, lse, "lse")
    assert_matches(result.max_logit, max_logit, "max_logit")
    assert not result.max_logit.requires_grad

    # Gradients against random cotangents of out and of the finite lse entries.
    # (The cotangents are rounded to the outputs' dtypes first, so both sides see the same values.)
    finite = torch.isfinite(lse)
    g_out = torch.randn(out.shape, generator=gen, dtype=F64).to(result.out.dtype)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=F64).to(stats)
    names = [n for n, x in call.leaves.items() if x.requires_grad]
    grads = torch.autograd.grad(
        [result.out, torch.where(finite, result.lse, 0.0)], [call.leaves[n] for n in names],
        [g_out, g_lse], allow_unused=True, retain_graph=True)
    expected = gradients([out, torch.where(finite, lse, 0.0)], [leaves64[n] for n in names],
                         [g_out.to(F64), g_lse.to(F64)])
    for name, grad, want in zip(names, grads, expected):
        assert grad is not None, f"no gradient for {name}"
        assert grad.dtype == call.leaves[name].dtype
        assert_matches(grad, want, f"grad {name}")
    assert_reference_ran(ran)
    return call, result, (out, lse, max_logit)


# --------------------------------------------------------------------------------------------
# The naive attention itself, against independent facts
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "causal", "bias", "gqa", "scale"])
def test_naive_matches_torch_sdpa(gen, case):
    """naive_attention agrees with torch's own SDPA where the semantics coincide (top-left causal)."""
    heads_kv = 2 if case == "gqa" else 4
    q, k, v = randn(gen, (2, 5, 4, 8), F64), randn(gen, (2, 5, heads_kv, 8), F64), randn(gen, (2, 5, heads_kv, 6), F64)
    bias = randn(gen, (2, 1, 5, 5), F64) if case == "bias" else None
    scale = 0.3 if case == "scale" else None
    out, lse, _ = naive_attention(q, k, v, mask="causal" if case == "causal" else "none", bias=bias, scale=scale)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, is_causal=case == "causal",
        scale=scale, enable_gqa=case == "gqa").transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    g = torch.randn(out.shape, generator=gen, dtype=F64)
    for x, y in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(want, (q, k, v), g)):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)


# Visibility tables written out by hand: (Sq, Skv, mask, window, lens_q, lens_kv) -> rows.
VISIBILITY = [
    (3, 5, "causal", None, None, None, ["10000", "11000", "11100"]),
    (3, 5, "causal_bottom_right", None, None, None, ["11100", "11110", "11111"]),
    (5, 3, "causal", None, None, None, ["100", "110", "111", "111", "111"]),
    (5, 3, "causal_bottom_right", None, None, None, ["000", "000", "100", "110", "111"]),
    (5, 3, "none", (1, 0), None, None, ["000", "000", "100", "110", "011"]),
    (3, 5, "none", (0, 1), None, None, ["00110", "00011", "00001"]),
    (4, 4, "causal", (1, -1), None, None, ["1000", "1100", "0110", "0011"]),
    (4, 4, "causal_bottom_right", (0, 0), None, None, ["1000", "0100", "0010", "0001"]),
    (3, 3, "none", (0, 1), None, None, ["110", "011", "001"]),
    (3, 3, "none", (-1, 0), None, None, ["100", "110", "111"]),
    (3, 4, "padding", None, [2], [3], ["1110", "1110", "0000"]),
    (3, 4, "padding_causal", None, [2], [3], ["1000", "1100", "0000"]),
    (3, 4, "padding_causal_bottom_right", None, [2], [3], ["1100", "1110", "0000"]),
    (3, 4, "padding", (0, 0), [2], [3], ["0100", "0010", "0000"]),
]


@pytest.mark.parametrize("Sq,Skv,mask,window,lens_q,lens_kv,rows", VISIBILITY)
def test_visibility_pattern(gen, ran, Sq, Skv, mask, window, lens_q, lens_kv, rows):
    """With v = identity, out[i, j] is the weight of key j for query i: > 0 exactly where visible."""
    call = make_call(gen, B=1, Sq=Sq, Skv=Skv, Hq=2, Hkv=2, D=4, Dv=Skv, mask=mask, window=window,
                     lens_q=lens_q, lens_kv=lens_kv)
    call.leaves["v"] = torch.eye(Skv).reshape(1, Skv, 1, Skv).expand(1, Skv, 2, Skv).clone()
    want = torch.tensor([[c == "1" for c in row] for row in rows])
    out = call.fused()
    assert_reference_ran(ran, backward=False)
    (naive_out, _, _), _ = call.naive()
    for h in range(2):
        assert torch.equal(out[0, :, h] > 0, want)
        assert torch.equal(naive_out[0, :, h] > 0, want)
        visible_rows = want.any(1)
        torch.testing.assert_close(out[0, visible_rows, h].sum(1), torch.ones(int(visible_rows.sum())))


def test_selection_on_cpu_is_reference():
    """On CPU every backend but the reference gives reasons; a forced reference is accepted."""
    for changes in ({}, {"mask": "causal", "window": (2, 0)}, {"dtype": "bfloat16", "softmax": "learnable"},
                    {"layout": "thd", "mask": "padding"}):
        cfg = fusedattn.AttentionConfig(**{"dtype": "float32", "layout": "bshd", "batch": 2, "seqlen_q": 5,
                                           "seqlen_kv": 7, "heads_q": 4, "heads_kv": 2, "head_dim_qk": 8,
                                           "head_dim_v": 8, **changes})
        selection = fusedattn.select_backend(cfg)
        assert selection.name == "reference"
        assert set(selection.rejected) == {b.name for b in BACKENDS} - {"reference"}
        assert all(reasons for reasons in selection.rejected.values())
        assert fusedattn.select_backend(cfg, "reference").name == "reference"


# --------------------------------------------------------------------------------------------
# Masks, alignment, windows
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Sq,Skv", [(5, 8), (8, 5), (6, 6)])
@pytest.mark.parametrize("mask", MASKS)
def test_masks(gen, ran, mask, Sq, Skv):
    check(gen, ran, mask=mask, Sq=Sq, Skv=Skv)


@pytest.mark.parametrize("mask,lens_q,lens_kv", [
    ("padding", [5, 2, 1], [3, 7, 1]),
    ("padding_causal", [5, 2, 4], [3, 7, 1]),
    ("padding_causal_bottom_right", [5, 2, 4], [3, 7, 1]),
    ("padding_causal_bottom_right", [1, 5, 5], [7, 2, 5]),
])
def test_padding_masks_uneven_lengths(gen, ran, mask, lens_q, lens_kv):
    check(gen, ran, mask=mask, B=3, Sq=5, Skv=7, lens_q=lens_q, lens_kv=lens_kv)


@pytest.mark.parametrize("Sq,Skv", [(5, 8), (8, 5)])
@pytest.mark.parametrize("window", [(2, -1), (-1, 1), (-1, 0), (1, 1), (0, 0), (3, 0), (0, 2), (2, 3)])
@pytest.mark.parametrize("mask", MASKS)
def test_window(gen, ran, mask, window, Sq, Skv):
    if "causal" in mask and window[1] > 0:
        with pytest.raises(ValueError, match="window"):
            make_call(gen, mask=mask, window=window, Sq=Sq, Skv=Skv).fused()
        return
    check(gen, ran, mask=mask, window=window, Sq=Sq, Skv=Skv)


@pytest.mark.parametrize("window", [(1, -1), (0, 0), (2, 1)])
@pytest.mark.parametrize("mask", ["padding", "padding_causal", "padding_causal_bottom_right"])
def test_window_thd(gen, ran, mask, window):
    if "causal" in mask and window[1] > 0:
        window = (window[0], 0)
    check(gen, ran, layout="thd", mask=mask, window=window, lens_q=[3, 0, 5], lens_kv=[4, 2, 3], gaps=True)


# --------------------------------------------------------------------------------------------
# Bias, ALiBi, scale
# --------------------------------------------------------------------------------------------

BIAS_SHAPES = ["11qk", "b1qk", "1hqk", "bhqk", "qk", "111k", "bh1k"]


def bias_shape(code, B, H, Sq, Skv):
    sizes = {"1": 1, "b": B, "h": H, "q": Sq, "k": Skv}
    return tuple(sizes[c] for c in code)


@pytest.mark.parametrize("mask", ["none", "causal_bottom_right"])
@pytest.mark.parametrize("shape", BIAS_SHAPES)
@pytest.mark.parametrize("bias_type", ["pre_scale", "post_scale", None])
def test_bias(gen, ran, bias_type, shape, mask):
    check(gen, ran, bias_type=bias_type, bias_shape=bias_shape(shape, 2, 4, 5, 7), mask=mask, B=2, Hq=4,
          Sq=5, Skv=7, scale=0.4 if bias_type == "pre_scale" else None)


@pytest.mark.parametrize("shape", ["b1qk", "1hqk"])
def test_bias_with_padding_mask(gen, ran, shape):
    check(gen, ran, bias_shape=bias_shape(shape, 3, 4, 6, 5), mask="padding_causal", B=3, Hq=4, Sq=6, Skv=5,
          lens_q=[6, 3, 2], lens_kv=[5, 4, 1])


def test_bias_without_grad(gen, ran):
    call, result, _ = check(gen, ran, bias_shape=(1, 4, 5, 7), bias_grad=False)
    result.out.sum().backward()
    assert call.leaves["bias"].grad is None and call.leaves["q"].grad is not None


@pytest.mark.parametrize("Sq,Skv", [(5, 8), (8, 5)])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "padding", "padding_causal_bottom_right"])
@pytest.mark.parametrize("alibi", ["h", "bh"])
def test_alibi(gen, ran, alibi, mask, Sq, Skv):
    check(gen, ran, alibi_shape=(4,) if alibi == "h" else (2, 4), mask=mask, B=2, Hq=4, Sq=Sq, Skv=Skv)


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_alibi_thd(gen, ran, mask):
    check(gen, ran, layout="thd", alibi_shape=(3, 4), mask=mask, lens_q=[3, 0, 5], lens_kv=[4, 2, 3], gaps=True)


@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5])
def test_scale(gen, ran, scale):
    check(gen, ran, scale=scale, mask="causal", bias_shape=(1, 4, 5, 7), bias_type="pre_scale")


# --------------------------------------------------------------------------------------------
# Heads, head dims, softmax types
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "bhsd", "bshd_bs2hd", "thd", "sbhd_sb2hd"])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_gqa_mqa(gen, ran, layout, Hkv):
    check(gen, ran, layout=layout, Hq=4, Hkv=Hkv, mask="causal_bottom_right", lens_q=[3, 5], lens_kv=[6, 2])


@pytest.mark.parametrize("D,Dv", [(8, 8), (8, 4), (4, 12), (16, 2)])
@pytest.mark.parametrize("layout", ["bshd", "sbhd", "thd"])
def test_head_dims(gen, ran, layout, D, Dv):
    check(gen, ran, layout=layout, D=D, Dv=Dv, Hkv=1, mask="padding_causal", lens_q=[4, 5], lens_kv=[7, 3])


@pytest.mark.parametrize("mask,Sq,Skv", [("none", 5, 7), ("causal", 6, 4), ("causal_bottom_right", 7, 4),
                                         ("padding_causal_bottom_right", 5, 7)])
@pytest.mark.parametrize("softmax_type", ["vanilla", "off_by_one", "learnable"])
def test_softmax_types(gen, ran, softmax_type, mask, Sq, Skv):
    check(gen, ran, softmax_type=softmax_type, mask=mask, Sq=Sq, Skv=Skv, q_scale=2.0)


@pytest.mark.parametrize("softmax_type", ["off_by_one", "learnable"])
def test_softmax_sink_thd(gen, ran, softmax_type):
    check(gen, ran, layout="thd", softmax_type=softmax_type, mask="padding_causal_bottom_right",
          lens_q=[3, 0, 5, 2], lens_kv=[4, 2, 3, 0], gaps=True)


def test_sink_enters_denominator(gen, ran):
    """A very large sink takes nearly all the mass (out -> 0); a very negative one changes nothing."""
    call = make_call(gen, softmax_type="learnable")
    with torch.no_grad():
        call.leaves["sink"].fill_(-60.0)
    low = call.fused(return_lse=True)
    with torch.no_grad():
        call.leaves["sink"].fill_(60.0)
    high = call.fused(return_lse=True)
    assert_reference_ran(ran, backward=False)
    vanilla = attention(*(call.leaves[n] for n in call.positional), return_lse=True)
    torch.testing.assert_close(low.out, vanilla.out)
    torch.testing.assert_close(low.lse, vanilla.lse)
    assert high.out.abs().max() < 1e-20
    torch.testing.assert_close(high.lse, torch.full_like(high.lse, 60.0))


# --------------------------------------------------------------------------------------------
# Layouts and THD
# --------------------------------------------------------------------------------------------

def layout_case(layout, mask):
    three = layout in ("bs3hd", "sb3hd", "t3hd")
    kv_packed = layout.endswith("2hd")
    return dict(layout=layout, mask=mask, B=2, Sq=6, Skv=6 if three else 4, Hq=4, Hkv=4 if three else 2,
                D=8, Dv=8 if three or kv_packed else 6, lens_q=[5, 2] if three else [3, 6],
                lens_kv=[5, 2] if three else [4, 1])


@pytest.mark.parametrize("mask", ["none", "causal", "padding_causal_bottom_right", "padding"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts(gen, ran, layout, mask):
    check(gen, ran, **layout_case(layout, mask))


@pytest.mark.parametrize("layout", ["thd", "t3hd", "thd_t2hd"])
def test_layouts_padded_offsets(gen, ran, layout):
    check(gen, ran, layout=layout, mask="padding_causal", Hq=2, Hkv=2, lens_q=[3, 0, 4], lens_kv=[2, 5, 4],
          gaps=True)


def test_packed_layout_grad_is_one_tensor(gen, ran):
    """bs3hd's gradient arrives on the packed tensor, its q/k/v parts each from its own role."""
    call, result, _ = check(gen, ran, layout="bs3hd", Sq=5, Skv=5, Hq=2, Hkv=2, mask="causal")
    qkv = call.leaves["qkv"]
    (grad,) = torch.autograd.grad(result.out.sum(), qkv)
    assert grad.shape == qkv.shape and all(grad[:, :, i].abs().sum() > 0 for i in range(3))


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("mask", MASKS)
def test_thd_uneven(gen, ran, mask, gaps):
    """Uneven lengths with an empty q sequence and an empty kv sequence; masks become padding masks."""
    check(gen, ran, layout="thd", mask=mask, lens_q=[3, 0, 6, 2], lens_kv=[5, 3, 2, 0], gaps=gaps)


def test_thd_larger_max_seqlen(gen, ran):
    """An explicit max_seqlen above the longest sequence changes nothing."""
    check(gen, ran, layout="thd", mask="padding_causal_bottom_right", lens_q=[3, 1], lens_kv=[4, 2],
          max_seqlen=(7, 9), gaps=True)


def test_thd_matches_padded_bshd(gen, ran):
    """The same sequences packed (thd, gaps) and padded (bshd + padding mask) give the same result."""
    lens_q, lens_kv = [3, 5, 1], [4, 2, 5]
    call = make_call(gen, layout="thd", mask="padding_causal_bottom_right", lens_q=lens_q, lens_kv=lens_kv,
                     gaps=True, D=4)
    thd = call.fused(return_lse=True)
    cu_q = call.options["cu_seqlens_q"]
    cu_kv = call.options["cu_seqlens_kv"]
    starts_q, starts_kv = call.options["cu_seqlens_q_padded"], call.options["cu_seqlens_kv_padded"]

    def pad(x, starts, lens, S):
        out = torch.zeros((len(lens), S) + x.shape[1:])
        for b, n in enumerate(lens):
            out[b, :n] = x[starts[b]:starts[b] + n]
        return out

    starts_q = [int(x) for x in starts_q]
    starts_kv = [int(x) for x in starts_kv]
    q = pad(call.leaves["q"].detach(), starts_q, lens_q, 5)
    k = pad(call.leaves["k"].detach(), starts_kv, lens_kv, 5)
    v = pad(call.leaves["v"].detach(), starts_kv, lens_kv, 5)
    padded = attention(q, k, v, mask="padding_causal_bottom_right", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv,
                       return_lse=True)
    assert_reference_ran(ran, backward=False)
    starts_q = [int(x) for x in starts_q]
    starts_kv = [int(x) for x in starts_kv]
    for b, n in enumerate(lens_q):
        s = starts_q[b]
        torch.testing.assert_close(thd.out[s:s + n], padded.out[b, :n])
        torch.testing.assert_close(thd.lse[s:s + n], padded.lse[b, :, :n].T)
    outside = torch.ones(thd.out.shape[0], dtype=torch.bool)
    for b, n in enumerate(lens_q):
        outside[int(starts_q[b]):int(starts_q[b]) + n] = False
    assert outside.any() and thd.out[outside].abs().max() == 0 and thd.lse[outside].abs().max() == 0
    assert cu_q.dtype == torch.int32 and cu_kv.dtype == torch.int32


# --------------------------------------------------------------------------------------------
# Outputs: return_lse / return_max_logit, fully masked rows
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_return_flags(gen, ran, layout):
    call = make_call(gen, layout=layout, mask="causal", lens_q=[3, 4], lens_kv=[5, 2])
    bare = call.fused()
    with_lse = call.fused(return_lse=True)
    with_max = call.fused(return_max_logit=True)
    both = call.fused(return_lse=True, return_max_logit=True)
    assert_reference_ran(ran, backward=False)
    assert isinstance(bare, torch.Tensor) and not isinstance(bare, tuple)
    assert isinstance(with_lse, AttentionResult) and with_lse.max_logit is None
    assert isinstance(with_max, AttentionResult) and with_max.lse is None
    for result in (with_lse, with_max, both):
        assert torch.equal(result.out, bare)
    lse_shape = (call.leaves["q"].shape[0], 4) if layout == "thd" else (2, 4, 5)
    assert both.lse.shape == lse_shape and both.lse.dtype == F32
    assert torch.equal(both.lse, with_lse.lse)
    assert both.max_logit.shape == (4,) and both.max_logit.dtype == F32
    assert torch.equal(both.max_logit, with_max.max_logit)
    assert not both.max_logit.requires_grad
    (_, lse, max_logit), _ = call.naive()
    assert_matches(both.lse, lse, "lse")
    assert_matches(both.max_logit, max_logit, "max_logit")


FULLY_MASKED = {
    # name: case; every case has rows that see no key
    "bottom_right_sq_gt_skv": dict(mask="causal_bottom_right", Sq=7, Skv=3),
    "window_before_start": dict(mask="none", window=(0, 0), Sq=7, Skv=4),
    "padding_empty_kv": dict(mask="padding", B=3, Sq=5, Skv=6, lens_q=[5, 3, 2], lens_kv=[6, 0, 2]),
    "padding_all_kv_empty": dict(mask="padding_causal", B=2, Sq=4, Skv=6, lens_q=[4, 2], lens_kv=[0, 0]),
    "thd_empty_kv": dict(layout="thd", mask="padding", lens_q=[3, 4], lens_kv=[0, 5], gaps=True),
    "bottom_right_padding": dict(mask="padding_causal_bottom_right", B=2, Sq=6, Skv=6, lens_q=[6, 5],
                                 lens_kv=[2, 5]),
}


@pytest.mark.parametrize("softmax_type", ["vanilla", "off_by_one", "learnable"])
@pytest.mark.parametrize("name", list(FULLY_MASKED))
def test_fully_masked_rows(gen, ran, name, softmax_type):
    """Rows with no visible key: out exactly 0, lse -inf (or the sink term), finite gradients."""
    case = FULLY_MASKED[name]
    call, result, (out, lse, _) = check(gen, ran, softmax_type=softmax_type, **case)
    empty = (out == 0).all(-1)  # naive rows with no weight
    assert empty.any()
    assert (result.out.detach()[empty] == 0).all()
    grads = torch.autograd.grad(result.out.sum() + torch.where(torch.isfinite(lse), result.lse, 0).sum(),
                                [x for x in call.leaves.values()], allow_unused=True)
    assert all(g is None or torch.isfinite(g).all() for g in grads)


def test_fully_masked_max_logit(gen, ran):
    """No visible key anywhere: max_logit is -inf for every head, out 0, lse -inf."""
    call = make_call(gen, mask="padding", B=2, Sq=3, Skv=4, lens_q=[3, 2], lens_kv=[0, 0])
    result = call.fused(return_lse=True, return_max_logit=True)
    assert torch.equal(result.max_logit, torch.full((4,), -INF))
    assert (result.out == 0).all() and (result.lse == -INF).all()
    result.out.sum().backward()
    assert all(torch.isfinite(x.grad).all() and (x.grad == 0).all() for x in call.leaves.values())
    assert_reference_ran(ran)


def test_padding_rows_with_sink(gen, ran):
    """Padded layouts: rows past len_q are not queries: out 0 and lse -inf, whatever the softmax."""
    call = make_call(gen, mask="padding", softmax_type="learnable", B=2, Sq=5, Skv=4, lens_q=[2, 5],
                     lens_kv=[4, 3])
    result = call.fused(return_lse=True)
    assert (result.out[0, 2:] == 0).all()
    assert (result.lse[0, :, 2:] == -INF).all(), f"lse of padding rows: {result.lse[0, :, 2:]}"
    assert_reference_ran(ran, backward=False)


# --------------------------------------------------------------------------------------------
# score_mod
# --------------------------------------------------------------------------------------------

SCORE_MODS = {
    "softcap30": lambda s, b, h, qi, kj: 30 * torch.tanh(s / 30),
    "softcap3": lambda s, b, h, qi, kj: 3 * torch.tanh(s / 3),
    "relative_position": lambda s, b, h, qi, kj: s - 0.3 * (qi - kj).abs() + 0.1 * (qi - kj),
    "by_head_and_batch": lambda s, b, h, qi, kj: s * (1 + 0.25 * h) - 0.5 * b,
    "where": lambda s, b, h, qi, kj: torch.where(kj % 2 == 0, s, s - 1.0),
}


@pytest.mark.parametrize("setting", [
    dict(mask="causal"),
    dict(mask="padding_causal_bottom_right", bias_shape=(1, 4, 5, 7)),
    dict(layout="thd", mask="padding", lens_q=[3, 0, 5], lens_kv=[4, 2, 3], gaps=True, alibi_shape=(4,)),
], ids=["causal", "padding_bias", "thd_alibi"])
@pytest.mark.parametrize("mod", list(SCORE_MODS))
def test_score_mod(gen, ran, mod, setting):
    check(gen, ran, score_mod=SCORE_MODS[mod], q_scale=3.0, **setting)


def test_score_mod_reads_captured_tensor(gen, ran):
    table = torch.randn(4, generator=gen)
    check(gen, ran, score_mod=lambda s, b, h, qi, kj: s + table[h], mask="causal", softmax_type="learnable")


# --------------------------------------------------------------------------------------------
# Dropout
# --------------------------------------------------------------------------------------------

def dropout_run(call, seed, offset, p=0.3):
    result = call.fused(dropout_p=p, dropout_seed=seed, dropout_offset=offset, return_lse=True)
    grads = torch.autograd.grad(result.out.square().sum(), list(call.leaves.values()))
    return result, grads


def test_dropout_reproducible(gen, ran):
    call = make_call(gen, mask="causal", softmax_type="learnable", bias_shape=(1, 4, 5, 7))
    first, first_grads = dropout_run(call, seed=11, offset=3)
    again, again_grads = dropout_run(call, seed=11, offset=3)
    tensor_seed, tensor_grads = dropout_run(call, seed=torch.tensor(11), offset=torch.tensor(3))
    other_seed, _ = dropout_run(call, seed=12, offset=3)
    other_offset, _ = dropout_run(call, seed=11, offset=4)
    assert_reference_ran(ran)
    assert torch.equal(first.out, again.out) and torch.equal(first.out, tensor_seed.out)
    for a, b, c in zip(first_grads, again_grads, tensor_grads):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(first.out, other_seed.out)
    assert not torch.equal(first.out, other_offset.out)
    assert torch.equal(first.lse, other_seed.lse)  # lse does not see dropout
    no_dropout = call.fused(return_lse=True)
    torch.testing.assert_close(first.lse, no_dropout.lse)


def test_dropout_global_seed(gen, ran):
    """Without a seed, one is drawn from torch's generator: torch.manual_seed reproduces the call."""
    call = make_call(gen)
    torch.manual_seed(1234)
    a = call.fused(dropout_p=0.4)
    torch.manual_seed(1234)
    b = call.fused(dropout_p=0.4)
    c = call.fused(dropout_p=0.4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert_reference_ran(ran, backward=False)


@pytest.mark.parametrize("p", [0.1, 0.5])
@pytest.mark.parametrize("case", [
    dict(mask="causal", bias_shape=(2, 1, 5, 7)),
    dict(mask="padding_causal_bottom_right", softmax_type="learnable", Hkv=1),
    dict(layout="thd", mask="padding", lens_q=[3, 0, 5], lens_kv=[4, 2, 3], gaps=True, alibi_shape=(4,)),
    dict(layout="bs3hd", Sq=6, Skv=6, Hq=2, Hkv=2, mask="none"),
    dict(layout="thd_t2hd", mask="padding_causal", lens_q=[4, 2], lens_kv=[3, 6], max_seqlen=(6, 8)),
], ids=["causal_bias", "padding_sink_mqa", "thd_alibi", "bs3hd", "thd_t2hd"])
def test_dropout_matches_naive(gen, ran, case, p):
    """Forward and backward use the mask of (seed, offset): both match naive with that keep mask."""
    check(gen, ran, dropout=(p, 5 + int(10 * p), 7), **case)


def test_dropout_pattern_and_rate(gen, ran):
    """With v = identity the output shows each weight: dropped ones are 0, kept ones P / (1 - p),
    the dropped fraction is near p, and the pattern is the keep mask of (seed, offset)."""
    p, S, H = 0.3, 32, 4
    call = make_call(gen, B=2, Sq=S, Skv=S, Hq=H, Hkv=H, D=8, Dv=S)
    call.leaves["v"] = torch.eye(S).reshape(1, S, 1, S).expand(2, S, H, S).clone().requires_grad_()
    out = call.fused(dropout_p=p, dropout_seed=99, dropout_offset=1)
    weights = out.detach().permute(0, 2, 1, 3)  # (B, H, Sq, Skv)
    dropped = weights == 0
    assert abs(dropped.double().mean().item() - p) < 0.03
    keep = call.keep(99, 1, p)
    assert torch.equal(~dropped, keep)
    (naive_out, _, _), _ = call.naive()
    naive_weights = naive_out.permute(0, 2, 1, 3)
    torch.testing.assert_close(weights[keep].double(), naive_weights[keep] / (1 - p), rtol=1e-5, atol=1e-7)
    assert_reference_ran(ran, backward=False)


# --------------------------------------------------------------------------------------------
# Low precision (STYLE rule 15)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [
    dict(mask="causal"),
    dict(mask="causal_bottom_right", bias_shape=(2, 1, 5, 7), Hkv=1, Dv=4),
    dict(mask="padding_causal_bottom_right", softmax_type="learnable", alibi_shape=(2, 4)),
    dict(layout="thd", mask="padding_causal", lens_q=[3, 0, 5], lens_kv=[4, 2, 3], gaps=True,
         softmax_type="off_by_one", window=(2, 0)),
    dict(layout="bs3hd", Sq=6, Skv=6, Hq=2, Hkv=2, score_mod=SCORE_MODS["softcap3"], q_scale=3.0),
], ids=["causal", "bias_mqa", "sink_alibi", "thd_window", "bs3hd_softcap"])
@pytest.mark.parametrize("dtype", [BF16, F16])
def test_low_precision(gen, ran, dtype, case):
    check(gen, ran, dtype=dtype, **case)


@pytest.mark.parametrize("case", [
    dict(mask="causal", bias_shape=(1, 4, 5, 7), softmax_type="learnable"),
    dict(layout="thd", mask="padding_causal_bottom_right", lens_q=[3, 0, 5], lens_kv=[4, 2, 3], gaps=True,
         alibi_shape=(4,)),
], ids=["bias_sink", "thd_alibi"])
def test_float64(gen, ran, case):
    check(gen, ran, dtype=F64, **case)


# --------------------------------------------------------------------------------------------
# Features combined at random (seeded: the same cases on every run)
# --------------------------------------------------------------------------------------------

def random_case(rng: random.Random) -> dict:
    layout = rng.choice(LAYOUTS)
    three, kv_packed, ragged = layout in ("bs3hd", "sb3hd", "t3hd"), layout.endswith("2hd"), layout[0] == "t"
    B = rng.randint(1, 3)
    Hkv = rng.choice([1, 2])
    Hq = Hkv if three else Hkv * rng.choice([1, 2])
    D = rng.choice([2, 4, 8])
    Dv = D if three or kv_packed else rng.choice([2, 4, 8])
    Sq, Skv = rng.randint(1, 8), rng.randint(1, 8)
    Skv = Sq if three else Skv
    mask = rng.choice(MASKS)
    right = rng.choice([-1, 0] if "causal" in mask else [-1, 0, 1, 3])
    window = rng.choice([None, (rng.choice([-1, 0, 1, 3]), right)])
    case = dict(layout=layout, B=B, Sq=Sq, Skv=Skv, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, mask=mask, window=window,
                softmax_type=rng.choice(["vanilla", "off_by_one", "learnable"]),
                dtype=rng.choice([F32, F32, F32, F64, BF16, F16]), q_scale=rng.choice([0.5, 1.0, 3.0]))
    if ragged:
        case["lens_q"] = [rng.randint(0, Sq) for _ in range(B)]
        case["lens_kv"] = list(case["lens_q"]) if three else [rng.randint(0, Skv) for _ in range(B)]
        case["gaps"] = rng.random() < 0.5
        if max(case["lens_q"]) == 0 or max(case["lens_kv"]) == 0:
            case["lens_q"][0] = case["lens_kv"][0] = 1
    elif mask.startswith("padding"):
        case["lens_q"] = [rng.randint(0, Sq) for _ in range(B)]
        case["lens_kv"] = list(case["lens_q"]) if three else [rng.randint(0, Skv) for _ in range(B)]
    extra = rng.choice(["bias", "alibi", "none", "none"] if not ragged else ["alibi", "none"])
    if extra == "bias":
        code = "".join(rng.choice(pair) for pair in ("1b", "1h", "1q", "1k"))
        case["bias_shape"] = bias_shape(code, B, Hq, Sq, Skv)
        case["bias_type"] = rng.choice(["pre_scale", "post_scale"])
    elif extra == "alibi":
        case["alibi_shape"] = rng.choice([(Hq,), (B, Hq)])
    if rng.random() < 0.3:
        case["score_mod"] = SCORE_MODS[rng.choice(sorted(SCORE_MODS))]
    if rng.random() < 0.3:
        case["scale"] = rng.choice([0.2, 0.9])
    return case


@pytest.mark.parametrize("seed", range(60))
def test_random_combinations(gen, ran, seed):
    rng = random.Random(seed)
    case = random_case(rng)
    dropout = (0.3, rng.randint(0, 1000), rng.randint(0, 10)) if rng.random() < 0.3 else None
    check(gen, ran, dropout=dropout, **case)


# --------------------------------------------------------------------------------------------
# gradcheck through the public API
# --------------------------------------------------------------------------------------------

GRADCHECK_CASES = {
    "bshd_causal_window_bias_sink_gqa": dict(
        B=2, Sq=3, Skv=4, Hq=2, Hkv=1, D=3, Dv=2, mask="causal", window=(2, 0), bias_shape=(1, 2, 3, 4),
        softmax_type="learnable"),
    "thd_gaps_alibi_dropout_softcap": dict(
        layout="thd", Hq=2, Hkv=1, D=3, Dv=2, mask="padding_causal_bottom_right", lens_q=[2, 0, 3],
        lens_kv=[3, 1, 3], gaps=True, alibi_shape=(3, 2), softmax_type="off_by_one",
        score_mod=SCORE_MODS["softcap3"]),
    "bs3hd_padding_pre_scale_bias": dict(
        layout="bs3hd", B=2, Sq=3, Skv=3, Hq=2, Hkv=2, D=2, mask="padding", lens_q=[3, 2], lens_kv=[3, 2],
        bias_shape=(2, 1, 3, 3), bias_type="pre_scale", scale=0.7),
}


@pytest.mark.parametrize("name", list(GRADCHECK_CASES))
def test_gradcheck(gen, ran, name):
    case = GRADCHECK_CASES[name]
    call = make_call(gen, dtype=F64, **case)
    dropout = dict(dropout_p=0.25, dropout_seed=3, dropout_offset=1) if "dropout" in name else {}
    names = list(call.leaves)

    def f(*xs):
        return call.fused(dict(zip(names, xs)), **dropout)

    assert torch.autograd.gradcheck(f, tuple(call.leaves[n] for n in names), eps=1e-6, atol=1e-6)
    assert_reference_ran(ran)


# --------------------------------------------------------------------------------------------
# The nn.Module
# --------------------------------------------------------------------------------------------

def test_module_learnable_sink(gen, ran):
    module = DotProductAttention(num_heads=4, softmax_type="learnable", mask="causal")
    assert isinstance(module.sink, torch.nn.Parameter) and module.sink.shape == (4,)
    assert any(p is module.sink for p in module.parameters())
    with torch.no_grad():
        module.sink.copy_(torch.randn(4, generator=gen))
    call = make_call(gen, mask="causal", softmax_type="learnable")
    call.leaves["sink"] = module.sink
    out = module(*(call.leaves[n] for n in call.positional))
    (want, _, _), leaves64 = call.naive()
    assert_matches(out, want, "out")
    g = torch.randn(out.shape, generator=gen, dtype=F32)
    out.backward(g)
    want.backward(g.to(F64))
    for name in call.leaves:
        assert_matches(call.leaves[name].grad, leaves64[name].grad, f"grad {name}")
    assert module.sink.grad is not None and module.sink.grad.abs().sum() > 0
    assert_reference_ran(ran)


def test_module_dropout_only_in_training(gen, ran):
    module = DotProductAttention(dropout_p=0.5, mask="causal")
    call = make_call(gen, mask="causal")
    inputs = [call.leaves[n] for n in call.positional]
    module.eval()
    evaluated = module(*inputs)
    assert torch.equal(evaluated, module(*inputs))
    (want, _, _), _ = call.naive()
    assert_matches(evaluated, want, "eval out")
    module.train()
    torch.manual_seed(5)
    trained = module(*inputs)
    torch.manual_seed(5)
    assert torch.equal(trained, module(*inputs))
    assert not torch.equal(trained, module(*inputs))  # a fresh seed per call
    assert not torch.allclose(trained, evaluated)
    trained.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in inputs)
    assert_reference_ran(ran)


def test_module_layout_and_mask_override(gen, ran):
    module = DotProductAttention(layout="sbhd", mask="causal", scale=0.5)
    call = make_call(gen, layout="sbhd", mask="causal_bottom_right", scale=0.5, Sq=4, Skv=6)
    out = module(*(call.leaves[n] for n in call.positional), mask="causal_bottom_right")
    (want, _, _), _ = call.naive()
    assert_matches(out, want, "out")
    assert_reference_ran(ran, backward=False)


@pytest.mark.parametrize("wanted", [("q",), ("k",), ("v", "sink"), ("bias",)])
def test_partial_requires_grad(gen, ran, wanted):
    """Only the inputs that require grad get one, and it matches naive."""
    call = make_call(gen, mask="causal", softmax_type="learnable", bias_shape=(1, 4, 5, 7))
    for name, x in call.leaves.items():
        x.requires_grad_(name in wanted)
    out = call.fused()
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    (want, _, _), leaves64 = call.naive()
    want.backward(g.to(F64))
    for name, x in call.leaves.items():
        if name in wanted:
            assert_matches(x.grad, leaves64[name].grad, f"grad {name}")
        else:
            assert x.grad is None
    assert_reference_ran(ran)


def test_non_contiguous_inputs(gen, ran):
    """Strided views (a bshd tensor seen as bhsd, a sliced head dim) give the contiguous result."""
    q = randn(gen, (2, 5, 4, 10), grad=False)[..., :8]
    k = randn(gen, (2, 7, 2, 8), grad=False)
    v = randn(gen, (2, 7, 2, 6), grad=False)
    views = [x.transpose(1, 2).requires_grad_() for x in (q.detach(), k, v)]
    dense = [x.detach().contiguous().requires_grad_() for x in views]
    a = attention(*views, layout="bhsd", mask="causal_bottom_right")
    b = attention(*dense, layout="bhsd", mask="causal_bottom_right")
    assert not views[0].is_contiguous()
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    g = torch.randn(a.shape, generator=gen)
    for x, y in zip(torch.autograd.grad(a, views, g), torch.autograd.grad(b, dense, g)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert_reference_ran(ran)


def test_forced_reference_backend(gen, ran):
    check(gen, ran, backend="reference", mask="causal", softmax_type="off_by_one")
