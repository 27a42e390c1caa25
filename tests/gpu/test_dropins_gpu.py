"""The drop-ins on a GPU: `fusedattn.torch.scaled_dot_product_attention` (PyTorch's SDPA) and
`fusedattn.jax.dot_product_attention` (jax.nn's).

1. The calls models make run fused (cuDNN): plain, causal (L == S and L != S), GQA, bf16/fp16,
   D 64/128; output and the gradients of query, key and value within the error rule.
2. Boolean masks of the shapes models build (key padding, causal, both) run fused and are
   recognized as the native padding/causal masks; random boolean masks and float masks (in the
   query's dtype or float32, as PyTorch takes them) run as a bias. Each agrees with float64.
3. A call no fused backend runs says why (a RuntimeWarning with each backend's reason) and is right.
4. The JAX drop-in under jit and jax.grad: causal, sequence lengths, GQA, local windows, and
   implementation="cudnn" forced, against jax.nn's XLA math in float32.
5. Small models train through the drop-ins: torch.nn.TransformerEncoder under bf16 autocast
   (F.scaled_dot_product_attention replaced), without and with src_key_padding_mask, and a plain JAX
   attention model.

Error rule (STYLE 15, gpu_checks.assert_close_to_exact): our error against a float64 computation
(JAX: jax.nn's XLA math in float32, on the CPU) must stay within gpu_checks.FACTOR times the error of the
framework's own attention in the same dtype (PyTorch's SDPA; jax.nn's XLA implementation), plus a
small floor relative to the magnitude.

Which backend ran (STYLE 17) is read from the FUSEDATTN_LOG=1 decision lines
("fusedattn: <summary> -> <backend>; others: ..."), decisions forgotten before each test
(conftest's fresh_selection), so every call of a test makes and logs its decision.
"""

from __future__ import annotations

import logging
import math
import re
from typing import NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cudnn")
import torch.nn.functional as F  # noqa: E402
from gpu_checks import FACTOR, assert_close_to_exact  # noqa: E402

import fusedattn.torch as fat  # noqa: E402

pytestmark = pytest.mark.gpu

BF16, FP16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPE_IDS = {BF16: "bf16", FP16: "fp16", F32: "fp32"}
# PyTorch's own SDPA, taken before any test replaces torch.nn.functional's (the training test does).
TORCH_SDPA = F.scaled_dot_product_attention


# ------------------------------------------------------------------ which backend ran

class Decision(NamedTuple):
    summary: str  # cfg.summary(): "layout=bhsd dtype=bfloat16 ... mask=causal ..."
    backend: str
    others: str  # every other backend's reasons, as logged


_DECISION = re.compile(r"^fusedattn: (?P<summary>.*?) -> (?P<backend>[a-z_]+)(?: \(forced by [^)]*\))?; "
                       r"others: (?P<others>.*)$", re.S)


@pytest.fixture
def decisions(fresh_selection, monkeypatch, caplog):
    """A function returning the selection decisions logged so far in the test (FUSEDATTN_LOG=1)."""
    monkeypatch.setenv("FUSEDATTN_LOG", "1")
    caplog.set_level(logging.INFO, logger="fusedattn")

    def logged() -> list[Decision]:
        found = []
        for record in caplog.records:
            match = _DECISION.match(record.getMessage()) if record.name == "fusedattn" else None
            if match:
                found.append(Decision(match["summary"], match["backend"], match["others"]))
        return found

    return logged


def assert_ran_on(found: list[Decision], backend: str = "cudnn") -> None:
    assert found, "no selection decision was logged (FUSEDATTN_LOG=1): did the call reach fusedattn?"
    wrong = [d for d in found if d.backend != backend]
    assert not wrong, "\n".join(f"expected {backend}, selected {d.backend} for: {d.summary}\n  others: {d.others}"
                                for d in wrong)


def summary_mask(summary: str) -> str:
    match = re.search(r"\bmask=(\S+)", summary)
    assert match, f"no mask= in the summary: {summary}"
    return match[1]


# ------------------------------------------------------------------ torch: inputs, float64 math, the rule

def bhsd_inputs(b, hq, hkv, length, s, d, dtype, seed):
    """Fresh random query (B, Hq, L, D), key and value (B, Hkv, S, D) on the GPU in `dtype`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    return make(b, hq, length, d), make(b, hkv, s, d), make(b, hkv, s, d)


def exact_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ·scale + mask) v written out, in the inputs' dtype (float64 here), with SDPA's meaning:
    a boolean mask keeps True, a float mask is added, is_causal is top-left (query i sees keys j <= i)."""
    assert dropout_p == 0.0
    group = query.shape[-3] // key.shape[-3]
    key, value = (x.repeat_interleave(group, dim=-3) for x in (key, value))
    scores = query @ key.transpose(-2, -1) * (1 / math.sqrt(query.shape[-1]) if scale is None else scale)
    if is_causal:  # beside attn_mask, both apply
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool, device=query.device).tril(),
                                    -math.inf)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1) @ value


def _forward_backward(fn, q, k, v, grad_out, attn_mask=None, mask_grad=False, **options):
    """fn's output and the gradients of q, k, v (and of a float attn_mask when mask_grad) for grad_out."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    if mask_grad:
        attn_mask = attn_mask.detach().clone().requires_grad_(True)
    out = fn(*leaves, attn_mask=attn_mask, **options)
    grads = torch.autograd.grad(out, leaves + ([attn_mask] if mask_grad else []), grad_out)
    return (out.detach(), *grads)


def check_against_float64(q, k, v, attn_mask=None, mask_grad=False, grad_seed=11, **options):
    """Ours, PyTorch's SDPA in the same dtype and exact_sdpa in float64 on the same values and cotangent:
    ours within the error rule for the output and every gradient."""
    gen = torch.Generator(device="cuda").manual_seed(grad_seed)
    grad_out = torch.randn((*q.shape[:-1], v.shape[-1]), generator=gen, device="cuda").to(q.dtype)
    ours = _forward_backward(fat.scaled_dot_product_attention, q, k, v, grad_out, attn_mask, mask_grad, **options)
    # PyTorch's CUDA kernels refuse a float32 mask that requires grad with half inputs: its yardstick gets the
    # mask in the query's dtype (the same values up to the one rounding ours makes too).
    narrow = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.to(q.dtype)
    same_options = options
    if attn_mask is not None and options.get("is_causal"):  # PyTorch's kernels with gradients refuse the pair:
        future = ~torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device="cuda").tril()  # fold it
        narrow = narrow & ~future if narrow.dtype == torch.bool else narrow.masked_fill(future, -math.inf)
        same_options = {**options, "is_causal": False}
    same = _forward_backward(TORCH_SDPA, q, k, v, grad_out, narrow, mask_grad, **same_options)
    wide_mask = attn_mask if attn_mask is None or attn_mask.dtype == torch.bool else attn_mask.double()
    exact = _forward_backward(exact_sdpa, q.double(), k.double(), v.double(), grad_out.double(), wide_mask,
                              mask_grad, **options)
    names = ["out", "dq", "dk", "dv"] + (["dmask"] if mask_grad else [])
    assert len(ours) == len(names)
    for name, got, s, e in zip(names, ours, same, exact):
        assert got.shape == e.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(e.shape)}"
        assert torch.isfinite(got).all(), f"{name}: not finite"
        assert e.abs().max() > 0, f"{name}: the float64 result is all zeros: the comparison would prove nothing"
        # dmask sums over the heads it broadcasts across: the loose floor for reductions
        assert_close_to_exact(name, got, s, e, reduction=name == "dmask")


# ------------------------------------------------------------------ 1: the common calls run fused

COMMON = [  # (id, B, Hq, Hkv, L, S, options); each kind of call in both dtypes and both head dims
    ("plain", 2, 8, 8, 128, 128, {}),
    ("causal", 2, 8, 8, 128, 128, {"is_causal": True}),
    ("causal-L<S", 2, 8, 8, 96, 160, {"is_causal": True}),
    ("causal-L>S", 2, 8, 8, 160, 96, {"is_causal": True}),
    ("gqa", 2, 8, 2, 128, 128, {"enable_gqa": True}),
    ("gqa-causal-L<S", 2, 8, 2, 64, 192, {"enable_gqa": True, "is_causal": True}),
    ("L<S-scale", 2, 8, 8, 64, 192, {"scale": 0.3}),
]
DTYPE_DIMS = [(BF16, 64), (FP16, 128), (BF16, 128), (FP16, 64)]
COMMON_CASES = [pytest.param(*case[1:], dtype, d, id=f"{case[0]}-{DTYPE_IDS[dtype]}-d{d}")
                for i, case in enumerate(COMMON) for dtype, d in (DTYPE_DIMS[i % 4], DTYPE_DIMS[(i + 1) % 4])]


@pytest.mark.parametrize("b, hq, hkv, length, s, options, dtype, d", COMMON_CASES)
def test_sdpa_dropin_runs_common_calls_on_cudnn(b, hq, hkv, length, s, options, dtype, d, decisions):
    q, k, v = bhsd_inputs(b, hq, hkv, length, s, d, dtype, seed=length + s + d)
    check_against_float64(q, k, v, **options)
    assert_ran_on(decisions())


# ------------------------------------------------------------------ 2: boolean and float masks

B_MASK, H_MASK, D_MASK = 3, 8, 64


def key_padding(lengths, s):
    """(B, 1, 1, S): key j of sequence b takes part when j < lengths[b] (True = takes part, as in SDPA)."""
    return (torch.arange(s, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None])[:, None, None]


def structured_mask(kind, length, s):
    """The boolean masks models build: key padding (one sequence full length, one of a single key),
    causal (L, S) `ones(L, S).tril()`, and both (B, 1, L, S)."""
    causal = torch.ones(length, s, dtype=torch.bool, device="cuda").tril()
    padding = key_padding([s, s // 2 + 3, 1], s)
    return {"padding": padding, "causal": causal, "padding_causal": padding & causal}[kind]


MASKS = [("padding", 128, 128), ("padding", 96, 160), ("causal", 128, 128), ("causal", 96, 160),
         ("padding_causal", 128, 128), ("padding_causal", 96, 160)]
MASK_IDS = [f"{kind}-L{length}-S{s}" for kind, length, s in MASKS]


@pytest.mark.parametrize("kind, length, s, dtype", [(*m, BF16 if m[1] == m[2] else FP16) for m in MASKS],
                         ids=[f"{i}-{'bf16' if m[1] == m[2] else 'fp16'}" for i, m in zip(MASK_IDS, MASKS)])
def test_boolean_masks_models_build_run_fused(kind, length, s, dtype, decisions):
    q, k, v = bhsd_inputs(B_MASK, H_MASK, H_MASK, length, s, D_MASK, dtype, seed=length * s)
    check_against_float64(q, k, v, attn_mask=structured_mask(kind, length, s))
    assert_ran_on(decisions())


@pytest.mark.parametrize("kind, length, s", MASKS, ids=MASK_IDS)
def test_boolean_masks_models_build_become_native_masks(kind, length, s, decisions):
    """Recognized as mask=padding / causal / padding_causal, with no bias tensor left to read."""
    q, k, v = bhsd_inputs(B_MASK, H_MASK, H_MASK, length, s, D_MASK, BF16, seed=length * s)
    q.requires_grad_(True)
    fat.scaled_dot_product_attention(q, k, v, attn_mask=structured_mask(kind, length, s)).sum().backward()
    found = decisions()
    assert found, "no selection decision was logged"
    for decision in found:
        assert summary_mask(decision.summary) == kind and "bias=" not in decision.summary, (
            f"a {kind} boolean mask ran as: {decision.summary} -> {decision.backend}; expected mask={kind} and no bias")


def random_mask(shape, seed):
    """A boolean mask with no structure (not a prefix, not causal); every query row keeps key 0."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    mask = torch.rand(shape, generator=gen, device="cuda") < 0.6
    mask[..., 0] = True
    return mask


@pytest.mark.parametrize("shape", [(B_MASK, H_MASK, 128, 160), (128, 160)], ids=["BHLS", "LS"])
def test_random_boolean_mask_runs_as_a_bias(shape, decisions):
    q, k, v = bhsd_inputs(B_MASK, H_MASK, H_MASK, 128, 160, D_MASK, BF16, seed=5)
    check_against_float64(q, k, v, attn_mask=random_mask(shape, seed=6))
    found = decisions()
    assert_ran_on(found)
    assert all("bias=" in d.summary and summary_mask(d.summary) == "none" for d in found), (
        "a random boolean mask should run as an additive bias: " + "; ".join(d.summary for d in found))


@pytest.mark.parametrize("mask_dtype", [BF16, F32], ids=["bf16-mask", "fp32-mask"])
@pytest.mark.parametrize("shape", [(B_MASK, 1, 128, 160), (1, H_MASK, 128, 160)], ids=["B1LS", "1HLS"])
def test_float_mask_runs_as_a_bias_with_its_gradient(shape, mask_dtype, decisions):
    """PyTorch takes a float mask in the query's dtype or in float32 (what nn.MultiheadAttention passes
    under autocast: it builds masks in the layer input's dtype)."""
    q, k, v = bhsd_inputs(B_MASK, H_MASK, H_MASK, 128, 160, D_MASK, BF16, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(8)
    mask = torch.randn(shape, generator=gen, device="cuda").to(mask_dtype)
    check_against_float64(q, k, v, attn_mask=mask, mask_grad=True)
    found = decisions()
    assert_ran_on(found)
    assert all("bias=" in d.summary for d in found), "; ".join(d.summary for d in found)


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_is_causal_beside_a_mask_applies_both_on_cudnn(kind, decisions):
    """It was refused; both apply now (PyTorch 2.13's CPU kernel's meaning), on cuDNN, the float mask's
    gradient too."""
    q, k, v = bhsd_inputs(2, H_MASK, H_MASK, 96, 160, D_MASK, BF16, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(10)
    mask = (key_padding([160, 70], 160) if kind == "bool"
            else 0.5 * torch.randn(2, 1, 96, 160, generator=gen, device="cuda"))
    check_against_float64(q, k, v, attn_mask=mask, mask_grad=kind == "float", is_causal=True)
    assert_ran_on(decisions())


# ------------------------------------------------------------------ 3: no fused backend: say why, stay right

CANNOT = [  # (id, dtype, D, the words cuDNN's reason must contain); both are cheap rules, certain anywhere
    ("float32", F32, 64, "cudnn: dtype float32 not supported"),
    ("d320", BF16, 320, "cudnn: head_dim_qk=320 > 256"),
]


@pytest.mark.parametrize("dtype, d, reason", [c[1:] for c in CANNOT], ids=[c[0] for c in CANNOT])
def test_a_call_no_fused_backend_runs_says_why_and_is_right(dtype, d, reason, decisions, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # float32 means float32 here
    q, k, v = bhsd_inputs(2, 4, 4, 96, 128, d, dtype, seed=d)
    with pytest.warns(RuntimeWarning, match="no fused backend supports this call") as caught:
        if dtype == F32:
            _check_float32_against_float64(q, k, v, is_causal=True)
        else:
            check_against_float64(q, k, v, is_causal=True)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert any(reason in m and "small_seq: " in m for m in messages), (
        f"expected a warning naming each backend's reason ({reason!r}), got: {messages}")
    assert_ran_on(decisions(), "reference")


def _check_float32_against_float64(q, k, v, **options):
    """The error rule with a float32 floor: the reference computes in float32 as PyTorch's SDPA does."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    grad_out = torch.randn((*q.shape[:-1], v.shape[-1]), generator=gen, device="cuda")
    ours = _forward_backward(fat.scaled_dot_product_attention, q, k, v, grad_out, **options)
    same = _forward_backward(TORCH_SDPA, q, k, v, grad_out, **options)
    exact = _forward_backward(exact_sdpa, q.double(), k.double(), v.double(), grad_out.double(), **options)
    for name, got, s, e in zip(("out", "dq", "dk", "dv"), ours, same, exact):
        err = (got.double() - e).abs().max().item()
        ref_err = (s.double() - e).abs().max().item()
        limit = FACTOR * ref_err + 1e-5 * max(e.abs().max().item(), 1.0)
        assert err <= limit, f"{name}: error {err:.3e} > {limit:.3e} (PyTorch SDPA's own error {ref_err:.3e})"


# ------------------------------------------------------------------ 4: the JAX drop-in

@pytest.fixture
def jax_gpu():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (jax.default_backend() is {jax.default_backend()!r})")
    return jax


def _as_float64_tensor(x):
    return torch.from_numpy(np.asarray(x).astype(np.float64))


def _jax_outputs(jax, fn, q, k, v, cotangent, **kwargs):
    """(out, dq, dk, dv) of fn under jax.jit and jax.grad, for the loss sum(out * cotangent)."""
    import jax.numpy as jnp

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, **kwargs).astype(jnp.float32) * cotangent)

    out = jax.jit(lambda q, k, v: fn(q, k, v, **kwargs))(q, k, v)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    return (out, *grads)


def _jax_nn_on_cpu(jax, q, k, v, cotangent, **kwargs):
    """(out, dq, dk, dv) of jax.nn.dot_product_attention(implementation="xla") on the CPU, in the inputs'
    dtype, for the same cotangent: XLA's CPU compiler is quick, and its float32 is float32 (no TF32)."""
    cpu = jax.devices("cpu")[0]
    q, k, v, cotangent = jax.device_put((q, k, v, cotangent), cpu)
    kwargs = {name: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x for name, x in kwargs.items()}

    @jax.jit
    def outputs(q, k, v):
        out, pull = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs),
                            q, k, v)
        return (out, *pull(cotangent.astype(out.dtype)))

    return outputs(q, k, v)


def jax_inputs(jax, b, t, s, n, kv_heads, h, seed):
    """bf16 query (B, T, N, H), key and value (B, S, K, H), and a bf16-representable float32 cotangent."""
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 4)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    q, k, v = normal(keys[0], (b, t, n, h)), normal(keys[1], (b, s, kv_heads, h)), normal(keys[2], (b, s, kv_heads, h))
    return q, k, v, normal(keys[3], (b, t, n, h)).astype(jnp.float32)


def jax_kwargs(options):
    import jax.numpy as jnp

    return {name: jnp.array(value, jnp.int32) if name.endswith("_lengths") else value
            for name, value in options.items()}


def check_jax_against_float32(jax, q, k, v, cotangent, implementation=None, **kwargs):
    """Ours (on the GPU) against jax.nn's XLA math in float32, within the error rule whose yardstick is
    jax.nn's XLA math in bfloat16 (both on the CPU); returns our (out, dq, dk, dv)."""
    import jax.numpy as jnp

    import fusedattn.jax as fj

    ours = _jax_outputs(jax, fj.dot_product_attention, q, k, v, cotangent, implementation=implementation, **kwargs)
    assert all(d.platform == "gpu" for d in ours[0].devices()), ours[0].devices()
    same = _jax_nn_on_cpu(jax, q, k, v, cotangent, **kwargs)
    exact = _jax_nn_on_cpu(jax, *(x.astype(jnp.float32) for x in (q, k, v)), cotangent, **kwargs)
    for name, got, s, e in zip(("out", "dq", "dk", "dv"), ours, same, exact):
        assert got.shape == e.shape and got.dtype == q.dtype, f"{name}: {got.shape} {got.dtype}"
        got, s, e = (_as_float64_tensor(x) for x in (got, s, e))
        assert torch.isfinite(got).all(), f"{name}: not finite"
        assert e.abs().max() > 0, f"{name}: the float32 result is all zeros: the comparison would prove nothing"
        assert_close_to_exact(name, got, s, e)
    return ours


JAX_CASES = [  # (id, T, S, N, K, keywords); lengths as tuples, made int32 arrays
    ("causal", 128, 128, 8, 8, {"is_causal": True}),
    ("lengths", 128, 192, 8, 8, {"query_seq_lengths": (128, 77), "key_value_seq_lengths": (192, 50)}),
    ("lengths-causal", 128, 128, 8, 8, {"query_seq_lengths": (100, 128), "key_value_seq_lengths": (128, 60),
                                        "is_causal": True}),
    ("gqa", 128, 128, 8, 2, {}),
    ("gqa-causal", 128, 128, 8, 2, {"is_causal": True}),
    ("window-causal", 256, 256, 8, 8, {"is_causal": True, "local_window_size": (32, 0)}),
    ("window-left", 256, 256, 8, 2, {"local_window_size": (48, 0)}),
    ("window-two-sided", 256, 256, 8, 8, {"local_window_size": (32, 32)}),
]


@pytest.mark.parametrize("t, s, n, kv_heads, options", [c[1:] for c in JAX_CASES], ids=[c[0] for c in JAX_CASES])
def test_jax_dropin_runs_on_cudnn_under_jit_and_grad(t, s, n, kv_heads, options, jax_gpu, decisions):
    q, k, v, cotangent = jax_inputs(jax_gpu, 2, t, s, n, kv_heads, 64, seed=t + s + kv_heads)
    check_jax_against_float32(jax_gpu, q, k, v, cotangent, **jax_kwargs(options))
    assert_ran_on(decisions())


def test_jax_dropin_with_implementation_cudnn_forced(jax_gpu, decisions):
    q, k, v, cotangent = jax_inputs(jax_gpu, 2, 128, 192, 8, 2, 64, seed=3)
    kwargs = jax_kwargs({"is_causal": True, "key_value_seq_lengths": (192, 70)})
    forced = check_jax_against_float32(jax_gpu, q, k, v, cotangent, implementation="cudnn", **kwargs)
    found = decisions()
    assert_ran_on(found)
    assert len(found) == 1, [d.summary for d in found]
    chosen = check_jax_against_float32(jax_gpu, q, k, v, cotangent, **kwargs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), forced, chosen):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name}: forced cudnn differs from "
                                      "the selected backend (both cudnn)")


# ------------------------------------------------------------------ 5: training

VOCAB, SEQ, WIDTH, HEADS, STEPS = 16, 32, 128, 4, 50
PAD = 8  # key padding: up to PAD tokens after the SEQ that matter


def reversal_task(seed, batch=64, pad=0):
    """A fixed batch of token sequences and their reversals: each of the first SEQ positions must find its
    mirror, by attention. With pad > 0, sequence b has b % (pad + 1) extra tokens after them (visible keys,
    no targets) and then padding up to SEQ + pad: (tokens, targets (-100: none), key padding mask or None)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (batch, SEQ + pad), generator=gen, device="cuda")
    target = torch.full_like(tokens, -100)
    target[:, :SEQ] = tokens[:, :SEQ].flip(1)
    if not pad:
        return tokens, target, None
    lengths = SEQ + torch.arange(batch, device="cuda") % (pad + 1)
    return tokens, target, torch.arange(SEQ + pad, device="cuda")[None, :] >= lengths[:, None]  # True: padding


class TinyEncoder(torch.nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(SEQ + PAD, WIDTH))
        layer = torch.nn.TransformerEncoderLayer(WIDTH, HEADS, dim_feedforward=2 * WIDTH, dropout=0.0,
                                                 batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens, key_padding=None):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.encoder(x, src_key_padding_mask=key_padding))


@pytest.mark.parametrize("pad", [0, PAD], ids=["plain", "key-padding"])
def test_transformer_encoder_trains_through_the_sdpa_dropin(pad, monkeypatch, decisions):
    """Two nn.TransformerEncoderLayers in training mode under bf16 autocast: nn.MultiheadAttention calls
    F.scaled_dot_product_attention (replaced), with src_key_padding_mask as a float mask."""
    calls = []

    def counted(query, key, value, attn_mask=None, *args, **kwargs):  # proves the layers reach the replacement
        calls.append((tuple(query.shape), None if attn_mask is None else attn_mask.dtype))
        return fat.scaled_dot_product_attention(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    torch.manual_seed(0)
    model = TinyEncoder().cuda().train()
    tokens, target, key_padding = reversal_task(seed=1, pad=pad)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for _ in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(tokens, key_padding)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert len(calls) == 2 * STEPS, f"{len(calls)} attention calls through the drop-in, expected 2 layers x {STEPS}"
    assert calls[0][0] == (tokens.shape[0], HEADS, SEQ + pad, WIDTH // HEADS), calls[0]
    assert (calls[0][1] is None) == (key_padding is None), calls[0]
    assert_ran_on(decisions())
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {STEPS} steps: {losses}"


def test_jax_attention_model_trains_through_the_dropin(jax_gpu, decisions):
    jax = jax_gpu
    import jax.numpy as jnp

    optax = pytest.importorskip("optax")
    import fusedattn.jax as fj

    keys = jax.random.split(jax.random.key(0), 8)
    dense = lambda key, fan_in, fan_out: jax.random.normal(key, (fan_in, fan_out)) / math.sqrt(fan_in)
    params = {"embed": jax.random.normal(keys[0], (VOCAB, WIDTH)), "position": jax.random.normal(keys[1], (SEQ, WIDTH)),
              "wq": dense(keys[2], WIDTH, WIDTH), "wk": dense(keys[3], WIDTH, WIDTH),
              "wv": dense(keys[4], WIDTH, WIDTH), "wo": dense(keys[5], WIDTH, WIDTH),
              "out": dense(keys[6], WIDTH, VOCAB)}
    tokens = jax.random.randint(keys[7], (64, SEQ), 0, VOCAB)
    target = tokens[:, ::-1]

    def logits_of(params, tokens):
        x = params["embed"][tokens] + params["position"]
        split = lambda w: (x @ w).reshape(*tokens.shape, HEADS, WIDTH // HEADS).astype(jnp.bfloat16)
        attended = fj.dot_product_attention(split(params["wq"]), split(params["wk"]), split(params["wv"]))
        x = x + attended.astype(jnp.float32).reshape(*tokens.shape, WIDTH) @ params["wo"]
        return x @ params["out"]

    def loss_of(params):
        return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, tokens), target).mean()

    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = optimizer.init(params)
    losses = []
    for _ in range(STEPS):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert_ran_on(decisions())
    assert all(math.isfinite(x) for x in losses), losses
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {STEPS} steps: {losses}"
