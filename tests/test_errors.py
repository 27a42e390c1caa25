"""Malformed input raises a clear ValueError at once (STYLE rule 11).

Every case names the offending argument and the value it got; the torch frontend is
covered in full, the JAX frontend through a representative subset (plus jit), and
`AttentionConfig` through direct construction.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
from needs_torch import HAS_TORCH, requires_torch

from fusedattn import AttentionConfig

torch_frontend = requires_torch("the torch frontend's errors")

pytestmark = pytest.mark.usefixtures("fresh_selection")


@dataclass
class Case:
    """One malformed call: `call(attention, xp)` must raise ValueError naming `argument` and `got`."""

    id: str
    call: Callable
    argument: str
    got: str
    env: dict = field(default_factory=dict)
    got_regex: str | None = None  # where the value may be described more than one way

    @property
    def pattern(self) -> str:
        return re.escape(self.argument) + r".*" + (self.got_regex or re.escape(self.got))


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


def rand(*shape):
    return torch.randn(*shape)


# B=2, S=8, Hq=4, Hkv=2, D=16 (bshd); THD: 10 tokens in two sequences [0, 4, 10). Without torch
# the torch cases skip and these are never used.
if HAS_TORCH:
    import torch

    Q, K, V = rand(2, 8, 4, 16), rand(2, 8, 2, 16), rand(2, 8, 2, 16)
    QT, KT, VT = rand(10, 4, 16), rand(10, 2, 16), rand(10, 2, 16)
    CU = i32([0, 4, 10])
    QKV = rand(2, 8, 3, 4, 16)


def thd(A, **kw):
    kw = {"cu_seqlens_q": CU, "cu_seqlens_kv": CU, **kw}
    return A(QT, KT, VT, layout="thd", **kw)


TORCH_CASES = [
    # shapes: rank for the layout
    Case("q-rank", lambda A: A(Q[0], K, V), "q: expected a 4-D tensor", "got shape (8, 4, 16)"),
    Case("k-rank", lambda A: A(Q, K[0], V), "k: expected a 4-D tensor", "got shape (8, 2, 16)"),
    Case("v-rank-bhsd", lambda A: A(Q, K, V[..., None], layout="bhsd"), "v: expected a 4-D tensor",
         "got shape (2, 8, 2, 16, 1)"),
    Case("q-rank-thd", lambda A: A(Q, KT, VT, layout="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU),
         "q: expected a 3-D tensor", "got shape (2, 8, 4, 16)"),
    # shapes: agreement between tensors
    Case("batch", lambda A: A(Q, K[:1], V[:1]), "batch (B)", "got q has 2, k has 1, v has 1"),
    Case("head-dim-q-vs-k", lambda A: A(Q, K[..., :8], V), "head dim of q and k (D)", "got q has 16, k has 8"),
    Case("heads-k-vs-v", lambda A: A(Q, K, V[:, :, :1]), "heads of k and v (H)", "got k has 2, v has 1"),
    Case("hq-not-multiple", lambda A: A(rand(2, 8, 3, 16), K, V), "heads: expected Hq a multiple of Hkv",
         "got Hq=3, Hkv=2"),
    Case("skv-k-vs-v", lambda A: A(Q, K, V[:, :5]), "key/value sequence length (Skv)", "got k has 8, v has 5"),
    Case("thd-tokens-k-vs-v", lambda A: A(QT, KT, VT[:9], layout="thd", cu_seqlens_q=CU, cu_seqlens_kv=CU),
         "tokens of k and v (T)", "got k has 10, v has 9"),
    Case("hkv-zero", lambda A: A(Q, rand(2, 8, 0, 16), rand(2, 8, 0, 16)), "heads", "0"),
    # dtypes and devices
    Case("dtype-mismatch", lambda A: A(Q, K.double(), V), "k: expected dtype float32 like q", "got float64"),
    Case("dtype-int-q", lambda A: A(Q.int(), K.int(), V.int()), "q: expected a floating dtype", "got int32"),
    Case("dtype-complex-q", lambda A: A(Q.to(torch.complex64), K, V), "q: expected a floating dtype",
         "got complex64"),
    Case("device-mismatch", lambda A: A(Q, K.to("meta"), V), "k: expected device cpu like q", "got meta"),
    Case("bias-device", lambda A: A(Q, K, V, bias=torch.zeros(8, 8, device="meta")),
         "bias: expected device cpu like q", "got meta"),
    Case("q-not-a-tensor", lambda A: A(Q.numpy(), K, V), "q: expected a torch.Tensor", "got ndarray"),
    # names
    Case("layout-unknown", lambda A: A(Q, K, V, layout="bsdh"), "layout: expected one of", "got 'bsdh'"),
    Case("mask-unknown", lambda A: A(Q, K, V, mask="causall"), "mask: expected one of", "got 'causall'"),
    Case("softmax-unknown", lambda A: A(Q, K, V, softmax_type="sparsemax"), "softmax_type: expected one of",
         "got 'sparsemax'"),
    Case("bias-type-unknown", lambda A: A(Q, K, V, bias=torch.zeros(8, 8), bias_type="post"),
         "bias_type: expected one of", "got 'post'"),
    Case("bias-type-alibi-with-bias", lambda A: A(Q, K, V, bias=torch.zeros(8, 8), bias_type="alibi"),
         "bias_type: expected 'pre_scale' or 'post_scale'", "got 'alibi'"),
    Case("bias-type-without-bias", lambda A: A(Q, K, V, bias_type="post_scale"),
         "bias: expected a tensor for bias_type 'post_scale'", "got None"),
    # window
    Case("window-3-values", lambda A: A(Q, K, V, window=(1, 2, 3)), "window: expected (left, right)",
         "got (1, 2, 3)"),
    Case("window-below-minus-1", lambda A: A(Q, K, V, window=(-2, 0)), "window: expected (left, right)",
         "got (-2, 0)"),
    Case("window-non-int", lambda A: A(Q, K, V, window=(1.5, 0)), "window: expected (left, right)",
         "got (1.5, 0)"),
    Case("window-string", lambda A: A(Q, K, V, window="4,0"), "window: expected (left, right)", "got '4,0'"),
    Case("window-right-with-causal", lambda A: A(Q, K, V, mask="causal", window=(4, 4)), "window: right=4",
         "mask 'causal' forbids"),
    # scalars
    Case("dropout-negative", lambda A: A(Q, K, V, dropout_p=-0.1), "dropout_p: expected a float in [0, 1)",
         "got -0.1"),
    Case("dropout-one", lambda A: A(Q, K, V, dropout_p=1.0), "dropout_p: expected a float in [0, 1)", "got 1.0"),
    Case("dropout-string", lambda A: A(Q, K, V, dropout_p="0.1"), "dropout_p", "got '0.1'"),
    Case("scale-zero", lambda A: A(Q, K, V, scale=0.0), "scale: expected a finite float > 0", "got 0.0"),
    Case("scale-negative", lambda A: A(Q, K, V, scale=-1.0), "scale: expected a finite float > 0", "got -1.0"),
    Case("scale-nan", lambda A: A(Q, K, V, scale=math.nan), "scale: expected a finite float > 0", "got nan"),
    Case("scale-inf", lambda A: A(Q, K, V, scale=math.inf), "scale: expected a finite float > 0", "got inf"),
    Case("deterministic-not-bool", lambda A: A(Q, K, V, deterministic=1), "deterministic: expected a bool",
         "got 1"),
    Case("dropout-seed-float", lambda A: A(Q, K, V, dropout_p=0.1, dropout_seed=1.5), "dropout_seed", "got 1.5"),
    Case("dropout-seed-str", lambda A: A(Q, K, V, dropout_p=0.1, dropout_seed="7"), "dropout_seed", "got '7'"),
    Case("dropout-seed-float-tensor", lambda A: A(Q, K, V, dropout_p=0.1, dropout_seed=torch.tensor(1.0)),
         "dropout_seed", "got a torch.float32 tensor of shape ()"),
    Case("dropout-offset-none", lambda A: A(Q, K, V, dropout_p=0.1, dropout_seed=1, dropout_offset=None),
         "dropout_offset", "got None"),
    # bias, alibi, sink
    Case("bias-shape", lambda A: A(Q, K, V, bias=torch.zeros(2, 4, 8, 7)),
         "bias: expected a shape broadcastable to [B|1, Hq|1, Sq|1, Skv|1] = [2, 4, 8, 8]", "got [2, 4, 8, 7]"),
    Case("bias-shape-heads", lambda A: A(Q, K, V, bias=torch.zeros(3, 8, 8)),
         "bias: expected a shape broadcastable", "got [1, 3, 8, 8]"),
    Case("bias-int-dtype", lambda A: A(Q, K, V, bias=torch.zeros(8, 8, dtype=torch.int32)),
         "bias: expected a floating tensor", "got dtype int32"),
    Case("bias-with-alibi", lambda A: A(Q, K, V, bias=torch.zeros(8, 8), alibi_slopes=torch.ones(4)),
         "alibi_slopes: expected None when a bias tensor is given", "got a tensor"),
    Case("bias-with-thd", lambda A: thd(A, bias=torch.zeros(1, 4, 6, 6)), "bias", "THD"),
    Case("alibi-shape", lambda A: A(Q, K, V, alibi_slopes=torch.ones(3)), "alibi_slopes: expected shape (Hq,)=(4,)",
         "got (3,)"),
    Case("alibi-int-dtype", lambda A: A(Q, K, V, alibi_slopes=torch.ones(4, dtype=torch.int64)),
         "alibi_slopes: expected a floating tensor", "got int64"),
    Case("learnable-without-sink", lambda A: A(Q, K, V, softmax_type="learnable"),
         "sink: expected a (Hq,) tensor of sink logits for softmax_type 'learnable'", "got None"),
    Case("sink-with-vanilla", lambda A: A(Q, K, V, sink=torch.zeros(4)), "sink: expected None for softmax_type",
         "got a tensor"),
    Case("sink-shape", lambda A: A(Q, K, V, softmax_type="learnable", sink=torch.zeros(3)),
         "sink: expected shape (Hq,) = (4,)", "got shape (3,)"),
    Case("sink-int-dtype", lambda A: A(Q, K, V, softmax_type="learnable", sink=torch.zeros(4, dtype=torch.int64)),
         "sink: expected a floating tensor", "got int64"),
    # THD offsets
    Case("thd-without-cu-seqlens", lambda A: A(QT, KT, VT, layout="thd"),
         "cu_seqlens_q: expected a (B+1,) offsets tensor for layout 'thd'", "got None"),
    Case("thd-without-cu-seqlens-kv", lambda A: A(QT, KT, VT, layout="thd", cu_seqlens_q=CU),
         "cu_seqlens_kv: expected a (B+1,) offsets tensor for layout 'thd'", "got None"),
    Case("cu-seqlens-float", lambda A: thd(A, cu_seqlens_q=CU.float()),
         "cu_seqlens_q: expected an int32 or int64 tensor", "got dtype float32"),
    Case("cu-seqlens-2d", lambda A: thd(A, cu_seqlens_q=CU[None]), "cu_seqlens_q: expected a 1-D tensor",
         "got shape (1, 3)"),
    Case("cu-seqlens-one-offset", lambda A: thd(A, cu_seqlens_q=i32([0])), "cu_seqlens_kv: expected B+1 = 1 offsets",
         "got shape (3,)"),
    Case("cu-seqlens-no-offset", lambda A: thd(A, cu_seqlens_q=i32([])), "cu_seqlens_q: expected a 1-D tensor of B+1 "
         "offsets (B >= 0)", "got shape (0,)"),
    Case("cu-seqlens-0d", lambda A: thd(A, cu_seqlens_q=torch.tensor(4, dtype=torch.int32)), "cu_seqlens_q",
         "shape ()"),
    Case("cu-seqlens-device", lambda A: thd(A, cu_seqlens_q=CU.to("meta")), "cu_seqlens_q", "meta"),
    Case("cu-seqlens-not-from-0", lambda A: thd(A, cu_seqlens_q=i32([1, 4, 10])),
         "cu_seqlens_q: expected the first offset to be 0", "got 1"),
    Case("cu-seqlens-decreasing", lambda A: thd(A, cu_seqlens_kv=i32([0, 6, 4])),
         "cu_seqlens_kv: expected non-decreasing offsets", "got 6 then 4 at index 1"),
    Case("cu-seqlens-beyond-tokens", lambda A: thd(A, cu_seqlens_q=i32([0, 4, 12])),
         "cu_seqlens_q: last offset 12", "exceeds the 10 packed tokens"),
    Case("cu-seqlens-batch-mismatch", lambda A: thd(A, cu_seqlens_q=i32([0, 4, 6, 10])),
         "cu_seqlens_kv: expected B+1 = 4 offsets", "got shape (3,)"),
    Case("padded-offsets-no-room", lambda A: thd(A, cu_seqlens_q_padded=i32([0, 3, 10]), cu_seqlens_kv_padded=CU),
         "cu_seqlens_q_padded: sequence 0 holds 4 tokens", "has room for 3"),
    Case("padded-offsets-only-one", lambda A: thd(A, cu_seqlens_q_padded=CU),
         "cu_seqlens_q_padded/cu_seqlens_kv_padded: expected both or neither", "got only one"),
    Case("padded-offsets-on-bshd", lambda A: A(Q, K, V, cu_seqlens_q_padded=i32([0, 8, 16])),
         "cu_seqlens_q_padded: expected None", "got a tensor"),
    Case("max-seqlen-too-small", lambda A: thd(A, max_seqlen_q=3, max_seqlen_kv=6),
         "cu_seqlens_q: a sequence of 6 tokens", "exceeds max_seqlen_q=3"),
    Case("max-seqlen-float", lambda A: thd(A, max_seqlen_q=6.0), "max_seqlen_q: expected an int >= 0", "got 6.0"),
    # padding masks on padded layouts
    Case("padding-mask-without-cu-seqlens", lambda A: A(Q, K, V, mask="padding"),
         "cu_seqlens_q: expected a (B+1,) offsets tensor", "got None"),
    Case("cu-seqlens-with-causal-mask", lambda A: A(Q, K, V, mask="causal", cu_seqlens_q=i32([0, 4, 8]),
                                                    cu_seqlens_kv=i32([0, 4, 8])),
         "mask: expected a padding mask when cu_seqlens are given", "got 'causal'"),
    Case("padding-sequence-longer-than-s", lambda A: A(Q, K, V, mask="padding", cu_seqlens_q=i32([0, 4, 13]),
                                                       cu_seqlens_kv=i32([0, 4, 8])),
         "cu_seqlens_q: a sequence of 9 tokens", "exceeds the tensor's Sq=8"),
    # packed layouts
    Case("packed-given-k", lambda A: A(QKV, K, layout="bs3hd"), "k: expected None for packed layout 'bs3hd'",
         "got a tensor"),
    Case("missing-v", lambda A: A(Q, K), "v: expected a tensor for layout 'bshd'", "got None"),
    Case("packed-missing-kv", lambda A: A(Q, layout="bshd_bs2hd"), "kv: expected a tensor for layout 'bshd_bs2hd'",
         "got None"),
    Case("packed-axis-3", lambda A: A(rand(2, 8, 2, 4, 16), layout="bs3hd"),
         "qkv: expected size 3 at the packing axis of BS3HD", "got shape (2, 8, 2, 4, 16)"),
    Case("packed-axis-2", lambda A: A(Q, rand(2, 8, 3, 2, 16), layout="bshd_bs2hd"),
         "kv: expected size 2 at the packing axis of BS2HD", "got shape (2, 8, 3, 2, 16)"),
    Case("padding-max-seqlen-str", lambda A: A(Q, K, V, mask="padding", cu_seqlens_q=i32([0, 4, 8]),
                                               cu_seqlens_kv=i32([0, 4, 8]), max_seqlen_q="4"),
         "max_seqlen_q: expected an int >= 0", "got '4'"),
    Case("padding-max-seqlen-negative", lambda A: A(Q, K, V, mask="padding", cu_seqlens_q=i32([0, 4, 8]),
                                                    cu_seqlens_kv=i32([0, 4, 8]), max_seqlen_kv=-3),
         "max_seqlen_kv: expected an int >= 0", "got -3"),
    # other
    Case("alibi-slopes-str", lambda A: A(Q, K, V, mask="causal", alibi_slopes="x"),
         "alibi_slopes: expected a tensor, list or NumPy array", "got str"),
    Case("dropout-seed-past-int64", lambda A: A(Q, K, V, dropout_p=0.1, dropout_seed=2**70),
         "dropout_seed: expected an int that fits in int64", f"got {2**70}"),
    Case("score-mod-not-callable", lambda A: A(Q, K, V, score_mod=3), "score_mod: expected a callable", "got int"),
    Case("mask-tensor", lambda A: A(Q, K, V, mask=torch.ones(8, 8, dtype=torch.bool)), "mask: expected one of",
         "got an array of shape (8, 8), dtype torch.bool; a mask tensor is not a mask name: pass an additive one as "
         "bias="),
    Case("backend-unknown", lambda A: A(Q, K, V, backend="flash"), "backend: expected one of", "got 'flash'"),
    Case("env-backend-unknown", lambda A: A(Q, K, V), "FUSEDATTN_BACKEND: expected one of", "got 'flash'",
         env={"FUSEDATTN_BACKEND": "flash"}),
]


def _ids(cases):
    return [c.id for c in cases]


@torch_frontend
@pytest.mark.parametrize("case", TORCH_CASES, ids=_ids(TORCH_CASES))
def test_torch_malformed_input_raises_value_error(case, monkeypatch):
    import fusedattn.torch as fat

    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=case.pattern):
        case.call(fat.attention)


@torch_frontend
def test_flags_of_the_flex_drop_in_and_the_module_are_bools():
    """A truthy string ("no") was read as True: GQA ran where the caller said no, the module stored True."""
    import fusedattn.torch as fat

    bhsd = [x.transpose(1, 2) for x in (Q, K, V)]
    for name in ("enable_gqa", "return_lse"):
        with pytest.raises(ValueError, match=rf"fusedattn.torch.flex_attention: {name}: expected a bool, got 'no'"):
            fat.flex_attention(*bhsd, **{name: "no"})
    with pytest.raises(ValueError, match="DotProductAttention: deterministic: expected a bool, got 'no'"):
        fat.DotProductAttention(deterministic="no")


@torch_frontend
def test_a_modules_mask_is_overridden_only_by_a_mask_not_by_an_empty_string():
    """mask="" fell back to the module's mask; it is a bad mask, refused as attention refuses it."""
    import fusedattn.torch as fat

    module = fat.DotProductAttention(mask="causal")
    with pytest.raises(ValueError, match="mask: expected one of .*got ''"):
        module(Q, K, V, mask="")


@torch_frontend
def test_torch_errors_name_the_function(monkeypatch):
    """STYLE rule 11: every message starts with the function that was called."""
    import fusedattn.torch as fat

    missing = {}
    for case in TORCH_CASES:
        with monkeypatch.context() as m:
            for name, value in case.env.items():
                m.setenv(name, value)
            try:
                case.call(fat.attention)
            except ValueError as error:
                if not str(error).startswith("fusedattn.torch.attention: "):
                    missing[case.id] = str(error)
            except Exception:  # reported by the per-case test
                pass
    assert not missing, "messages without the 'fusedattn.torch.attention: ' prefix:\n" + "\n".join(
        f"  {k}: {v}" for k, v in missing.items())


@torch_frontend
def test_errors_are_raised_before_any_backend_runs(monkeypatch):
    """Validation comes first: a malformed call never reaches selection."""
    import fusedattn.selection as selection
    import fusedattn.torch as fat

    def no_selection(*args, **kwargs):
        raise AssertionError("selection consulted for a malformed call")

    monkeypatch.setattr(selection, "_decide", no_selection)
    with pytest.raises(ValueError, match="scale"):
        fat.attention(Q, K, V, scale=-1.0)


@torch_frontend
def test_explicit_backend_wins_over_bad_environment(monkeypatch):
    import fusedattn.torch as fat

    monkeypatch.setenv("FUSEDATTN_BACKEND", "flash")
    out = fat.attention(Q, K, V, backend="reference")
    assert out.shape == (2, 8, 4, 16)


# --------------------------------------------------------------------------- JAX


jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


_RNG = np.random.default_rng(0)


def jrand(*shape):
    return jnp.asarray(_RNG.standard_normal(shape, np.float32))


# The torch inputs' shapes.
JQ, JK, JV = jrand(2, 8, 4, 16), jrand(2, 8, 2, 16), jrand(2, 8, 2, 16)
JQT, JKT, JVT = jrand(10, 4, 16), jrand(10, 2, 16), jrand(10, 2, 16)
JCU = jnp.asarray([0, 4, 10], jnp.int32)
JQKV = jrand(2, 8, 3, 4, 16)


def jthd(A, **kw):
    kw = {"cu_seqlens_q": JCU, "cu_seqlens_kv": JCU, **kw}
    return A(JQT, JKT, JVT, layout="thd", **kw)


JAX_CASES = [
    Case("q-rank", lambda A: A(JQ[0], JK, JV), "q: expected a 4-D tensor", "got shape (8, 4, 16)"),
    Case("batch", lambda A: A(JQ, JK[:1], JV[:1]), "batch (B)", "got q has 2, k has 1, v has 1"),
    Case("hq-not-multiple", lambda A: A(JQ[:, :, :3], JK, JV), "heads: expected Hq a multiple of Hkv",
         "got Hq=3, Hkv=2"),
    Case("hkv-zero", lambda A: A(JQ, JK[:, :, :0], JV[:, :, :0]), "heads", "0"),
    Case("dtype-mismatch", lambda A: A(JQ, JK.astype(jnp.float16), JV), "k: expected dtype float32 like q",
         "got float16"),
    Case("dtype-int-q", lambda A: A(JQ.astype(jnp.int32), JK, JV), "q: expected a floating dtype", "got int32"),
    Case("not-an-array", lambda A: A([[1.0]], JK, JV), "q: expected a JAX array", "got list"),
    Case("mask-unknown", lambda A: A(JQ, JK, JV, mask="diag"), "mask: expected one of", "got 'diag'"),
    Case("mask-array", lambda A: A(JQ, JK, JV, mask=jnp.ones((8, 8), bool)), "mask: expected one of",
         "got an array of shape (8, 8), dtype bool; a mask tensor is not a mask name"),
    Case("window-3-values", lambda A: A(JQ, JK, JV, window=(1, 2, 3)), "window: expected (left, right)",
         "got (1, 2, 3)"),
    Case("window-right-with-causal", lambda A: A(JQ, JK, JV, mask="causal", window=(4, 4)), "window: right=4",
         "mask 'causal' forbids"),
    Case("scale-zero", lambda A: A(JQ, JK, JV, scale=0.0), "scale: expected a finite float > 0", "got 0.0"),
    Case("dropout-one", lambda A: A(JQ, JK, JV, dropout_p=1.0), "dropout_p: expected a float in [0, 1)",
         "got 1.0"),
    Case("dropout-without-rng", lambda A: A(JQ, JK, JV, dropout_p=0.1), "dropout_rng: expected a PRNG key",
         "got None"),
    Case("dropout-seed-str", lambda A: A(JQ, JK, JV, dropout_p=0.1, dropout_seed="7"), "dropout_seed", "got '7'"),
    Case("dropout-seed-float", lambda A: A(JQ, JK, JV, dropout_p=0.1, dropout_seed=1.5), "dropout_seed", "got 1.5"),
    Case("dropout-seed-vector", lambda A: A(JQ, JK, JV, dropout_p=0.1, dropout_seed=jnp.ones((3,), jnp.int32)),
         "dropout_seed: expected an int or a one-element", "", got_regex=r"got .*(\(3,\)|\[1, 1, 1\])"),
    Case("bias-shape", lambda A: A(JQ, JK, JV, bias=jnp.zeros((3, 8, 8))), "bias: expected a shape broadcastable",
         "got [1, 3, 8, 8]"),
    Case("bias-with-alibi", lambda A: A(JQ, JK, JV, bias=jnp.zeros((8, 8)), alibi_slopes=jnp.ones(4)),
         "alibi_slopes: expected None when a bias tensor is given", "got a tensor"),
    Case("learnable-without-sink", lambda A: A(JQ, JK, JV, softmax_type="learnable"),
         "sink: expected a (Hq,) tensor", "got None"),
    Case("thd-without-cu-seqlens", lambda A: A(JQT, JKT, JVT, layout="thd"),
         "cu_seqlens_q: expected a (B+1,) offsets tensor for layout 'thd'", "got None"),
    Case("cu-seqlens-float", lambda A: jthd(A, cu_seqlens_q=JCU.astype(jnp.float32)),
         "cu_seqlens_q: expected an int32 or int64 tensor", "got dtype float32"),
    Case("cu-seqlens-decreasing", lambda A: jthd(A, cu_seqlens_q=jnp.asarray([0, 6, 4], jnp.int32)),
         "cu_seqlens_q: expected non-decreasing offsets", "got 6 then 4 at index 1"),
    Case("cu-seqlens-0d", lambda A: jthd(A, cu_seqlens_q=jnp.asarray(4, jnp.int32)), "cu_seqlens_q", "shape ()"),
    Case("max-seqlen-too-small", lambda A: jthd(A, max_seqlen_q=3, max_seqlen_kv=6),
         "cu_seqlens_q: a sequence of 6 tokens", "exceeds max_seqlen_q=3"),
    Case("packed-given-k", lambda A: A(JQKV, JK, layout="bs3hd"), "k: expected None for packed layout",
         "got a tensor"),
    Case("packed-axis-3", lambda A: A(jnp.zeros((2, 8, 2, 4, 16)), layout="bs3hd"),
         "qkv: expected size 3 at the packing axis", "got shape (2, 8, 2, 4, 16)"),
    Case("score-mod-not-callable", lambda A: A(JQ, JK, JV, score_mod="tanh"), "score_mod: expected a callable",
         "got str"),
    Case("alibi-slopes-str", lambda A: A(JQ, JK, JV, mask="causal", alibi_slopes="x"),
         "alibi_slopes: expected an array, list or NumPy array", "got str"),
    Case("score-mod-numpy-table",
         lambda A: A(JQ, JK, JV, score_mod=lambda s, b, h, i, j: s + np.ones(8, np.float32)[j]),
         "score_mod: it reads a NumPy array at a traced index", "jnp.asarray"),
    Case("padding-max-seqlen-float", lambda A: A(JQ, JK, JV, mask="padding", cu_seqlens_q=jnp.asarray([0, 4, 8]),
                                                 cu_seqlens_kv=jnp.asarray([0, 4, 8]), max_seqlen_q=2.5),
         "max_seqlen_q: expected an int >= 0", "got 2.5"),
    Case("backend-unknown", lambda A: A(JQ, JK, JV, backend="flash"), "backend: expected one of", "got 'flash'"),
    Case("env-backend-unknown", lambda A: A(JQ, JK, JV), "FUSEDATTN_BACKEND: expected one of", "got 'flash'",
         env={"FUSEDATTN_BACKEND": "flash"}),
]


@pytest.mark.parametrize("case", JAX_CASES, ids=_ids(JAX_CASES))
def test_jax_malformed_input_raises_value_error(case, monkeypatch):
    import fusedattn.jax as fj

    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=case.pattern):
        case.call(fj.attention)


JIT_CASES = [
    Case("rank-under-jit", lambda A: jax.jit(lambda q: A(q, JK, JV))(JQ[0]), "q: expected a 4-D tensor",
         "got shape (8, 4, 16)"),
    Case("scale-under-jit", lambda A: jax.jit(lambda q: A(q, JK, JV, scale=-1.0))(JQ),
         "scale: expected a finite float > 0", "got -1.0"),
    Case("thd-traced-offsets-no-max-seqlen",
         lambda A: jax.jit(lambda cq, ck: jthd(A, cu_seqlens_q=cq, cu_seqlens_kv=ck))(JCU, JCU),
         "max_seqlen_q: expected a static int when cu_seqlens_q is traced (under jit; offsets made from segment_ids_q",
         "got None"),
    Case("thd-traced-offsets-no-max-seqlen-kv",
         lambda A: jax.jit(lambda cq, ck: jthd(A, cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=6))(JCU, JCU),
         "max_seqlen_kv: expected a static int when cu_seqlens_kv is traced (under jit; offsets made from "
         "segment_ids_kv", "got None"),
]


@pytest.mark.parametrize("case", JIT_CASES, ids=_ids(JIT_CASES))
def test_jax_malformed_input_under_jit(case):
    import fusedattn.jax as fj

    with pytest.raises(ValueError, match=case.pattern):
        case.call(fj.attention)


def test_jax_thd_under_jit_with_static_max_seqlen_runs():
    """The fix the error message above asks for works."""
    import fusedattn.jax as fj

    f = jax.jit(lambda cq, ck: jthd(fj.attention, cu_seqlens_q=cq, cu_seqlens_kv=ck, max_seqlen_q=6,
                                    max_seqlen_kv=6))
    assert f(JCU, JCU).shape == (10, 4, 16)


def test_jax_errors_name_the_function(monkeypatch):
    import fusedattn.jax as fj

    missing = {}
    for case in JAX_CASES + JIT_CASES:
        with monkeypatch.context() as m:
            for name, value in case.env.items():
                m.setenv(name, value)
            try:
                case.call(fj.attention)
            except ValueError as error:
                if not str(error).startswith("fusedattn.jax.attention: "):
                    missing[case.id] = str(error)
            except Exception:  # reported by the per-case test
                pass
    assert not missing, "messages without the 'fusedattn.jax.attention: ' prefix:\n" + "\n".join(
        f"  {k}: {v}" for k, v in missing.items())


# --------------------------------------------------------------------------- AttentionConfig

BASE = dict(dtype="float16", layout="bshd", batch=2, seqlen_q=8, seqlen_kv=8, heads_q=4, heads_kv=2,
            head_dim_qk=16, head_dim_v=16)

CONFIG_CASES = [
    ("dtype", {"dtype": "int8"}, "dtype: expected one of", "got 'int8'"),
    ("k-dtype", {"k_dtype": "float8"}, "k_dtype: expected one of", "got 'float8'"),
    ("layout", {"layout": "bhds"}, "layout: expected one of", "got 'bhds'"),
    ("mask", {"mask": "full"}, "mask: expected one of", "got 'full'"),
    ("bias", {"bias": "relative"}, "bias: expected one of", "got 'relative'"),
    ("softmax", {"softmax": "sparse"}, "softmax: expected one of", "got 'sparse'"),
    ("device", {"device": "tpu"}, "device: expected one of", "got 'tpu'"),
    ("framework", {"framework": "numpy"}, "framework: expected one of", "got 'numpy'"),
    ("batch-negative", {"batch": -1}, "batch: expected an integer >= 0", "got -1"),
    ("seqlen-negative", {"seqlen_q": -1}, "seqlen_q: expected an integer >= 0", "got -1"),
    ("heads-bool", {"heads_kv": True}, "heads_kv: expected an integer >= 1", "got True"),
    ("head-dim-float", {"head_dim_qk": 16.0}, "head_dim_qk: expected an integer >= 1", "got 16.0"),
    ("gqa", {"heads_kv": 3}, "heads: Hq=4 must be a multiple of Hkv=3", ""),
    ("window-list", {"window": [4, 0]}, "window: expected (left, right)", "got [4, 0]"),
    ("window-causal", {"window": (4, 4), "mask": "causal_bottom_right"}, "window: right=4",
     "mask 'causal_bottom_right' forbids"),
    ("dropout", {"dropout_p": 1.5}, "dropout_p: expected a float in [0, 1)", "got 1.5"),
    ("scale", {"scale": float("nan")}, "scale: expected a finite float > 0", "got nan"),
    ("thd-needs-padding", {"layout": "thd"}, "mask: layout 'thd' is packed variable-length",
     "got 'none'; use 'padding'"),
    ("padded-offsets-bshd", {"padded_offsets": True}, "padded_offsets: only for THD layouts", "got layout 'bshd'"),
    ("bs3hd-needs-same-heads", {"layout": "bs3hd"}, "layout 'bs3hd' packs q, k and v together", "Hq == Hkv"),
    ("bias-shape-without-bias", {"bias_shape": (1, 1, 8, 8)}, "bias_shape: must be None", "got (1, 1, 8, 8)"),
    ("bias-shape", {"bias": "post_scale", "bias_shape": (1, 1, 8, 9)}, "bias: expected a shape broadcastable",
     "got [1, 1, 8, 9]"),
    ("alibi-shape", {"bias": "alibi", "bias_shape": (2,)}, "alibi_slopes: expected shape (Hq,)=(4,)", "got (2,)"),
    ("training-not-bool", {"is_training": "yes"}, "is_training: expected a bool", "got 'yes'"),
]


@pytest.mark.parametrize("changes, argument, got", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_attention_config_construction_errors(changes, argument, got):
    with pytest.raises(ValueError, match=re.escape(argument) + ".*" + re.escape(got)):
        AttentionConfig(**{**BASE, **changes})


# ------------------------------------------------------------------ found by an independent sweep

@pytest.mark.parametrize("framework", [pytest.param("torch", marks=torch_frontend), "jax"])
def test_a_score_mod_that_returns_booleans_is_refused_not_read_as_scores(framework):
    """A mask written as a score_mod (s > 0) ran with its booleans cast to 0/1 scores."""
    if framework == "torch":
        import torch

        import fusedattn.torch as frontend
        q = torch.randn(1, 4, 1, 8)
    else:
        import jax.numpy as jnp

        import fusedattn.jax as frontend
        q = jnp.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match=r"score_mod .*expected a float score, got booleans; a mask goes as mask_mod"):
        frontend.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s > 0)


def test_jax_dropout_takes_a_key_or_a_seed_not_both():
    """Given both, the seed was silently ignored."""
    import jax
    import jax.numpy as jnp

    import fusedattn.jax as fj

    q = jnp.ones((1, 4, 1, 8))
    with pytest.raises(ValueError, match="dropout_rng and dropout_seed: expected one of them"):
        fj.attention(q, q, q, dropout_p=0.1, dropout_rng=jax.random.key(0), dropout_seed=3)


@torch_frontend
def test_a_numpy_scale_is_its_value_and_a_tensor_scale_says_what_to_pass():
    import torch

    import fusedattn.torch as fat

    q = torch.randn(1, 4, 1, 8)
    torch.testing.assert_close(fat.attention(q, q, q, scale=np.float32(0.5)), fat.attention(q, q, q, scale=0.5))
    with pytest.raises(ValueError, match=r"scale: expected a Python float > 0 .*got Tensor .*pass float\(scale\)"):
        fat.attention(q, q, q, scale=torch.tensor(0.5))


@torch_frontend
@pytest.mark.parametrize("options", [{}, {"mask": "causal", "return_lse": True}, {"softmax_type": "learnable"},
                                     {"score_mod": "half"}, {"alibi_slopes": [0.5, 0.25]}])
def test_an_empty_batch_answers_empty_outputs_and_gradients(options):
    """B=0 (an empty micro-batch) answers empty outputs and gradients, as SDPA and jax.nn do, where it was
    refused ("batch: expected an integer >= 1"): the reference runs it, the fused backends say why not."""
    import jax
    import jax.numpy as jnp
    import torch

    import fusedattn.jax as fja
    import fusedattn.torch as fat

    if options.get("score_mod") == "half":
        options = {"score_mod": lambda s, b, h, q_idx, kv_idx: s * 0.5}
    sink = {"sink": torch.randn(2)} if "softmax_type" in options else {}
    q = torch.randn(0, 4, 2, 8, requires_grad=True)
    k, v = (torch.randn(0, 5, 2, 8, requires_grad=True) for _ in range(2))
    result = fat.attention(q, k, v, **options, **sink)
    out = result[0] if isinstance(result, tuple) else result
    out.sum().backward()
    assert out.shape == (0, 4, 2, 8) and q.grad.shape == q.shape and k.grad.shape == k.shape
    if options.get("return_lse"):
        assert result.lse.shape == (0, 2, 4)
    text = str(fat.explain(q, k, v, **options, **sink))
    assert "selected: reference" in text and "B=0: an empty batch" in text
    arrays = [jnp.asarray(x.detach().numpy()) for x in (q, k, v)]
    jax_sink = {"sink": jnp.asarray(sink["sink"].numpy())} if sink else {}

    def loss(q):
        got = fja.attention(q, *arrays[1:], **options, **jax_sink)
        return (got[0] if isinstance(got, tuple) else got).sum()

    assert jax.jit(jax.grad(loss))(arrays[0]).shape == (0, 4, 2, 8)


@torch_frontend
@pytest.mark.parametrize("layout, tokens", [("bshd", 0), ("thd", 0), ("thd", 5)], ids=["padding", "thd", "thd-gaps"])
def test_offsets_without_a_sequence_answer_as_an_empty_batch(layout, tokens):
    """cu_seqlens=[0] (an empty packed batch) was refused: it runs on the reference, every token outside every
    sequence (output 0, LSE 0 in THD gaps, gradients 0), as the README's empty batch."""
    import jax
    import jax.numpy as jnp
    import torch

    import fusedattn.jax as fja
    import fusedattn.torch as fat

    cu = torch.zeros(1, dtype=torch.int32)
    shape = (tokens, 2, 8) if layout == "thd" else (0, 4, 2, 8)
    q = torch.randn(*shape, requires_grad=True)
    options = {"layout": layout, "mask": "padding", "cu_seqlens_q": cu, "cu_seqlens_kv": cu, "return_lse": True}
    result = fat.attention(q, q, q, **options)
    result.out.sum().backward()
    assert result.out.shape == shape and torch.equal(result.out, torch.zeros(shape))
    assert torch.equal(result.lse, torch.zeros(result.lse.shape)) and torch.equal(q.grad, torch.zeros(shape))
    assert "B=0: an empty batch" in str(fat.explain(q, q, q, **options))
    jax_options = {**options, "cu_seqlens_q": jnp.zeros(1, jnp.int32), "cu_seqlens_kv": jnp.zeros(1, jnp.int32)}

    def loss(q):
        return fja.attention(q, q, q, **jax_options).out.sum()

    grad = jax.jit(jax.grad(loss))(jnp.ones(shape))
    assert grad.shape == shape and not grad.any()
    assert not np.asarray(fja.attention(jnp.ones(shape), jnp.ones(shape), jnp.ones(shape), **jax_options).out).any()
