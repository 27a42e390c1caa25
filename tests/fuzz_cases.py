"""Differential fuzzing of fusedattn: random valid attention calls, run on the backend the
library selects (or a forced one), compared with an independent float64 result.

    cases(profile)   hypothesis strategy of `Case`s: every layout (packed ones too), mask, sliding
                     window, bias broadcast shape, ALiBi, softmax type, built-in score_mod, GQA/MQA,
                     head dims, D != Dv, empty and one-token sequences, large logits
    run_case(case)   one call: out, lse (and max_logit when asked) and every gradient on the chosen
                     backend, which backend ran (STYLE 17), the selection's own checks, and the
                     comparison (STYLE 15); returns a CaseResult and never raises
    FuzzLog          calls per backend, skips with their reasons, failures printed in full

Error rule (STYLE 15, FACTOR and ATOL as in tests/gpu/gpu_checks.py): a backend's max error against
the float64 result must be within FACTOR x the same-dtype reference's own error, plus a floor of
ATOL[dtype] x max(|exact|, 1). The same-dtype reference computes in float32 from the same rounded
inputs and rounds its results once to the call's dtype: tests/naive.py run in float32 (NaiveOracle),
or on a GPU the reference backend (ReferenceOracle, fast enough for a thousand calls). Two details
keep the rule fair to fused kernels: the reference's error counts as at least one rounding of the
peak value, and its backward reads the output as stored in the call's dtype (see _loss).

Skips: a forced backend that declines a call (NoBackendError carrying that backend's own reasons)
is a skip that keeps the reasons. Any other exception, a NaN or a mismatch is a failure; so is a
ValueError for a call the generator builds as valid (then the generator or the library is wrong).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

import fusedattn
import fusedattn.torch as fat
from fusedattn import frontend_common, score_mods
from fusedattn.backends import BACKENDS, get_backend

try:
    import naive
except ImportError:  # tests/ collected as a package
    from tests import naive

__all__ = ["Case", "Profile", "CPU_PROFILE", "JAX_PROFILE", "SMALL_SEQ_PROFILE", "GPU_PROFILE", "cases",
           "case_config", "fuzz_settings", "run_case", "selection_problems", "assert_case_passes", "NaiveOracle",
           "ReferenceOracle", "GpuOracle", "CaseResult", "FuzzLog", "FACTOR", "ATOL", "REDUCTION_ATOL", "case_features",
           "REQUIRED_FEATURES"]

LAYOUTS = ("bshd", "sbhd", "bhsd", "thd", "bs3hd", "sb3hd", "t3hd", "bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd")
PACKED_QKV = ("bs3hd", "sb3hd", "t3hd")
PACKED_KV = ("bshd_bs2hd", "sbhd_sb2hd", "thd_t2hd")
MASKS = ("none", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")
HEAD_DIMS = (32, 40, 64, 72, 80, 96, 128, 160, 192, 256)
SCORE_MOD_KINDS = ("softcap", "clamp", "causal", "sliding_window", "alibi", "relative_position_bias",
                   "additive_bias", "document_mask")
MASKED = -1.0e9  # what the built-in masks write (score_mods.MASKED); naive treats <= -1e8 as masked

FACTOR = 4.0  # as tests/gpu/gpu_checks.py: cuDNN rounds P to the I/O dtype before P @ V
ATOL = {"bfloat16": 2e-3, "float16": 3e-4, "float32": 1e-6}
# dBias, dSink and learnable score_mod tables sum many score entries: their error grows with the count.
REDUCTION_ATOL = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 1e-5}
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}
F32, F64 = torch.float32, torch.float64
UNIT_ROUNDOFF = {dtype: torch.finfo(dtype).eps / 2 for dtype in TORCH_DTYPES.values()}


# ----------------------------------------------------------------------------- one call, described

@dataclass(frozen=True)
class Case:
    """One attention call, fully described: `run_case(Case(...))` replays it (data from `seed`).

    seqlen_q/kv: S of the tensors; for THD the max_seqlen passed (>= the longest sequence).
    lens_q/kv: per-sequence tokens (THD, and padding masks on padded layouts).
    gaps: THD free tokens before each sequence (padded offsets); tail: tokens after the last one.
    bias: its broadcast shape over (B, Hq, Sq, Skv), right-aligned: "b1qk" is (B, 1, Sq, Skv),
        "qk" is (Sq, Skv). alibi: slopes "h" (Hq,), "bh" (B, Hq) or "standard" (the paper's).
    score_mod: (kind, *params), or ("compose", part, part); see SCORE_MOD_KINDS.
    logit_scale: q is multiplied by it (large logits).
    """

    layout: str = "bshd"
    dtype: str = "float32"
    batch: int = 1
    seqlen_q: int = 1
    seqlen_kv: int = 1
    heads_q: int = 1
    heads_kv: int = 1
    head_dim: int = 32
    head_dim_v: int = 32
    mask: str = "none"
    window: tuple = (-1, -1)
    lens_q: tuple | None = None
    lens_kv: tuple | None = None
    gaps: tuple | None = None
    tail: int = 0
    bias: str | None = None
    bias_type: str = "post_scale"
    alibi: str | None = None
    softmax_type: str = "vanilla"
    score_mod: tuple | None = None
    logit_scale: float = 1.0
    scale: float | None = None
    max_logit: bool = False
    deterministic: bool = False
    seed: int = 0

    def __repr__(self) -> str:  # only what differs from the defaults: short enough to paste into a test
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                   if getattr(self, f.name) != f.default]
        return f"Case({', '.join(changed)})"

    @property
    def ragged(self) -> bool:
        return self.layout.startswith("t")

    def score_mod_parts(self) -> tuple:
        if self.score_mod is None:
            return ()
        return self.score_mod[1:] if self.score_mod[0] == "compose" else (self.score_mod,)


# ----------------------------------------------------------------------------- the generator

@dataclass(frozen=True, eq=False)
class Profile:
    """What a fuzz run draws from: dtypes, layouts, sizes, and how often each feature appears (percent)."""

    name: str
    dtypes: tuple
    layouts: tuple = LAYOUTS
    masks: tuple = MASKS
    batch: st.SearchStrategy = st.integers(1, 3)
    heads_q: tuple = (1, 2, 3, 4)
    head_dims: tuple = HEAD_DIMS
    seqlen_q: st.SearchStrategy = st.integers(0, 16)
    seqlen_kv: st.SearchStrategy = st.integers(0, 16)
    thd_length_q: st.SearchStrategy = st.integers(0, 16)
    thd_length_kv: st.SearchStrategy = st.integers(0, 16)
    long_thd_length: st.SearchStrategy | None = None  # lengths of the "long THD" cases
    percent: dict = field(default_factory=dict)

    def sometimes(self, draw, feature: str) -> bool:
        """True in about percent[feature] of the cases; shrinks towards False."""
        return draw(st.integers(0, 99)) >= 100 - self.percent.get(feature, 0)


def _lengths(*strategies) -> st.SearchStrategy:
    return st.one_of(*strategies)


# Sizes kept small: the naive reference loops in Python (B <= 3, S <= 70, H <= 4).
_CPU_LENGTH = _lengths(st.sampled_from((0, 1, 2, 3)), st.integers(0, 24), st.integers(0, 70))
_FEATURES = dict(dv=20, window=30, bias=30, alibi=10, softmax=35, score_mod=30, compose=25, learnable=60,
                 large_logits=12, scale=20, max_logit=15, deterministic=10, gaps=35, longer_max=15, decode=15)

CPU_PROFILE = Profile("cpu", dtypes=("float32", "bfloat16"), seqlen_q=_CPU_LENGTH, seqlen_kv=_CPU_LENGTH,
                      thd_length_q=_CPU_LENGTH, thd_length_kv=_CPU_LENGTH, percent=_FEATURES)
# JAX compiles each case: the same space, smaller.
JAX_PROFILE = dataclasses.replace(
    CPU_PROFILE, name="jax", batch=st.integers(1, 2), seqlen_q=st.integers(0, 12), seqlen_kv=st.integers(0, 12),
    thd_length_q=st.integers(0, 9), thd_length_kv=st.integers(0, 9))
# small_seq: one query per sequence against a few keys (fusedattn/backends/small_seq); now and then a
# call outside its rules (a left window, a bias, a sink, more keys, other layouts) to see it decline.
SMALL_SEQ_PROFILE = Profile(
    "small_seq", dtypes=("float16", "bfloat16"),
    layouts=("thd", "bshd", "thd_t2hd", "bshd_bs2hd", "thd", "bshd", "sbhd"),
    heads_q=(1, 2, 4), head_dims=(32, 40, 64, 72, 128, 256),
    seqlen_q=st.just(1),
    seqlen_kv=_lengths(st.sampled_from((1, 16, 64)), st.integers(0, 16), st.integers(0, 16), st.integers(0, 72)),
    thd_length_q=st.sampled_from((1, 1, 1, 0)),
    thd_length_kv=_lengths(st.sampled_from((0, 1, 64)), st.integers(0, 16), st.integers(0, 16), st.integers(0, 72)),
    percent=dict(dv=5, window=25, bias=5, softmax=5, score_mod=5, large_logits=10, scale=20, gaps=35,
                 max_logit=5))
# On a GPU: moderate sizes, lengths at and around the kernels' tiles, a few 1000-token THD sequences.
_GPU_SEQLEN = st.sampled_from((1, 2, 16, 63, 64, 65, 127, 128, 200, 256, 300, 0))
GPU_PROFILE = Profile(
    "gpu", dtypes=("bfloat16", "float16"), heads_q=(1, 2, 4, 8), seqlen_q=_GPU_SEQLEN, seqlen_kv=_GPU_SEQLEN,
    thd_length_q=_lengths(st.sampled_from((0, 1, 64)), st.integers(0, 300)),
    thd_length_kv=_lengths(st.sampled_from((0, 1, 64)), st.integers(0, 300)),
    long_thd_length=st.integers(900, 1100),
    percent=dict(_FEATURES, long_thd=8, decode=20))


@st.composite
def cases(draw, profile: Profile) -> Case:
    """A valid attention call drawn from `profile` (the rules are the documented ones: README's API)."""
    pick = lambda values: draw(st.sampled_from(tuple(values)))  # noqa: E731
    layout = pick(profile.layouts)
    packed_qkv, packed_kv, ragged = layout in PACKED_QKV, layout in PACKED_KV, layout.startswith("t")
    heads_q = pick(profile.heads_q)
    heads_kv = heads_q if packed_qkv else pick(h for h in range(1, heads_q + 1) if heads_q % h == 0)
    head_dim = pick(profile.head_dims)
    head_dim_v = head_dim
    if not (packed_qkv or packed_kv) and profile.sometimes(draw, "dv"):
        head_dim_v = pick(profile.head_dims)
    mask = pick(profile.masks)
    batch = draw(profile.batch)
    shape = _ragged_shape(draw, profile, batch, packed_qkv) if ragged else \
        _padded_shape(draw, profile, batch, mask, packed_qkv)
    seqlen_q, seqlen_kv = shape["seqlen_q"], shape["seqlen_kv"]
    bias = alibi = None
    bias_type = "post_scale"
    if not ragged and profile.sometimes(draw, "bias"):
        bias, bias_type = _bias_code(draw), pick(("post_scale", "pre_scale"))
    elif profile.sometimes(draw, "alibi"):
        alibi = pick(("h", "bh", "standard"))
    softmax_type = pick(("off_by_one", "learnable")) if profile.sometimes(draw, "softmax") else "vanilla"
    score_mod = None
    if profile.sometimes(draw, "score_mod"):
        learnable_ok = not ragged and bias is None  # a learnable term runs as bias=, which THD does not take
        score_mod = _score_mod(draw, profile, learnable_ok)
    return Case(
        layout=layout, dtype=pick(profile.dtypes), batch=batch, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv,
        heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim, head_dim_v=head_dim_v, mask=mask,
        window=_window(draw, profile, mask, max(seqlen_q, seqlen_kv)),
        lens_q=shape.get("lens_q"), lens_kv=shape.get("lens_kv"), gaps=shape.get("gaps"), tail=shape.get("tail", 0),
        bias=bias, bias_type=bias_type, alibi=alibi, softmax_type=softmax_type, score_mod=score_mod,
        logit_scale=round(draw(st.floats(8.0, 20.0)), 2) if profile.sometimes(draw, "large_logits") else 1.0,
        scale=round(draw(st.floats(0.05, 2.0)), 3) if profile.sometimes(draw, "scale") else None,
        max_logit=profile.sometimes(draw, "max_logit"), deterministic=profile.sometimes(draw, "deterministic"),
        seed=draw(st.integers(0, 2**31 - 1)))


def _ragged_shape(draw, profile: Profile, batch: int, packed_qkv: bool) -> dict:
    """THD: per-sequence lengths (zeros, ones, lengths off the 64-token tiles), max_seqlen, gaps."""
    length_q, length_kv = profile.thd_length_q, profile.thd_length_kv
    if profile.long_thd_length is not None and profile.sometimes(draw, "long_thd"):
        length_q = length_kv = profile.long_thd_length
    elif profile.sometimes(draw, "decode"):
        length_q = st.sampled_from((1, 0))
    lens_q = tuple(draw(length_q) for _ in range(batch))
    lens_kv = lens_q if packed_qkv else tuple(draw(length_kv) for _ in range(batch))
    extra = draw(st.integers(1, 5)) if profile.sometimes(draw, "longer_max") else 0  # max_seqlen above the longest
    shape = dict(lens_q=lens_q, lens_kv=lens_kv, seqlen_q=max(lens_q, default=0) + extra,
                 seqlen_kv=max(lens_kv, default=0) + extra)
    if packed_qkv:
        shape["seqlen_kv"] = shape["seqlen_q"]
    if profile.sometimes(draw, "gaps"):
        shape["gaps"] = tuple(draw(st.integers(0, 3)) for _ in range(batch))
        shape["tail"] = draw(st.integers(0, 2))
    return shape


def _padded_shape(draw, profile: Profile, batch: int, mask: str, packed_qkv: bool) -> dict:
    """Padded layouts: Sq and Skv (different both ways unless q, k, v are packed), lengths for padding masks."""
    decode = profile.sometimes(draw, "decode")
    seqlen_q = 1 if decode and not packed_qkv else draw(profile.seqlen_q)
    seqlen_kv = seqlen_q if packed_qkv else draw(profile.seqlen_kv)
    shape = dict(seqlen_q=seqlen_q, seqlen_kv=seqlen_kv)
    if mask.startswith("padding"):
        within = lambda limit: st.one_of(st.sampled_from((limit, 0)), st.integers(0, limit))  # noqa: E731
        shape["lens_q"] = tuple(draw(within(seqlen_q)) for _ in range(batch))
        shape["lens_kv"] = tuple(draw(within(seqlen_kv)) for _ in range(batch))
    return shape


def _window(draw, profile: Profile, mask: str, longest: int) -> tuple:
    """(left, right) with -1 unbounded; a causal mask allows right = 0 or -1 only."""
    if not profile.sometimes(draw, "window"):
        return (-1, -1)
    bound = st.one_of(st.just(-1), st.integers(0, 4), st.integers(0, longest + 1))
    left = draw(bound)
    right = draw(st.sampled_from((0, -1))) if "causal" in mask else draw(bound)
    return (left, right)


def _bias_code(draw) -> str:
    """A broadcast shape over (B, Hq, Sq, Skv): each axis full or 1; leading 1s sometimes left out."""
    code = "".join(axis if draw(st.booleans()) else "1" for axis in "bhqk")
    if code.startswith("11") and draw(st.booleans()):
        return code[2:]  # (Sq|1, Skv|1): broadcast from the right
    return code


def _score_mod(draw, profile: Profile, learnable_ok: bool) -> tuple:
    if profile.sometimes(draw, "compose"):
        return ("compose", _score_mod_part(draw, profile, False), _score_mod_part(draw, profile, False))
    return _score_mod_part(draw, profile, learnable_ok)


def _score_mod_part(draw, profile: Profile, learnable_ok: bool) -> tuple:
    """(kind, *params) of one built-in score_mod; a learnable table/bias only where it can learn."""
    kind = draw(st.sampled_from(SCORE_MOD_KINDS))
    learnable = learnable_ok and profile.sometimes(draw, "learnable")
    if kind == "softcap":
        return ("softcap", round(draw(st.floats(2.0, 50.0)), 2))
    if kind == "clamp":
        return ("clamp", round(draw(st.floats(-8.0, -0.5)), 2), round(draw(st.floats(0.5, 8.0)), 2))
    if kind == "causal":
        return ("causal",)
    if kind == "sliding_window":
        left, right = draw(st.integers(-1, 8)), draw(st.integers(-1, 8))
        return ("sliding_window", left, 0 if left == right == -1 else right)
    if kind == "alibi":
        return ("alibi", draw(st.sampled_from(("h", "bh"))))
    if kind == "relative_position_bias":
        return ("relative_position_bias", draw(st.integers(0, 6)), learnable)
    if kind == "additive_bias":
        return ("additive_bias", "".join(a if draw(st.booleans()) else "1" for a in "bhqk"), learnable)
    return ("document_mask", draw(st.integers(1, 4)))


def fuzz_settings(examples: int) -> settings:
    """A fixed, bounded run: the same examples every time, no database, no shrinking (run_case
    never raises; failing cases are printed in full instead)."""
    return settings(max_examples=examples, derandomize=True, database=None, deadline=None, print_blob=False,
                    phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))


def case_config(case: Case, *, device: str = "cpu", framework: str = "torch") -> fusedattn.AttentionConfig:
    """The AttentionConfig the frontends build for `case` (training; a score_mod gets a stand-in key)."""
    bias_kind, bias_shape = "none", None
    if case.bias is not None:
        bias_kind, bias_shape = case.bias_type, tuple(_bias_shape(case, case.bias, padded_to=4))
    elif case.alibi is not None:
        bias_kind = "alibi"
        bias_shape = (case.batch, case.heads_q) if case.alibi == "bh" else (case.heads_q,)
    mask = case.mask
    if case.ragged and not mask.startswith("padding"):
        mask = "padding" if mask == "none" else "padding_" + mask
    return fusedattn.AttentionConfig(
        dtype=case.dtype, layout=case.layout, batch=case.batch, seqlen_q=case.seqlen_q, seqlen_kv=case.seqlen_kv,
        heads_q=case.heads_q, heads_kv=case.heads_kv, head_dim_qk=case.head_dim, head_dim_v=case.head_dim_v,
        mask=mask, window=tuple(case.window), bias=bias_kind, bias_shape=bias_shape,
        bias_requires_grad=case.bias is not None, softmax=case.softmax_type, scale=case.scale, is_training=True,
        deterministic=case.deterministic, return_lse=True, return_max_logit=case.max_logit,
        score_mod_key=None if case.score_mod is None else ("fuzz", case.score_mod),
        padded_offsets=case.ragged and case.gaps is not None, alibi_standard=case.alibi == "standard",
        device=device, framework=framework)


# ----------------------------------------------------------------------------- inputs

@dataclass
class CallData:
    """The tensors of one call, made once from the case's seed and shared by every run of it."""

    leaves: dict  # name -> differentiable tensor: q/k/v, qkv, q/kv; bias; sink; learnable score_mod tensors
    positional: tuple  # the leaves passed as q, k, v
    offsets: dict  # cu_seqlens_q/kv (and _padded): int32
    constants: dict  # no gradient: alibi slopes, score_mod tensors
    g_out: torch.Tensor  # upstream gradient of out, in the call's dtype
    g_lse: torch.Tensor  # upstream gradient of lse (finite entries), float32


def _packing(lens, gaps, tail):
    """(cu_seqlens, padded starts or None, total tokens) of packed sequences."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    if gaps is None:
        return cu, None, cu[-1] + tail
    padded = [gaps[0]]
    for b, n in enumerate(lens):
        padded.append(padded[-1] + n + (gaps[b + 1] if b + 1 < len(gaps) else 0))
    return cu, padded, padded[-1] + tail


def _lead(case: Case, side: str) -> tuple:
    """The leading axes of q (side "q") or k/v (side "kv") before the heads."""
    seqlen = case.seqlen_q if side == "q" else case.seqlen_kv
    if case.ragged:
        lens = case.lens_q if side == "q" else case.lens_kv
        return (_packing(lens, case.gaps, case.tail)[2],)
    return (seqlen, case.batch) if case.layout.startswith("sb") else (case.batch, seqlen)


def _shape(case: Case, side: str, heads: int, dim: int, pack: int | None = None) -> tuple:
    lead = _lead(case, side)
    if case.layout == "bhsd":
        return (lead[0], heads, lead[1], dim)
    return (*lead, *(() if pack is None else (pack,)), heads, dim)


def _bias_shape(case: Case, code: str, padded_to: int | None = None) -> list:
    sizes = dict(b=case.batch, h=case.heads_q, q=case.seqlen_q, k=case.seqlen_kv)
    axes = "bhqk"[4 - len(code):]
    shape = [sizes[a] if c != "1" else 1 for a, c in zip(axes, code)]
    return [1] * ((padded_to or 0) - len(shape)) + shape


def make_data(case: Case, device: str = "cpu") -> CallData:
    """Fresh normal inputs (never zeros) from the case's seed, rounded to its dtype, on `device`."""
    gen = torch.Generator().manual_seed(case.seed)

    def normal(shape, dtype=TORCH_DTYPES[case.dtype], scale=1.0):
        return (torch.randn(tuple(shape), generator=gen, dtype=F64) * scale).to(dtype).to(device)

    hq, hkv, d, dv = case.heads_q, case.heads_kv, case.head_dim, case.head_dim_v
    q_scale = case.logit_scale  # large logits: q alone is scaled
    if case.layout in PACKED_QKV:
        qkv = torch.randn(_shape(case, "q", hq, d, pack=3), generator=gen, dtype=F64)
        qkv.select(-3, 0).mul_(q_scale)
        leaves, positional = {"qkv": qkv.to(TORCH_DTYPES[case.dtype]).to(device)}, ("qkv",)
    elif case.layout in PACKED_KV:
        leaves = {"q": normal(_shape(case, "q", hq, d), scale=q_scale), "kv": normal(_shape(case, "kv", hkv, d, 2))}
        positional = ("q", "kv")
    else:
        leaves = {"q": normal(_shape(case, "q", hq, d), scale=q_scale), "k": normal(_shape(case, "kv", hkv, d)),
                  "v": normal(_shape(case, "kv", hkv, dv))}
        positional = ("q", "k", "v")
    if case.bias is not None:
        leaves["bias"] = normal(_bias_shape(case, case.bias))
    if case.softmax_type == "learnable":
        leaves["sink"] = normal((hq,))
    constants = {}
    if case.alibi == "standard":
        constants["alibi_slopes"] = torch.tensor(fusedattn.standard_alibi_slopes(hq), dtype=F32, device=device)
    elif case.alibi is not None:
        constants["alibi_slopes"] = _slopes(gen, case, case.alibi, device)
    for i, part in enumerate(case.score_mod_parts()):
        _score_mod_tensors(gen, case, i, part, device, leaves, constants, normal)
    offsets = {}
    if case.ragged or case.mask.startswith("padding"):
        cu_q, padded_q, _ = _packing(case.lens_q, case.gaps, case.tail)
        cu_kv, padded_kv, _ = _packing(case.lens_kv, case.gaps, case.tail)
        as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=device)  # noqa: E731
        offsets = dict(cu_seqlens_q=as_int(cu_q), cu_seqlens_kv=as_int(cu_kv))
        if padded_q is not None:
            offsets.update(cu_seqlens_q_padded=as_int(padded_q), cu_seqlens_kv_padded=as_int(padded_kv))
    out_shape = _shape(case, "q", hq, dv)
    lse_shape = (out_shape[0], hq) if case.ragged else (case.batch, hq, case.seqlen_q)
    return CallData(leaves, positional, offsets, constants, normal(out_shape), normal(lse_shape, F32))


def _slopes(gen, case: Case, shape: str, device):
    """Positive ALiBi slopes of different sizes: (Hq,) or (B, Hq), float32."""
    size = (case.batch, case.heads_q) if shape == "bh" else (case.heads_q,)
    return (0.05 + 0.9 * torch.rand(size, generator=gen, dtype=F64)).to(F32).to(device)


def _score_mod_tensors(gen, case: Case, i: int, part: tuple, device, leaves, constants, normal) -> None:
    """The tensors score_mod part `i` reads, named sm<i>_...; learnable ones among the leaves."""
    kind = part[0]
    if kind == "alibi":
        constants[f"sm{i}_slopes"] = _slopes(gen, case, part[1], device)
    elif kind == "relative_position_bias":
        table = normal((case.heads_q, 2 * part[1] + 1), F32)
        (leaves if part[2] else constants)[f"sm{i}_table"] = table
    elif kind == "additive_bias":
        values = normal(_bias_shape(case, part[1]), F32)
        (leaves if part[2] else constants)[f"sm{i}_bias"] = values
    elif kind == "document_mask":
        for side, seqlen in (("q", case.seqlen_q), ("kv", case.seqlen_kv)):
            ids = torch.randint(0, part[1], (case.batch, seqlen), generator=gen).sort(dim=1).values
            constants[f"sm{i}_{side}_ids"] = ids.to(torch.int32).to(device)


# ----------------------------------------------------------------------------- score_mods, two ways

def library_score_mod(case: Case, tensors: dict):
    """The case's score_mod built from fusedattn.score_mods, reading `tensors` (torch or JAX arrays)."""
    parts = [_library_part(i, part, tensors) for i, part in enumerate(case.score_mod_parts())]
    return parts[0] if len(parts) == 1 else score_mods.compose(*parts)


def _library_part(i: int, part: tuple, tensors: dict):
    kind = part[0]
    if kind == "softcap":
        return score_mods.softcap(part[1])
    if kind == "clamp":
        return score_mods.clamp(part[1], part[2])
    if kind == "causal":
        return score_mods.causal()
    if kind == "sliding_window":
        return score_mods.sliding_window(part[1], part[2])
    if kind == "alibi":
        return score_mods.alibi(tensors[f"sm{i}_slopes"])
    if kind == "relative_position_bias":
        return score_mods.relative_position_bias(tensors[f"sm{i}_table"])
    if kind == "additive_bias":
        return score_mods.additive_bias(tensors[f"sm{i}_bias"])
    return score_mods.document_mask(tensors[f"sm{i}_q_ids"], tensors[f"sm{i}_kv_ids"])


def naive_score_mod(case: Case, tensors: dict) -> Callable | None:
    """The case's score_mod as naive_attention takes it: fn(s, b, h, q_idx, kv_idx), written here from
    each built-in's documented math (fusedattn/score_mods/builtins.py), in the tensors' precision.
    q_idx (Sq, 1) and kv_idx (1, Skv) are positions in the sequence, as in the library."""
    parts = case.score_mod_parts()
    if not parts:
        return None
    twins = [_twin(case, i, part, tensors) for i, part in enumerate(parts) if part[0] not in _MASK_KINDS]
    masks = [_mask(i, part, tensors) for i, part in enumerate(parts) if part[0] in _MASK_KINDS]

    def score_mod(s, b, h, q_idx, kv_idx):
        for twin in twins:
            s = twin(s, b, h, q_idx, kv_idx)
        for mask in masks:  # masks apply after every score modification, wherever compose lists them
            s = torch.where(mask(b, h, q_idx, kv_idx), s, MASKED)
        return s

    return score_mod


def _as_learned_bias(case: Case, part: tuple, values: torch.Tensor) -> torch.Tensor:
    """values as the library adds them: a lone added term that learns runs as a post-scale bias, in the
    call's dtype as every bias (frontend_common.prepare_call), so its values are rounded to that dtype
    first (the gradient passes through the rounding). Composed, or beside a bias, it stays as it is."""
    if not part[2] or len(case.score_mod_parts()) != 1 or case.bias is not None or case.alibi is not None:
        return values
    return values.to(TORCH_DTYPES[case.dtype]).to(values.dtype)


def _twin(case: Case, i: int, part: tuple, tensors: dict) -> Callable:
    kind = part[0]
    if kind == "softcap":  # cap * tanh(s / cap)
        cap = part[1]
        return lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)
    if kind == "clamp":  # clipped to [low, high], no gradient where clipped
        low, high = part[1], part[2]
        return lambda s, b, h, qi, ki: s.clamp(low, high)
    if kind == "alibi":  # s - slope[(b,) h] * |q_idx - kv_idx|, positions not diagonal-aligned
        slopes = tensors[f"sm{i}_slopes"]
        return lambda s, b, h, qi, ki: s - (slopes[h] if slopes.dim() == 1 else slopes[b, h]) * (qi - ki).abs()
    if kind == "relative_position_bias":  # s + table[h, clip(kv - q, -M, M) + M]
        table, reach = _as_learned_bias(case, part, tensors[f"sm{i}_table"]), part[1]
        return lambda s, b, h, qi, ki: s + table[h][(ki - qi).clamp(-reach, reach) + reach]
    if kind == "additive_bias":  # s + bias broadcast to (B, Hq, Sq, Skv)
        values = _as_learned_bias(case, part, tensors[f"sm{i}_bias"])
        grid = (case.batch, case.heads_q, case.seqlen_q, case.seqlen_kv)
        return lambda s, b, h, qi, ki: s + values.expand(grid)[b, h][qi, ki]
    raise AssertionError(f"unknown score_mod kind {kind!r}")


_MASK_KINDS = ("causal", "sliding_window", "document_mask")


def _mask(i: int, part: tuple, tensors: dict) -> Callable:
    """Which keys a mask built-in keeps, as a boolean of (b, h, q_idx, kv_idx)."""
    kind = part[0]
    if kind == "causal":  # keys after the query masked, top-left
        return lambda b, h, qi, ki: ki <= qi
    if kind == "sliding_window":  # key >= query - left and key <= query + right; -1 unbounded
        left, right = part[1], part[2]

        def window(b, h, qi, ki):
            keep = torch.ones(torch.broadcast_shapes(qi.shape, ki.shape), dtype=torch.bool)
            if left >= 0:
                keep = keep & (qi <= ki + left)
            if right >= 0:
                keep = keep & (ki <= qi + right)
            return keep

        return window
    q_ids, kv_ids = tensors[f"sm{i}_q_ids"], tensors[f"sm{i}_kv_ids"]  # document_mask: same document only
    return lambda b, h, qi, ki: q_ids[b][qi] == kv_ids[b][ki]


# ----------------------------------------------------------------------------- running a call

@dataclass
class Outcome:
    """What one run gives: out, lse, max_logit (or None) and the gradient of every leaf it differentiated."""

    out: torch.Tensor
    lse: torch.Tensor
    max_logit: torch.Tensor | None
    grads: dict


def library_options(case: Case, tensors: dict, offsets: dict) -> dict:
    """The keywords of fusedattn's attention for the case (both frontends take the same ones)."""
    options = dict(layout=case.layout, mask=case.mask, window=tuple(case.window), softmax_type=case.softmax_type,
                   scale=case.scale, deterministic=case.deterministic, return_lse=True,
                   return_max_logit=case.max_logit, **offsets)
    if case.bias is not None:
        options.update(bias=tensors["bias"], bias_type=case.bias_type)
    if case.alibi is not None:
        options["alibi_slopes"] = tensors["alibi_slopes"]
    if case.softmax_type == "learnable":
        options["sink"] = tensors["sink"]
    if case.ragged:
        options.update(max_seqlen_q=case.seqlen_q, max_seqlen_kv=case.seqlen_kv)
    if case.score_mod is not None:
        options["score_mod"] = library_score_mod(case, tensors)
    return options


def _loss(case: Case, out, lse, g_out, g_lse, stored=None):
    """sum(out * g_out) + sum(lse * g_lse) over the finite lse entries (rows that see no key have -inf).

    stored: the dtype a fused backward keeps the output in. Its softmax term rowsum(dO * O) then reads
    the rounded O, which shifts every dS_ij by -P_ij * rowsum(dO * (round(O) - O)): the same as that
    much less lse cotangent. The same-dtype reference takes it, so its error is a fused kernel's too.
    """
    loss = (out.to(g_out.dtype) * g_out).sum()
    if stored is not None:
        shift = _per_row(case, (g_out * (out.detach().to(stored).to(out.dtype) - out.detach())).sum(-1))
        g_lse = -shift if g_lse is None else g_lse.to(shift.dtype) - shift
    if g_lse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse.to(lse.dtype)).sum()
    return loss


def _per_row(case: Case, x):
    """A value per query row and head, from out's leading axes to lse's: (B, Hq, Sq), or (T, Hq) for THD."""
    base = naive.BASE_LAYOUT[case.layout]
    if base == "bshd":
        return x.permute(0, 2, 1)
    if base == "sbhd":
        return x.permute(1, 2, 0)
    return x  # bhsd (B, Hq, Sq) and thd (T, Hq) already are


def _wide(x: torch.Tensor, dtype) -> torch.Tensor:
    return x.detach().to(dtype) if x.is_floating_point() and dtype is not None else x.detach()


def torch_run(case: Case, data: CallData, *, backend=None, dtype=None, lse_grad: Callable | bool = True,
              device=None, stored=None) -> Outcome:
    """fusedattn.torch.attention on fresh copies of the case's tensors (cast to `dtype` when given),
    then its gradients for the upstream g_out (and g_lse when lse_grad, or lse_grad(), says so: the
    backend that ran is known once the forward is done); `stored` as in _loss."""
    leaves = {n: _wide(x, dtype).to(device or x.device).requires_grad_(True) for n, x in data.leaves.items()}
    constants = {n: _wide(x, dtype).to(device or x.device) for n, x in data.constants.items()}
    offsets = {n: x.to(device or x.device) for n, x in data.offsets.items()}
    options = library_options(case, {**leaves, **constants}, offsets)
    result = fat.attention(*(leaves[n] for n in data.positional), backend=backend, **options)
    wants_lse = lse_grad() if callable(lse_grad) else lse_grad
    g_out = data.g_out.to(result.out.device, dtype or data.g_out.dtype)
    g_lse = data.g_lse.to(result.lse.device) if wants_lse else None
    names = list(leaves)
    grads = torch.autograd.grad(_loss(case, result.out, result.lse, g_out, g_lse, stored), [leaves[n] for n in names],
                                allow_unused=True)
    return Outcome(result.out.detach(), result.lse.detach(), result.max_logit,
                   {n: g for n, g in zip(names, grads)})


def jax_run(case: Case, data: CallData, *, backend=None, lse_grad: Callable | bool = True) -> Outcome:
    """fusedattn.jax.attention under jit: outputs and, by jax.vjp, the gradients of the attention
    inputs (score_mod tensors stay constants). Offsets are closed over, so their values are checked."""
    import jax
    import jax.numpy as jnp

    import fusedattn.jax as fj

    names = [n for n in data.leaves if not n.startswith("sm")]
    arrays = {n: _to_jax(x) for n, x in {**data.leaves, **data.constants}.items()}
    offsets = {n: _to_jax(x) for n, x in data.offsets.items()}

    def attention(*xs):
        tensors = {**arrays, **dict(zip(names, xs))}
        result = fj.attention(*(tensors[n] for n in data.positional), backend=backend,
                              **library_options(case, tensors, offsets))
        return (result.out, result.lse), result.max_logit

    primals = [arrays[n] for n in names]
    jax.eval_shape(attention, *primals)  # traces the call: selection picks, the recorder sees it
    wants_lse = lse_grad() if callable(lse_grad) else lse_grad

    @jax.jit
    def run(xs, g_out, g_lse):
        (out, lse), pullback, max_logit = jax.vjp(attention, *xs, has_aux=True)
        g_lse = jnp.where(jnp.isfinite(lse), g_lse, 0.0) if wants_lse else jnp.zeros_like(lse)
        return out, lse, max_logit, pullback((g_out, g_lse))

    out, lse, max_logit, grads = run(primals, _to_jax(data.g_out), _to_jax(data.g_lse))
    return Outcome(_from_jax(out), _from_jax(lse), None if max_logit is None else _from_jax(max_logit),
                   {n: _from_jax(g) for n, g in zip(names, grads)})


def _to_jax(x: torch.Tensor):
    import jax.numpy as jnp

    x = x.detach().cpu()
    if x.is_floating_point():  # through float32: NumPy has no bfloat16; the values are exact
        return jnp.asarray(x.float().numpy(), dtype=str(x.dtype).removeprefix("torch."))
    return jnp.asarray(x.numpy())


def _from_jax(x) -> torch.Tensor:
    import numpy as np

    name = str(x.dtype)
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(TORCH_DTYPES[name])


RUNNERS = {"torch": torch_run, "jax": jax_run}


@contextlib.contextmanager
def recording_backends():
    """Yields a list that collects (backend name, phase, cfg): phase "select" for each selection a
    frontend makes, "forward"/"backward" for every backend call made in Python."""
    calls, saved = [], []
    methods = {"forward": "forward", "backward": "backward", "forward_into": "forward",
               "backward_into": "backward"}
    for backend in BACKENDS:
        for method, phase in methods.items():
            original = getattr(backend, method)

            def spy(cfg, *args, _original=original, _name=backend.name, _phase=phase, **kwargs):
                calls.append((_name, _phase, cfg))
                return _original(cfg, *args, **kwargs)

            saved.append((backend, method, vars(backend).get(method)))
            setattr(backend, method, spy)
    select = frontend_common.select_backend

    def select_spy(cfg, *args, **kwargs):
        selection = select(cfg, *args, **kwargs)
        calls.append((selection.name, "select", cfg))
        return selection

    frontend_common.select_backend = select_spy
    native = _torch_functional()
    native_call = None if native is None else native._native_call

    def native_spy(plan, signature, planned, *args, **kwargs):
        calls.append(("cudnn", "native", planned[0]))
        return native_call(plan, signature, planned, *args, **kwargs)

    if native is not None:
        native._native_call = native_spy
    try:
        yield calls
    finally:
        if native is not None:
            native._native_call = native_call
        frontend_common.select_backend = select
        for backend, method, previous in reversed(saved):
            if previous is None:
                delattr(backend, method)
            else:
                setattr(backend, method, previous)


def _torch_functional():
    """fusedattn.torch.functional where torch is installed (its native operator's calls are recorded)."""
    try:
        from fusedattn.torch import functional
    except ImportError:
        return None
    return functional


# (case without its seed, device, framework, forced backend) -> (backend name, cfg) of its last run. A call
# the frontend has seen before skips selection; run by cuDNN's native operator, nothing in Python sees it.
_LAST_RUN: dict = {}


def _what_ran(calls, result) -> tuple:
    """(backend name, cfg) of the call just recorded: the backend whose Python forward ran; else the one
    selection picked (cuDNN on a GPU runs through its native operator, autograd in C++, out of sight);
    else cuDNN where its native operator was called (a plan the frontend remembered, maybe from a call of
    another case that passes the same arguments); else the one that ran this config before. (None, None)
    if unknown."""
    key = (dataclasses.replace(result.case, seed=0), result.device, result.framework, result.forced)
    forward = [(name, cfg) for name, phase, cfg in calls if phase == "forward"]
    selected = [(name, cfg) for name, phase, cfg in calls if phase == "select"]
    native = [(name, cfg) for name, phase, cfg in calls if phase == "native"]
    ran = (forward[-1] if forward else selected[-1] if selected else native[-1] if native
           else _LAST_RUN.get(key, (None, None)))
    if ran[0] is not None:
        _LAST_RUN[key] = ran
    return ran


def _run_problems(calls, result, name) -> list[str]:
    """What is wrong with what ran: a backend other than the selected one, not both passes in Python,
    or no Python run where only cuDNN's native operator can run a call."""
    ran = {(n, phase) for n, phase, _ in calls if phase not in ("select", "native")}
    selected = {n for n, phase, _ in calls if phase == "select"}
    if selected and selected != {name}:
        return [f"selection picked {sorted(selected)}, but {name} ran"]
    if ran and ran != {(name, "forward"), (name, "backward")}:
        return [f"backends ran: {sorted(ran)}; expected {name}, forward and backward"]
    if not ran and not (name == "cudnn" and result.device == "cuda"):
        return [f"{name} was selected, but no backend ran in Python (only cuDNN has a native operator)"]
    return []


# ----------------------------------------------------------------------------- the float64 side

class _EmptyRowsAsDocumented:
    """torch for naive.py, where a row whose every term is -inf has no mass and passes no gradient.

    naive_attention's empty-row branch sees only the mask's visibility: a row whose visible keys a
    score_mod masks all gets lse = logsumexp(all -inf) = -inf, p = exp(-inf - -inf) = NaN, and NaN
    gradients (into a post-scale bias too), where its docstring and the library promise out 0 and
    zero gradients. Here such an lse is a constant -inf and exp(NaN) is exp(-inf) = 0, which gives
    exactly the documented result; rows with any finite term are computed as before.
    """

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def logsumexp(x, dim):
        if x.numel() and bool(torch.isneginf(x).all()):
            return x.detach().sum(dim)  # -inf, with no gradient path
        return torch.logsumexp(x, dim)

    @staticmethod
    def exp(x):
        return torch.exp(torch.where(x.isnan(), float("-inf"), x))


@contextlib.contextmanager
def naive_precision(dtype):
    """naive_attention computes in its module's `F64` dtype (and asserts its inputs have it): set to
    float32, the same code is the same-dtype reference. Restored on exit, as is naive's torch."""
    saved = naive.F64, naive.torch
    naive.F64, naive.torch = dtype, _EmptyRowsAsDocumented()
    try:
        yield
    finally:
        naive.F64, naive.torch = saved


def naive_outcome(case: Case, data: CallData, precision, lse_grad: bool, stored=None) -> Outcome:
    """tests/naive.py on CPU copies of the case's tensors in `precision`, with autograd gradients
    (the output kept in `stored` for the backward, as _loss says)."""
    leaves = {n: x.detach().cpu().to(precision).requires_grad_(True) for n, x in data.leaves.items()}
    constants = {n: _wide(x, precision).cpu() for n, x in data.constants.items()}
    tensors = {**leaves, **constants}
    offsets = {n: x.cpu() for n, x in data.offsets.items()}
    with naive_precision(precision):
        out, lse, max_logit = naive.naive_attention(
            *(tensors[n] for n in data.positional), layout=case.layout, mask=case.mask, window=tuple(case.window),
            bias=tensors.get("bias"), bias_type=case.bias_type, alibi_slopes=tensors.get("alibi_slopes"),
            softmax_type=case.softmax_type, sink=tensors.get("sink"), scale=case.scale,
            score_mod=naive_score_mod(case, tensors), **offsets)
        loss = _loss(case, out, lse, data.g_out.cpu().to(precision), data.g_lse.cpu() if lse_grad else None, stored)
        names = list(leaves)
        grads = [None] * len(names)
        if loss.requires_grad:  # not when no query sees any key: every output is a constant
            grads = torch.autograd.grad(loss, [leaves[n] for n in names], allow_unused=True)
    grads = {n: torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(names, grads)}
    return Outcome(out.detach(), lse.detach(), max_logit.detach(), grads)


class NaiveOracle:
    """exact: tests/naive.py in float64; same-dtype: the same code in float32 on the same rounded inputs,
    its output kept in the call's dtype for the backward."""

    name = "naive"

    def __call__(self, case: Case, data: CallData, lse_grad: bool, backend: str) -> tuple[Outcome, Outcome]:
        stored = TORCH_DTYPES[case.dtype]
        return naive_outcome(case, data, F64, lse_grad), naive_outcome(case, data, F32, lse_grad, stored)


class ReferenceOracle:
    """exact: the reference backend in float64 on the case's device; same-dtype: the reference backend in
    float32 (what it computes in for the call's dtype, as in tests/gpu/gpu_checks.py) with the output kept
    in the call's dtype for the backward; compare() rounds its results to the backend's dtypes. Fast on a
    GPU; the CPU profile checks the reference against naive."""

    name = "reference"

    def __call__(self, case: Case, data: CallData, lse_grad: bool, backend: str) -> tuple[Outcome, Outcome]:
        exact = torch_run(case, data, backend="reference", dtype=F64, lse_grad=lse_grad)
        same = torch_run(case, data, backend="reference", dtype=F32, lse_grad=lse_grad,
                         stored=TORCH_DTYPES[case.dtype])
        return exact, same


class GpuOracle:
    """ReferenceOracle, except where the reference backend itself ran (comparing it with itself would prove
    nothing): then naive when the call is small enough for its Python loops, else the reference anyway."""

    name = "gpu"
    naive_limit = 30_000  # B * Hq * Sq * Skv: a fraction of a second of naive forward and backward

    def __call__(self, case: Case, data: CallData, lse_grad: bool, backend: str) -> tuple[Outcome, Outcome]:
        grid = case.batch * case.heads_q * case.seqlen_q * case.seqlen_kv
        oracle = NaiveOracle() if backend == "reference" and grid <= self.naive_limit else ReferenceOracle()
        return oracle(case, data, lse_grad, backend)


# ----------------------------------------------------------------------------- comparison

def compare(name: str, got, same, exact, floor: float) -> list[str]:
    """Problems of `got` against the float64 `exact` (STYLE 15): NaN, shape, infinities where exact has
    none (or the reverse), or max error > FACTOR x (same-dtype error) + floor x max(|exact|, 1)."""
    if got is None:
        return [f"{name}: missing"]
    if tuple(got.shape) != tuple(exact.shape):
        return [f"{name}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}"]
    g, e = got.detach().cpu().to(F64), exact.detach().cpu().to(F64)
    s = same.detach().cpu().to(got.dtype).to(F64)  # the same-dtype result, rounded as the backend's is
    if g.isnan().any():
        return [f"{name}: NaN at {g.isnan().nonzero()[:4].tolist()}"]
    finite = torch.isfinite(e)
    if not torch.equal(torch.isfinite(g), finite) or not torch.equal(g[~finite], e[~finite]):
        where = (torch.isfinite(g) != finite).nonzero()[:4].tolist()
        return [f"{name}: non-finite entries differ from the exact ones at {where}"]
    if not finite.any():
        return []
    errors = (g - e).abs().where(finite, 0.0)
    peak = e[finite].abs().max().item()
    # The same-dtype reference's error, at least one rounding of the peak: where the exact values happen
    # to be representable (dv = g_out when one key is visible) it measures 0, yet a kernel may round once.
    ref_err = max((s - e).abs().where(finite & s.isfinite(), 0.0).max().item(), UNIT_ROUNDOFF[got.dtype] * peak)
    limit = FACTOR * ref_err + floor * max(peak, 1.0)
    err = errors.max().item()
    if err <= limit:
        return []
    worst = tuple(torch.unravel_index(errors.argmax(), errors.shape))
    worst = tuple(int(i) for i in worst)
    return [f"{name}: max error {err:.3e} > limit {limit:.3e} (same-dtype error {ref_err:.3e}, peak {peak:.3g}); "
            f"worst at {worst}: got {g[worst].item():.6g}, exact {e[worst].item():.6g}"]


REDUCTIONS = ("bias", "sink")  # and learnable score_mod tensors (sm*): sums over many scores


def compare_outcome(case: Case, got: Outcome, same: Outcome, exact: Outcome) -> list[str]:
    """Every output and gradient of a run against the exact result."""
    call_dtype = TORCH_DTYPES[case.dtype]
    problems = []
    if got.out.dtype != call_dtype:
        problems.append(f"out: dtype {got.out.dtype}, expected {call_dtype}")
    stats = torch.float64 if call_dtype == torch.float64 else F32
    if got.lse.dtype != stats:
        problems.append(f"lse: dtype {got.lse.dtype}, expected {stats}")
    floor = ATOL[case.dtype]
    problems += compare("out", got.out, same.out, exact.out, floor)
    problems += compare("lse", got.lse, same.lse, exact.lse, floor)
    if case.max_logit:
        problems += compare("max_logit", got.max_logit, same.max_logit, exact.max_logit, floor)
    # A float32 backward recomputes the probabilities from the float32 LSE, exp(s - lse): with large logits
    # (q scaled up) each carries about |s| roundings, which a float32 naive that normalizes each row does
    # not. Its gradients' floor grows with the logit scale there (float32 only: the half types' floor is
    # a rounding of theirs, far above it). Seen: grad q 1.88e-5 against a limit of 1.63e-5 at scale 12.6.
    grad_scale = max(1.0, case.logit_scale) if case.dtype == "float32" else 1.0
    for name, grad in got.grads.items():
        reduction = name in REDUCTIONS or name.startswith("sm")
        if grad is None and not exact.grads[name].any():
            continue  # unused input (no key at all): no gradient is the right one
        problems += compare(f"grad {name}", grad, same.grads[name], exact.grads[name],
                            (REDUCTION_ATOL if reduction else ATOL)[case.dtype] * grad_scale)
    return problems


# ----------------------------------------------------------------------------- one case, end to end

@dataclass
class CaseResult:
    """What happened to one case: the backend that ran (or the forced one's reasons for declining),
    what selection said of the others, and every problem found (a non-empty list fails the run)."""

    case: Case
    device: str = "cpu"
    framework: str = "torch"
    forced: str | None = None
    backend: str | None = None
    skipped: tuple = ()
    declined: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    @property
    def status(self) -> str:
        return "failed" if self.problems else "skipped" if self.skipped else "passed"

    def describe(self) -> str:
        """The failing call in full, ready to become a named regression test."""
        where = f"device={self.device!r}, framework={self.framework!r}" + (
            f", backend={self.forced!r}" if self.forced else "")
        lines = [f"assert_case_passes({self.case!r}, {where})  # ran on {self.backend or '-'}"]
        lines += ["    " + line for problem in self.problems for line in problem.splitlines()]
        return "\n".join(lines)


def run_case(case: Case, *, device: str = "cpu", framework: str = "torch", backend: str | None = None,
             oracle=None) -> CaseResult:
    """Run `case` through fusedattn (selection picks unless `backend` forces one), compare it with the
    oracle's float64 result, check the selection; never raises: problems go into the result."""
    result = CaseResult(case, device, framework, backend)
    try:
        _run_and_compare(result, oracle or NaiveOracle())
    except Exception:  # a crash anywhere is a failure of the case, never a skip
        result.problems.append("crash: " + traceback.format_exc(limit=-6))
    return result


def _run_and_compare(result: CaseResult, oracle) -> None:
    case, forced = result.case, result.forced
    data = make_data(case, result.device)
    with recording_backends() as calls:
        lse_grad = lambda: get_backend(_what_ran(calls, result)[0]).lse_gradient  # noqa: E731 (known once run)
        try:
            got = RUNNERS[result.framework](case, data, backend=forced, lse_grad=lse_grad)
        except fusedattn.NoBackendError as error:
            if forced is None:
                raise  # the reference runs everything: "no backend" for a valid call is a failure
            result.skipped = _declined(error, forced, result)
            return
    name, cfg = _what_ran(calls, result)
    if name is None:
        result.problems.append(f"cannot tell which backend ran: recorded {[(n, p) for n, p, _ in calls]}")
        return
    result.backend = name
    result.problems += _run_problems(calls, result, name)
    result.problems += selection_problems(cfg, name, forced)
    result.declined = {n: reasons for n, reasons in fusedattn.select_backend(cfg).rejected.items()
                       if not reasons[0].startswith("not probed")} if forced is None else {}
    exact, same = oracle(case, data, get_backend(name).lse_gradient, name)
    result.problems += compare_outcome(case, got, same, exact)


def _declined(error: fusedattn.NoBackendError, forced: str, result: CaseResult) -> tuple:
    """The forced backend's reasons from its NoBackendError; they must be its own supports(cfg)."""
    reasons = tuple(error.reasons.get(forced, ()))
    own = tuple(get_backend(forced).supports(error.cfg))
    if not reasons or reasons != own:
        result.problems.append(f"NoBackendError reasons {reasons} are not {forced}'s own {own}")
    return reasons or ("(no reasons given)",)


def selection_problems(cfg, ran: str | None = None, forced: str | None = None) -> list[str]:
    """What is wrong with the selection of `cfg`: explain must not raise and must name the backend
    selected (the one that ran, when given); that backend's supports(cfg) is empty; without forcing it
    is the first in order with no reasons, every backend before it gives reasons, and select_backend
    agrees. Forcing any backend either selects it or raises NoBackendError with its own reasons."""
    try:
        text = fusedattn.explain(cfg, forced)
    except Exception as error:  # explain must never raise
        return [f"explain raised {type(error).__name__}: {error}"]
    table = {b.name: b.supports(cfg) for b in BACKENDS}
    problems = [f"{name}: reasons must be non-empty strings, got {reasons!r}" for name, reasons in table.items()
                if not all(isinstance(r, str) and r for r in reasons)]
    chosen = forced if forced is not None else next((n for n, reasons in table.items() if not reasons), None)
    if chosen is None or table[chosen]:
        return problems + [f"no backend selectable (forced={forced}):\n{text}"]
    if ran is not None and ran != chosen:
        problems.append(f"{ran} ran, but the first backend with no reasons is {chosen}")
    if f"selected: {chosen}" not in text.splitlines():
        problems.append(f"explain does not say 'selected: {chosen}':\n{text}")
    if fusedattn.select_backend(cfg, forced).name != chosen:
        problems.append(f"select_backend(cfg, {forced!r}) does not pick {chosen}")
    for name, reasons in table.items():
        try:
            fusedattn.select_backend(cfg, name)
            declined = ()
        except fusedattn.NoBackendError as error:
            declined = tuple(error.reasons.get(name, ("(none)",)))
        if declined != tuple(reasons):
            problems.append(f"forcing {name}: reasons {declined}, but its supports(cfg) says {tuple(reasons)}")
    return problems


def assert_case_passes(case: Case, *, device: str = "cpu", framework: str = "torch", backend: str | None = None,
                       oracle=None) -> CaseResult:
    """A regression test's one line: the case runs (or is declined, when forced) without a problem."""
    result = run_case(case, device=device, framework=framework, backend=backend, oracle=oracle)
    assert not result.problems, result.describe()
    return result


# ----------------------------------------------------------------------------- the log of a run

def _group(reason: str) -> str:
    """A reason with its numbers blanked, so reasons that differ only in sizes count together."""
    return re.sub(r"\d+(\.\d+)?", "#", reason)


@dataclass
class FuzzLog:
    """Every CaseResult of a fuzz run: counts, grouped skips and declines, failures in full."""

    results: list = field(default_factory=list)

    def add(self, result: CaseResult) -> CaseResult:
        self.results.append(result)
        return result

    @property
    def failures(self) -> list:
        return [r for r in self.results if r.problems]

    def ran(self) -> Counter:
        return Counter(r.backend for r in self.results if r.backend is not None)

    def skips(self) -> Counter:
        return Counter((r.forced, _group(reason)) for r in self.results for reason in r.skipped)

    def declines(self) -> Counter:
        return Counter((name, _group(reason)) for r in self.results for name, reasons in r.declined.items()
                       for reason in reasons)

    def coverage(self) -> Counter:
        """How many of the calls that ran had each feature (see case_features)."""
        return Counter(tag for r in self.results if r.backend is not None for tag in case_features(r.case))

    def missing(self, required) -> list[str]:
        """The required features that no call that ran had."""
        seen = self.coverage()
        return sorted(tag for tag in required if not seen[tag])

    def report(self, title: str) -> str:
        statuses = Counter(r.status for r in self.results)
        lines = [title, f"calls tried: {len(self.results)}; passed {statuses['passed']}, skipped "
                        f"{statuses['skipped']}, failed (mismatch, NaN, crash) {statuses['failed']}",
                 f"distinct configs: {len({dataclasses.replace(r.case, seed=0) for r in self.results})}",
                 "ran, per backend: " + (", ".join(f"{n} {c}" for n, c in sorted(self.ran().items())) or "none")]
        lines.append("features of the calls that ran (how many had each):")
        by_kind: dict = {}
        for tag, count in sorted(self.coverage().items()):
            kind, _, value = tag.partition("=")
            by_kind.setdefault(kind, []).append(f"{value}: {count}" if value else str(count))
        lines += [f"  {kind}: {', '.join(values)}" for kind, values in by_kind.items()]
        lines.append(f"skips (a forced backend declined), grouped: {sum(self.skips().values())}")
        lines += [f"  {count:5d}  {name}: {reason}" for (name, reason), count in self.skips().most_common()]
        lines.append("declined by selection before the backend that ran (reasons, grouped):")
        lines += [f"  {count:5d}  {name}: {reason}" for (name, reason), count in self.declines().most_common()]
        lines.append(f"failures: {len(self.failures)}")
        lines += [r.describe() for r in self.failures]
        return "\n".join(lines) + "\n"

    def check(self, *, at_least_ran: int) -> None:
        """Fail on any problem (all of them listed), or when too few calls actually ran."""
        assert not self.failures, f"{len(self.failures)} fuzz failures:\n" + "\n".join(
            r.describe() for r in self.failures)
        ran = sum(self.ran().values())
        assert ran >= at_least_ran, f"only {ran} calls ran (skips: {dict(self.skips())})"


def case_features(case: Case) -> set:
    """Tags for what a case exercises ("layout=thd", "score_mod=softcap", "empty sequence", ...)."""
    tags = {f"layout={case.layout}", f"mask={case.mask}", f"dtype={case.dtype}", f"softmax={case.softmax_type}",
            f"head_dim={case.head_dim}"}
    lengths = (*(case.lens_q or ()), *(case.lens_kv or ()))
    if not case.ragged:
        lengths += (case.seqlen_q, case.seqlen_kv)
    flags = {"empty sequence": 0 in lengths, "one-token sequence": 1 in lengths,
             "D differs from Dv": case.head_dim != case.head_dim_v, "GQA": 1 < case.heads_kv < case.heads_q,
             "MQA": case.heads_kv == 1 < case.heads_q,
             "Sq < Skv": case.seqlen_q < case.seqlen_kv, "Sq > Skv": case.seqlen_q > case.seqlen_kv,
             "window": case.window != (-1, -1), "large logits": case.logit_scale > 1, "scale": case.scale is not None,
             "max_logit": case.max_logit, "THD gaps": case.gaps is not None,
             "THD length off the 64 tiles": case.ragged and any(n % 64 for n in lengths)}
    tags |= {name for name, on in flags.items() if on}
    if case.bias is not None:
        tags.add(f"bias={case.bias_type}")
        tags |= {f"bias broadcast={axis}" for axis, code in zip("bhqk"[4 - len(case.bias):], case.bias) if code == "1"}
    if case.alibi is not None:
        tags.add(f"alibi={case.alibi}")
    if case.score_mod is not None:
        tags.add(f"score_mod={case.score_mod[0]}")
        tags |= {f"score_mod={part[0]}" for part in case.score_mod_parts()}
        if any(part[-1] is True for part in case.score_mod_parts()):
            tags.add("learnable score_mod tensor")
    return tags


# What the CPU profile must exercise among the calls that ran (the brief of this fuzzer).
REQUIRED_FEATURES = (
    {f"layout={x}" for x in LAYOUTS} | {f"mask={x}" for x in MASKS} | {f"head_dim={x}" for x in HEAD_DIMS}
    | {f"softmax={x}" for x in ("vanilla", "off_by_one", "learnable")} | {"bias=pre_scale", "bias=post_scale"}
    | {f"bias broadcast={axis}" for axis in "bhqk"} | {f"alibi={x}" for x in ("h", "bh", "standard")}
    | {f"score_mod={x}" for x in (*SCORE_MOD_KINDS, "compose")}
    | {"learnable score_mod tensor", "empty sequence", "one-token sequence", "D differs from Dv", "GQA", "MQA",
       "Sq < Skv", "Sq > Skv", "window", "large logits", "scale", "max_logit", "THD gaps",
       "THD length off the 64 tiles", "dtype=float32", "dtype=bfloat16"})
