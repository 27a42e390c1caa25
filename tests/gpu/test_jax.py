"""fusedattn.jax.attention on the cuDNN backend (native custom calls; buffer callbacks into torch where
the native library is off), on a GPU.

Every feature is checked forward and through every gradient against the float64 reference,
by STYLE rule 15 (exact_rule.assert_close_to_exact: cuDNN's error within a small multiple of
the same-dtype reference's own). Both references are JAX's own reference backend, the float64 one
under jax.enable_x64 (the CPU suite pins it to the naive float64 attention), so the module runs
where torch cannot be imported (test_jax_without_torch.py runs it so); the tests that compare
with the torch path, or run the callback path through torch, skip there saying so.

Which backend ran is part of every test (STYLE 17): `cudnn_calls` records each run of the
cuDNN runner (backends/cudnn/torch_run.forward/backward) with its config, and the tests ask
for runs whose config says framework="jax". Every call forces backend="cudnn", which raises
NoBackendError rather than falling back; a call cuDNN also declines from torch is skipped
with cuDNN's reasons, one that only the JAX path declines fails.

Skipped without a GPU (conftest), without a GPU backend for JAX, or without nvidia-cudnn-frontend.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from exact_rule import as_float64, assert_close_to_exact  # noqa: E402
from flex_corpus import CORPUS as FLEX_CORPUS  # noqa: E402
from flex_corpus import jax_array  # noqa: E402
from needs_torch import HAS_TORCH, requires_torch  # noqa: E402

import fusedattn  # noqa: E402
import fusedattn.jax as fj  # noqa: E402
from fusedattn import score_mods as sm  # noqa: E402
from fusedattn.backends.base import package_missing  # noqa: E402
from fusedattn.jax import native  # noqa: E402
from fusedattn.selection import clear_decisions  # noqa: E402

if HAS_TORCH:
    import torch

    import fusedattn.torch as ft

    try:
        from naive import naive_attention
    except ImportError:  # tests/ collected as a package
        from tests.naive import naive_attention

pytestmark = pytest.mark.gpu

BF16, FP16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
FLOATING = ("bfloat16", "float16", "float32", "float64")
B, S, H, D = 2, 128, 4, 64  # the small shape most tests use


@pytest.fixture(autouse=True)
def _jax_gpu_and_cudnn(monkeypatch):
    """Skip unless JAX runs on the GPU and cuDNN's frontend is installed; fresh selection decisions."""
    if jax.default_backend() != "gpu":
        pytest.skip(f"JAX has no GPU backend here (jax.default_backend() is {jax.default_backend()!r})")
    if package_missing("cudnn"):
        pytest.skip("package nvidia-cudnn-frontend not installed (import cudnn)")
    monkeypatch.delenv("FUSEDATTN_BACKEND", raising=False)
    clear_decisions()
    yield
    clear_decisions()


class _Calls(list):
    """(phase, cfg) of cuDNN runs; .lean lists the phases that ran from raw addresses, .native the
    passes compiled into native custom calls (recorded when traced: they run without Python)."""

    def __init__(self):
        super().__init__()
        self.lean = []
        self.native = []
        self.runners = []  # the AddressRunners that ran, to look at how they launch


@pytest.fixture
def cudnn_calls(monkeypatch):
    """(phase, cfg) of every run of the cuDNN runner, whichever path reached it (torch or JAX)."""
    calls = _Calls()
    from fusedattn.jax import cudnn_call

    def native_spy(cfg, direction, *args, _original=cudnn_call._launch):  # traced once per pass
        got = _original(cfg, direction, *args)
        calls.append((direction, cfg))
        calls.native.append(direction)
        return got

    monkeypatch.setattr(cudnn_call, "_launch", native_spy)
    if HAS_TORCH:
        _spy_on_torch_runners(monkeypatch, calls)
    return calls


def _spy_on_torch_runners(monkeypatch, calls: _Calls) -> None:
    """The runners torch reaches cuDNN through (and JAX's callback path, with the native call off)."""
    from fusedattn.backends.cudnn import pointer_run, torch_run

    for phase in ("forward", "backward"):
        original = getattr(torch_run, phase)

        def spy(cfg, *args, _original=original, _phase=phase, **kwargs):
            calls.append((_phase, cfg))
            return _original(cfg, *args, **kwargs)

        monkeypatch.setattr(torch_run, phase, spy)

    def lean_spy(runner, direction, *args, _original=pointer_run.AddressRunner.__call__):  # the raw-address path
        calls.append((direction, runner.cfg))
        calls.lean.append(direction)
        calls.runners.append(runner)
        return _original(runner, direction, *args)

    monkeypatch.setattr(pointer_run.AddressRunner, "__call__", lean_spy)

    from fusedattn.torch import functional  # torch calls on the native operator skip torch_run

    def torch_native_spy(plan, signature, planned, *args, _original=functional._native_call, **kwargs):
        calls.append(("forward", planned[0]))
        return _original(plan, signature, planned, *args, **kwargs)

    monkeypatch.setattr(functional, "_native_call", torch_native_spy)


def assert_cudnn_ran(calls, phases=("forward", "backward")):
    """cuDNN ran each phase for a JAX call (call after the results are on the host: JAX is asynchronous)."""
    seen = {phase for phase, cfg in calls if cfg.framework == "jax"}
    assert set(phases) <= seen, (f"cuDNN runs from JAX: {sorted(seen)}, expected {list(phases)} "
                                 f"(all runs: {[(p, c.framework) for p, c in calls]})")


# ----------------------------------------------------------------------------- inputs

def normal(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(scale)


def cumulative(lengths, gaps: int = 0) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(np.asarray(lengths) + gaps)]).astype(np.int32)


def to_torch(x):
    """A JAX array as a torch CUDA tensor with the same values and dtype (tests that compare with torch)."""
    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    name = str(x.dtype)
    values = np.asarray(x)
    if name in FLOATING:
        return torch.from_numpy(values.astype(np.float32)).to(dtypes.get(name, torch.float64)).cuda()
    return torch.from_numpy(np.array(values)).cuda()


def jax_inputs(arrays: dict, options: dict, dtype) -> tuple[dict, dict]:
    """NumPy float32 inputs as JAX arrays of the I/O dtype (the sink stays float32), offsets as int32."""
    jarrays = {n: jnp.asarray(x, dtype=F32 if n == "sink" else dtype) for n, x in arrays.items()}
    joptions = {n: jnp.asarray(v) if isinstance(v, np.ndarray) else v for n, v in options.items()}
    return jarrays, joptions


# ----------------------------------------------------------------------------- runs

def jax_cudnn(arrays: dict, options: dict, g, *, jit: bool = True):
    """(out, lse, {name: gradient}) of fusedattn.jax.attention(backend="cudnn"), pulled back from g.

    Only out is differentiated (lse is an aux output): cuDNN has no gradient through lse.
    """
    names = tuple(arrays)

    def attend(*xs):
        result = fj.attention(**dict(zip(names, xs)), **options, backend="cudnn", return_lse=True)
        return result.out, result.lse

    def run(xs, g):
        out, pullback, lse = jax.vjp(attend, *xs, has_aux=True)
        return out, lse, pullback(g)

    out, lse, grads = (jax.jit(run) if jit else run)(tuple(arrays.values()), g)
    return out, lse, dict(zip(names, grads))


def _widened(value):
    """A float array (or a dict of them, as score_mod_tensors) in float64: call inside jax.enable_x64."""
    if isinstance(value, dict):
        return {n: _widened(v) for n, v in value.items()}
    if isinstance(value, (jax.Array, np.ndarray)) and jnp.issubdtype(value.dtype, jnp.floating):
        return jnp.asarray(as_float64(value))
    return value


def jax_reference(arrays: dict, options: dict, g, *, wide: bool = False):
    """(out, lse, {name: gradient}) of JAX's reference backend, pulled back from g; wide=True computes
    in float64 (jax.enable_x64), else in the arrays' own dtypes. Compare them through as_float64."""
    def run(arrays, options, g):
        names = tuple(arrays)

        def attend(*xs):
            result = fj.attention(**dict(zip(names, xs)), **options, backend="reference", return_lse=True)
            return result.out, result.lse

        out, pullback, lse = jax.vjp(attend, *arrays.values(), has_aux=True)
        return out, lse, dict(zip(names, pullback(jnp.asarray(g, out.dtype))))

    if not wide:  # jitted, the options closed over (concrete offsets stay concrete): one compile, not one per op
        return jax.jit(lambda arrays, g: run(arrays, options, g))(arrays, g)
    with jax.enable_x64(True):
        wide_options = _widened(options)
        return jax.jit(lambda arrays, g: run(arrays, wide_options, g))(_widened(arrays), _widened(g))


def declined(error, arrays: dict, options: dict):
    """JAX's call on cudnn raised NoBackendError: skip with cuDNN's reasons when the same call from
    torch is declined too (a cuDNN limit, which the torch tests skip as well); otherwise fail. Where
    torch cannot be imported the cross-check cannot run: skip, saying so (the full run makes it)."""
    reason = str(error).splitlines()[-1].strip()
    if not HAS_TORCH:
        pytest.skip(f"cudnn declines this call from JAX ({reason}); needs torch to check it declines it from torch too")
    tensors = {n: to_torch(x) for n, x in arrays.items()}
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in tensors.items()}
    try:
        ft.attention(**leaves, **_torch_options(options), backend="cudnn")
    except fusedattn.NoBackendError as torch_error:
        pytest.skip("cudnn declines this call from torch too: " + str(torch_error).splitlines()[-1].strip())
    pytest.fail(f"cudnn runs this call from torch but declined it from JAX:\n{error}")


def _torch_options(options: dict) -> dict:
    """The call's keywords with JAX arrays (also inside score_mod_tensors) as torch tensors."""
    def convert(value):
        if isinstance(value, jax.Array):
            return to_torch(value)
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return {name: convert(value) for name, value in options.items()}


def compare(got, same, exact, names):
    """The JAX cuDNN results (out, lse, grads) against the same-dtype and float64 references."""
    out, lse, grads = got
    out = as_float64(out)
    assert np.isfinite(out).all(), "non-finite values in out"
    assert_close_to_exact("out", out, same[0], exact[0])
    lse, exact_lse = as_float64(lse), as_float64(exact[1])
    finite = np.isfinite(exact_lse)
    assert lse.shape == exact_lse.shape, (lse.shape, exact_lse.shape)
    np.testing.assert_allclose(lse[finite], exact_lse[finite], atol=2e-2, rtol=2e-3)
    for name in names:
        grad = grads[name]
        assert grad is not None and tuple(grad.shape) == tuple(exact[2][name].shape), name
        assert_close_to_exact(f"d{name}", as_float64(grad), same[2][name], exact[2][name],
                              reduction=name in ("bias", "sink"))


def check(calls, arrays: dict, options: dict, dtype=BF16, *, jit: bool = True, seed: int = 0):
    """Forward, lse and every gradient of the JAX cuDNN call against the references; cuDNN ran."""
    jarrays, joptions = jax_inputs(arrays, options, dtype)
    probe = jax.eval_shape(lambda: fj.attention(**jarrays, **joptions, backend="reference"))
    g = jnp.asarray(normal(seed + 101, probe.shape), dtype=probe.dtype)
    same = jax_reference(jarrays, joptions, g)
    exact = jax_reference(jarrays, joptions, g, wide=True)
    try:
        got = jax_cudnn(jarrays, joptions, g, jit=jit)
    except fusedattn.NoBackendError as error:
        declined(error, jarrays, joptions)
    assert got[0].dtype == probe.dtype and got[1].dtype == F32, (got[0].dtype, got[1].dtype)
    assert all(got[2][n].dtype == x.dtype for n, x in jarrays.items()), {n: g.dtype for n, g in got[2].items()}
    compare(got, same, exact, list(jarrays))
    assert_cudnn_ran(calls)
    return got


# ----------------------------------------------------------------------------- the dense feature list

def qkv(seed: int, *, b=B, sq=S, skv=None, hq=H, hkv=2, d=D, dv=None, scale_q=1.0):
    """NumPy float32 q, k, v in bshd."""
    skv = sq if skv is None else skv
    dv = d if dv is None else dv
    return (normal(seed, (b, sq, hq, d), scale_q), normal(seed + 1, (b, skv, hkv, d)),
            normal(seed + 2, (b, skv, hkv, dv)))


def packed(layout: str, q, k, v) -> dict:
    """The arrays a layout takes, from bshd q, k, v."""
    if layout == "bshd":
        return {"q": q, "k": k, "v": v}
    if layout == "sbhd":
        return {n: x.transpose(1, 0, 2, 3) for n, x in (("q", q), ("k", k), ("v", v))}
    if layout == "bhsd":
        return {n: x.transpose(0, 2, 1, 3) for n, x in (("q", q), ("k", k), ("v", v))}
    if layout == "bs3hd":
        return {"q": np.stack([q, k, v], axis=2)}
    if layout == "bshd_bs2hd":
        return {"q": q, "k": np.stack([k, v], axis=2)}
    raise ValueError(layout)


def layout_case(layout: str, mask: str, seed: int):
    packed_all = layout == "bs3hd"  # one packed tensor: Sq == Skv and Hq == Hkv
    q, k, v = qkv(seed, skv=S if packed_all else 192, hkv=H if packed_all else 2)
    return packed(layout, q, k, v), {"layout": layout, "mask": mask}


def alignment_case(mask: str, sq: int, skv: int, seed: int):
    q, k, v = qkv(seed, sq=sq, skv=skv, hkv=H)
    return {"q": q, "k": k, "v": v}, {"mask": mask}


PADDED_LENS = {"q": [100, 37, 128], "kv": [128, 64, 90]}


def padding_case(mask: str, seed: int):
    q, k, v = qkv(seed, b=3)
    return {"q": q, "k": k, "v": v}, {"mask": mask, "cu_seqlens_q": cumulative(PADDED_LENS["q"]),
                                      "cu_seqlens_kv": cumulative(PADDED_LENS["kv"])}


def thd_case(seed: int, gaps: bool):
    """THD with sequences of different lengths; gaps=True: 8 unused tokens after each (padded offsets)."""
    if gaps:
        lens_q = lens_kv = [60, 17, 128]
        hkv, gap = H, 8
    else:
        lens_q, lens_kv = [100, 37, 128, 5], [128, 64, 90, 7]
        hkv, gap = 2, 0
    tq, tkv = sum(lens_q) + gap * len(lens_q), sum(lens_kv) + gap * len(lens_kv)
    arrays = {"q": normal(seed, (tq, H, D)), "k": normal(seed + 1, (tkv, hkv, D)),
              "v": normal(seed + 2, (tkv, hkv, D))}
    options = {"layout": "thd", "mask": "padding_causal", "cu_seqlens_q": cumulative(lens_q),
               "cu_seqlens_kv": cumulative(lens_kv)}
    if gaps:
        options.update(cu_seqlens_q_padded=cumulative(lens_q, gap), cu_seqlens_kv_padded=cumulative(lens_kv, gap))
    return arrays, options


def empty_sequences_case(layout: str, seed: int):
    """Sequences without queries or without keys, with learnable sinks: rows outside every sequence, and
    queries whose sequence has no keys (output 0, the sink's LSE), which the call's own fix-ups write."""
    lens_q, lens_kv = [60, 0, 17, 33], [30, 12, 0, 40]
    options = {"layout": layout, "mask": "padding", "softmax_type": "learnable",
               "cu_seqlens_q": cumulative(lens_q), "cu_seqlens_kv": cumulative(lens_kv)}
    sink = normal(seed + 6, (H,))
    if layout == "thd":
        tq, tkv = sum(lens_q) + 5, sum(lens_kv) + 3  # tokens after the last sequence too
        return {"q": normal(seed, (tq, H, D)), "k": normal(seed + 1, (tkv, 2, D)), "v": normal(seed + 2, (tkv, 2, D)),
                "sink": sink}, options
    q, k, v = qkv(seed, b=4, sq=64, skv=48)
    return {"q": q, "k": k, "v": v, "sink": sink}, options


def scored(case, **options):
    arrays, given = case
    return arrays, {**given, **options, "score_mod": sm.softcap(2.0)}


def bias_case(shape, seed: int):
    q, k, v = qkv(seed)
    return {"q": q, "k": k, "v": v, "bias": normal(seed + 5, shape)}, {"mask": "none"}


def sink_case(mask: str, seed: int):
    q, k, v = qkv(seed, hkv=H)
    return {"q": q, "k": k, "v": v, "sink": normal(seed + 6, (H,))}, {"mask": mask, "softmax_type": "learnable"}


FEATURES = {
    **{f"{layout}-{mask}": (lambda seed, layout=layout, mask=mask: layout_case(layout, mask, seed))
       for layout in ("bshd", "sbhd", "bhsd", "bs3hd", "bshd_bs2hd") for mask in ("none", "causal")},
    "causal-96x160": lambda seed: alignment_case("causal", 96, 160, seed),
    "causal_bottom_right-96x160": lambda seed: alignment_case("causal_bottom_right", 96, 160, seed),
    "causal_bottom_right-160x96": lambda seed: alignment_case("causal_bottom_right", 160, 96, seed),
    "padding": lambda seed: padding_case("padding", seed),
    "padding_causal": lambda seed: padding_case("padding_causal", seed),
    "padding_causal_bottom_right": lambda seed: padding_case("padding_causal_bottom_right", seed),
    "thd": lambda seed: thd_case(seed, gaps=False),
    "thd-padded_offsets": lambda seed: thd_case(seed, gaps=True),
    "padding-empty_sequences-sink": lambda seed: empty_sequences_case("bshd", seed),
    "thd-empty_sequences-sink": lambda seed: empty_sequences_case("thd", seed),
    "window-causal-32": lambda seed: ({n: x for n, x in zip("qkv", qkv(seed))}, {"mask": "causal", "window": (32, 0)}),
    "window-16-16": lambda seed: ({n: x for n, x in zip("qkv", qkv(seed))}, {"mask": "none", "window": (16, 16)}),
    "bias-1HSS": lambda seed: bias_case((1, H, S, S), seed),
    "bias-B1SS": lambda seed: bias_case((B, 1, S, S), seed),
    "mqa": lambda seed: ({n: x for n, x in zip("qkv", qkv(seed, hkv=1))}, {"mask": "causal"}),
    "gqa-d128": lambda seed: ({n: x for n, x in zip("qkv", qkv(seed, hq=8, hkv=2, d=128))}, {"mask": "causal"}),
    "sink-learnable-none": lambda seed: sink_case("none", seed),
    "sink-learnable-causal": lambda seed: sink_case("causal", seed),
    "d128-s1024": lambda seed: ({n: x for n, x in zip("qkv", qkv(seed, sq=1024, d=128))}, {"mask": "causal"}),
    # a score_mod's padding as penalties; the window leaves the last 30 queries of the third sequence keyless
    "padding_causal-window-softcap": lambda seed: scored(padding_case("padding_causal", seed), window=(8, 0)),
    "thd-softcap": lambda seed: scored(thd_case(seed, gaps=False)),
}
FP16_FEATURES = ("bshd-none", "bshd-causal", "bs3hd-causal", "thd", "bias-1HSS")
FEATURE_CASES = ([pytest.param(name, BF16, id=f"{name}-bf16") for name in FEATURES]
                 + [pytest.param(name, FP16, id=f"{name}-fp16") for name in FP16_FEATURES])


@pytest.mark.parametrize("name,dtype", FEATURE_CASES)
def test_features_forward_lse_and_gradients(cudnn_calls, name, dtype):
    seed = 1000 + 10 * list(FEATURES).index(name)
    arrays, options = FEATURES[name](seed)
    check(cudnn_calls, arrays, options, dtype, seed=seed)


# (THD with a learnable sink: cuDNN 9.19 declines its backward, the features test skips it saying so)
@pytest.mark.parametrize("name", ["padding", "thd-padded_offsets", "padding-empty_sequences-sink"])
def test_padded_and_thd_passes_fix_their_rows_inside_the_custom_call(cudnn_calls, name):
    """The call's own kernels (jax/sequence_steps.py) build the sequence table and fix the rows cuDNN leaves:
    the compiled program holds the custom calls and no select over a whole output or gradient."""
    arrays, options = FEATURES[name](7)
    jarrays, joptions = jax_inputs(arrays, options, BF16)
    names = list(jarrays)

    def loss(*values):
        out = fj.attention(**dict(zip(names, values)), **joptions, backend="cudnn")
        return out.astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*jarrays.values()).as_text()
    calls = [line for line in text.splitlines() if native.TARGET in line]
    keys = [re.search(r"kernels_key = (-?\d+)", line) for line in calls]
    assert len(calls) == 2 and all(key and key.group(1) != "0" for key in keys), [line[:300] for line in calls]
    shapes = {"x".join(map(str, jarrays[name].shape)) + "x" for name in ("q", "k", "v")}
    # no select (jax.numpy row fixes) and no multiply (the frontend's NaN-or-one offset factor: the call checks
    # its offsets itself) over a whole output or gradient
    whole = [line[:200] for line in text.splitlines()
             if ("stablehlo.select" in line or "stablehlo.multiply" in line)
             and any(f"tensor<{shape}" in line for shape in shapes)]
    assert not whole, whole


def _cumulative(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


BROKEN_OFFSETS = {"not-from-zero": [1, 100, 228], "too-long": [0, 129, 200], "negative": [0, 100, 60]}


@pytest.mark.parametrize("broken", sorted(BROKEN_OFFSETS))
def test_broken_traced_offsets_give_nan_in_every_output_and_gradient_of_a_padded_cudnn_call(broken):
    """A padded call that checks its offsets inside the custom call (cudnn_call.checks_offsets): broken traced
    offsets give NaN in the output, the LSE and the gradients of q, k, v and a learnable sink (a bias's: the
    CPU test with the kernels in Triton's interpreter); good ones match the concrete call. Under vmap
    (outside and inside jit) only the broken item is NaN."""
    q, k, v = (jnp.asarray(x, BF16) for x in qkv(31, hkv=H))
    sink = jnp.asarray(normal(33, (H,)), F32)

    def call(q, k, v, sink, cu):
        return fj.attention(q, k, v, mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu, sink=sink,
                            softmax_type="learnable", return_lse=True, backend="cudnn")

    def loss(*xs):
        return call(*xs).out.astype(F32).sum()

    bad, good = jnp.asarray(BROKEN_OFFSETS[broken], jnp.int32), jnp.asarray(_cumulative([100, 90]), jnp.int32)
    result = jax.jit(call)(q, k, v, sink, bad)
    assert np.isnan(np.asarray(result.out, np.float32)).all() and np.isnan(np.asarray(result.lse)).all()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, sink, bad)
    for name, grad in zip(("q", "k", "v", "sink"), grads):
        assert np.isnan(np.asarray(grad, np.float32)).all(), name
    traced = jax.jit(call)(q, k, v, sink, good).out
    concrete = call(q, k, v, sink, np.asarray(good)).out
    same = lambda got, want: np.testing.assert_allclose(  # noqa: E731  (other graphs: bf16 rounding apart)
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    same(traced, concrete)
    assert not np.isnan(np.asarray(traced, np.float32)).any()
    cus = jnp.stack([good, bad, good])
    stacked = [jnp.stack([x, x * 0.5, x]) for x in (q, k, v)]
    for step in (jax.jit(jax.vmap(lambda q, k, v, cu: call(q, k, v, sink, cu).out)),
                 jax.vmap(jax.jit(lambda q, k, v, cu: call(q, k, v, sink, cu).out))):
        out = np.asarray(step(*stacked, cus), np.float32)
        assert np.isnan(out[1]).all(), "the broken item"
        same(out[0], traced)
        same(out[2], traced)


@pytest.mark.parametrize("cu", [[0, 60, 100, 257], [2, 60, 100, 256], [0, 60, 40, 256]],
                         ids=["past-the-tokens", "not-from-zero", "negative"])
def test_broken_traced_thd_offsets_give_nan_in_the_output_and_gradients_on_cudnn(cu):
    tokens = 256
    q, k, v = (jnp.asarray(normal(40 + i, (tokens, H, D)), BF16) for i in range(3))

    def call(q, k, v, cu):
        return fj.attention(q, k, v, layout="thd", mask="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            max_seqlen_q=160, max_seqlen_kv=160, return_lse=True, backend="cudnn")

    cu = jnp.asarray(cu, jnp.int32)
    result = jax.jit(call)(q, k, v, cu)
    assert np.isnan(np.asarray(result.out, np.float32)).all() and np.isnan(np.asarray(result.lse)).all()
    grads = jax.jit(jax.grad(lambda *xs: call(*xs).out.astype(F32).sum(), argnums=(0, 1, 2)))(q, k, v, cu)
    for name, grad in zip("qkv", grads):
        assert np.isnan(np.asarray(grad, np.float32)).all(), name


def test_eager_call_with_bias_and_sink(cudnn_calls):
    """Outside jit (op by op), with the extra differentiable inputs."""
    q, k, v = qkv(7, hkv=H)
    arrays = {"q": q, "k": k, "v": v, "bias": normal(8, (1, H, S, S)), "sink": normal(9, (H,))}
    check(cudnn_calls, arrays, {"mask": "causal", "softmax_type": "learnable"}, jit=False, seed=7)


# ----------------------------------------------------------------------------- transformations

def _grad_fn(options, g):
    """(q, k, v) -> (out, (dq, dk, dv)) on cudnn for the cotangent g."""
    def run(q, k, v):
        out, pullback = jax.vjp(lambda q, k, v: fj.attention(q, k, v, **options, backend="cudnn"), q, k, v)
        return out, pullback(g)

    return run


def _bf16(*arrays):
    return tuple(jnp.asarray(x, dtype=BF16) for x in arrays)


def assert_equal(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    mismatch = int((got != want).sum())
    assert mismatch == 0, f"{what}: {mismatch} of {got.size} values differ"


def assert_near(got, want, what, ulps: float = 2e-2):
    """Equal up to a few bf16 roundings (different accumulation orders), relative to the magnitude."""
    got, want = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(got - want).max())
    assert err <= ulps * scale, f"{what}: max difference {err:.3e} > {ulps * scale:.3e}"


def test_deterministic_backward_is_bitwise_repeatable(cudnn_calls):
    q, k, v = _bf16(*qkv(20, sq=256, hq=8, hkv=2))
    g = jnp.asarray(normal(21, q.shape), BF16)
    run = jax.jit(_grad_fn({"mask": "causal", "deterministic": True}, g))
    out_a, grads_a = run(q, k, v)
    out_b, grads_b = run(q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out_a, *grads_a), (out_b, *grads_b)):
        assert_equal(a, b, name)
    assert_cudnn_ran(cudnn_calls)
    assert all(cfg.deterministic for _, cfg in cudnn_calls if cfg.framework == "jax")


def test_eager_and_jit_agree_bitwise(cudnn_calls):
    q, k, v = _bf16(*qkv(30))
    g = jnp.asarray(normal(31, q.shape), BF16)
    run = _grad_fn({"mask": "causal", "deterministic": True}, g)
    eager_out, eager_grads = run(q, k, v)
    jit_out, jit_grads = jax.jit(run)(q, k, v)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (jit_out, *jit_grads), (eager_out, *eager_grads)):
        assert_equal(a, b, name)
    assert_cudnn_ran(cudnn_calls)


@pytest.mark.parametrize("order", ["jit_of_vmap", "vmap_of_jit"])
@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None)], ids=["all_batched", "q_batched"])
def test_vmap_over_a_leading_axis_matches_a_loop(cudnn_calls, in_axes, order):
    n = 3
    lead = lambda axis: (n,) if axis == 0 else ()  # noqa: E731
    q = jnp.asarray(normal(40, (n, B, S, H, D)), BF16)
    k = jnp.asarray(normal(41, (*lead(in_axes[1]), B, S, 2, D)), BF16)
    v = jnp.asarray(normal(42, (*lead(in_axes[2]), B, S, 2, D)), BF16)
    g = jnp.asarray(normal(43, (n, B, S, H, D)), BF16)

    def one(q, k, v, g):
        return _grad_fn({"mask": "causal"}, g)(q, k, v)

    vmapped = jax.vmap(one, in_axes=(*in_axes, 0))
    if order == "vmap_of_jit":  # the jitted trace saw no vmap tracer: the shard check's op is batched later
        vmapped = jax.vmap(jax.jit(one), in_axes=(*in_axes, 0))
    out_v, grads_v = (jax.jit(vmapped) if order == "jit_of_vmap" else vmapped)(q, k, v, g)
    single = jax.jit(one)
    for i in range(n):
        k_i, v_i = (k[i] if in_axes[1] == 0 else k), (v[i] if in_axes[2] == 0 else v)
        out_i, grads_i = single(q[i], k_i, v_i, g[i])
        assert_near(out_v[i], out_i, f"out[{i}]")
        for name, got, want in zip(("dq", "dk", "dv"), grads_v, grads_i):
            assert_near(got[i], want, f"{name}[{i}]")
    assert_cudnn_ran(cudnn_calls)


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_checkpoint_gives_the_same_gradients(cudnn_calls, dropout):
    """jax.checkpoint recomputes the forward in the backward pass: the same out (and, with dropout,
    the same mask from the same key), so the same gradients."""
    q, k, v = _bf16(*qkv(50))
    g = jnp.asarray(normal(51, q.shape), F32)
    options = {"mask": "causal", "deterministic": not dropout, "backend": "cudnn"}
    if dropout:
        options.update(dropout_p=0.2, dropout_rng=jax.random.key(5))

    def loss(q, k, v):
        return (fj.attention(q, k, v, **options).astype(F32) * g).sum()

    plain = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    remat = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), remat, plain):
        if dropout:  # the default backward may accumulate in another order
            assert_near(a, b, name)
        else:
            assert_equal(a, b, name)
    assert_cudnn_ran(cudnn_calls)


# ----------------------------------------------------------------------------- dropout

def _dropout_run(options):
    """A jitted (q, k, v, g, **dropout) -> (out, grads) on cudnn with dropout_p=0.2."""
    @jax.jit
    def run(q, k, v, g, dropout):
        return _grad_fn({**options, "dropout_p": 0.2, **dropout}, g)(q, k, v)

    return lambda q, k, v, g, **dropout: run(q, k, v, g, dropout)


def test_dropout_same_key_same_results_other_key_other_output(cudnn_calls):
    q, k, v = _bf16(*qkv(60))
    g = jnp.asarray(normal(61, q.shape), BF16)
    run = _dropout_run({"mask": "causal"})
    out_a, grads_a = run(q, k, v, g, dropout_rng=jax.random.key(1))
    out_b, grads_b = run(q, k, v, g, dropout_rng=jax.random.key(1))
    out_c, _ = run(q, k, v, g, dropout_rng=jax.random.key(2))
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out_a, *grads_a), (out_b, *grads_b)):
        assert_equal(a, b, f"{name} (same key)")
    assert not np.array_equal(np.asarray(out_a), np.asarray(out_c)), "another key gave the same output"
    plain = jax.jit(lambda q, k, v: fj.attention(q, k, v, mask="causal", backend="cudnn"))(q, k, v)
    assert not np.array_equal(np.asarray(out_a), np.asarray(plain)), "dropout changed nothing"
    assert_cudnn_ran(cudnn_calls)
    assert any(cfg.dropout_p == 0.2 for _, cfg in cudnn_calls if cfg.framework == "jax")


@requires_torch("compares JAX's dropout with torch's")
@pytest.mark.parametrize("seed,offset", [(1234, 0), (77, 4096)])
def test_dropout_torch_and_jax_agree(cudnn_calls, seed, offset):
    """Same cuDNN graph, same (seed, offset): the same mask, so the same output and gradients."""
    q, k, v = _bf16(*qkv(70))
    g = jnp.asarray(normal(71, q.shape), BF16)
    out_j, grads_j = _dropout_run({"mask": "causal"})(q, k, v, g, dropout_seed=seed, dropout_offset=offset)
    leaves = [to_torch(x).requires_grad_(True) for x in (q, k, v)]
    out_t = ft.attention(*leaves, mask="causal", dropout_p=0.2, dropout_seed=seed, dropout_offset=offset,
                         backend="cudnn")
    grads_t = torch.autograd.grad(out_t, leaves, to_torch(g))
    assert torch.equal(to_torch(out_j).float(), out_t.detach().float()), "out differs between torch and JAX"
    shifted, _ = _dropout_run({"mask": "causal"})(q, k, v, g, dropout_seed=seed, dropout_offset=offset + 1)
    assert not torch.equal(to_torch(shifted).float(), out_t.detach().float()), "the offset does not reach cuDNN"
    for name, a, b in zip(("dq", "dk", "dv"), grads_j, grads_t):
        assert_near(a, b.float().cpu().numpy(), f"{name} (JAX vs torch)")
    assert_cudnn_ran(cudnn_calls)
    assert {c.framework for _, c in cudnn_calls} == {"jax", "torch"}


@requires_torch("reads cuDNN's dropout mask through the torch runner's debug output")
def test_dropout_gradients_match_the_reference_under_cudnns_own_mask(cudnn_calls):
    """cuDNN's Philox mask, read back through its debug output, drives the float64 naive attention."""
    from fusedattn.backends.base import AttentionInputs
    from fusedattn.backends.cudnn.torch_run import dropout_mask

    p, seed = 0.2, 3
    q, k, v = _bf16(*qkv(80))
    g = jnp.asarray(normal(81, q.shape), BF16)
    out, grads = _dropout_run({"mask": "causal"})(q, k, v, g, dropout_seed=seed, dropout_offset=0)
    assert_cudnn_ran(cudnn_calls)
    cfg = fusedattn.AttentionConfig(dtype="bfloat16", layout="bshd", batch=B, seqlen_q=S, seqlen_kv=S, heads_q=H,
                                    heads_kv=2, head_dim_qk=D, head_dim_v=D, mask="causal", dropout_p=p,
                                    is_training=True, device="cuda")
    tq, tk, tv = (to_torch(x) for x in (q, k, v))
    dump = dropout_mask(cfg, AttentionInputs(tq, tk, tv,
                                             dropout_seed=torch.tensor(seed, dtype=torch.int64, device="cuda"),
                                             dropout_offset=torch.tensor(0, dtype=torch.int64, device="cuda")))
    keep = dump != 0
    assert 0.15 < 1 - keep.float().mean().item() < 0.25
    leaves = [x.double().requires_grad_(True) for x in (tq, tk, tv)]
    exact, _, _ = naive_attention(*leaves, mask="causal", dropout_keep=keep, dropout_p=p)
    exact_grads = torch.autograd.grad(exact, leaves, to_torch(g).double())
    assert_close_to_exact("out", as_float64(out), exact.to(torch.bfloat16), exact)
    for name, got, e in zip(("dq", "dk", "dv"), grads, exact_grads):
        assert_close_to_exact(name, as_float64(got), e.to(torch.bfloat16), e)


# ----------------------------------------------------------------------------- score_mod

def scaled_with_key_bias(graph, score, tensors):
    """score * factor[h] + key_bias[h, j]: two aux arrays, (1, H, 1, 1) and (1, H, 1, Skv)."""
    return graph.add(a=graph.mul(a=score, b=tensors["factor"]), b=tensors["key_bias"])


def scaled_with_key_bias_bprop(graph, dscore, tensors):
    return graph.mul(a=dscore, b=tensors["factor"])


def distance_penalty(graph, score, tensors):
    """score - shrink * |q_idx - kv_idx|, with a Python scalar (a runtime value)."""
    distance = graph.abs(input=graph.sub(a=sm.row_index(graph, score), b=sm.col_index(graph, score)))
    return graph.sub(a=score, b=graph.mul(a=distance, b=tensors["shrink"]))


def _aux(seed: int) -> dict:
    return {"factor": 0.5 + np.abs(normal(seed, (1, H, 1, 1))), "key_bias": normal(seed + 1, (1, H, 1, S))}


def _score_mod_options(name: str) -> dict:
    if name == "softcap":
        return {"score_mod": sm.softcap(2.0)}
    if name == "aux_arrays":
        return {"score_mod": scaled_with_key_bias, "score_mod_bprop": scaled_with_key_bias_bprop,
                "score_mod_tensors": _aux(90)}
    if name in ("per_batch", "per_batch_head"):  # read by cuDNN as the first batch's without zero strides
        return {"score_mod": sm.additive_bias(jnp.asarray(normal(92, (B, H if name == "per_batch_head" else 1, 1, 1))))}
    return {"score_mod": distance_penalty, "score_mod_tensors": {"shrink": 0.3}}


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", ["softcap", "aux_arrays", "python_scalar", "per_batch", "per_batch_head"])
def test_score_mod(cudnn_calls, name, jit):
    q, k, v = qkv(91, hkv=H, scale_q=3.0)  # larger scores, so the softcap bites
    options = {"mask": "causal", **_score_mod_options(name)}
    if "score_mod_tensors" in options:  # NumPy aux values as JAX arrays
        options["score_mod_tensors"] = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                                        for n, x in options["score_mod_tensors"].items()}
    check(cudnn_calls, {"q": q, "k": k, "v": v}, options, jit=jit, seed=91)
    assert all(cfg.score_mod_key is not None for _, cfg in cudnn_calls if cfg.framework == "jax")


def _wrong_bprop(graph, dscore, tensors):
    """Derivative dscore + factor[h] where it is dscore * factor[h]: a user's mistake cuDNN cannot see."""
    return graph.add(a=dscore, b=tensors["factor"])


def test_a_wrong_bprop_makes_the_gradient_check_fail(cudnn_calls):
    """The comparison above can fail: with a wrong bprop cuDNN runs and the gradients are off."""
    q, k, v = qkv(91, hkv=H, scale_q=3.0)
    options = {"mask": "causal", "score_mod": scaled_with_key_bias, "score_mod_bprop": _wrong_bprop,
               "score_mod_tensors": {n: jnp.asarray(x) for n, x in _aux(90).items()}}
    with pytest.raises(AssertionError, match="dq|dk|dv"):
        check(cudnn_calls, {"q": q, "k": k, "v": v}, options, seed=91)


def test_a_missing_bprop_is_refused_by_name_not_run_with_derivative_one():
    """Without its bprop, a graph-API score_mod whose derivative is not 1 is refused for gradients."""
    q, k, v = (jnp.asarray(x, BF16) for x in qkv(91, hkv=H, scale_q=3.0))
    options = {"mask": "causal", "score_mod": scaled_with_key_bias,
               "score_mod_tensors": {n: jnp.asarray(x) for n, x in _aux(90).items()}}

    def loss(q):
        return fj.attention(q, k, v, backend="cudnn", **options).astype(jnp.float32).sum()

    with pytest.raises(fusedattn.NoBackendError, match="score_mod without score_mod_bprop"):
        jax.grad(loss)(q)


def test_score_mod_aux_arrays_are_traced_arguments_read_at_run_time(cudnn_calls):
    """One compiled function, two aux values: each result matches the reference for its own values."""
    q, k, v = _bf16(*qkv(92, hkv=H))
    g = jnp.asarray(normal(93, q.shape), BF16)

    @jax.jit
    def run(q, k, v, factor, key_bias):
        options = {"mask": "causal", "score_mod": scaled_with_key_bias, "score_mod_bprop": scaled_with_key_bias_bprop,
                   "score_mod_tensors": {"factor": factor, "key_bias": key_bias}}
        out, pullback = jax.vjp(lambda q, k, v: fj.attention(q, k, v, **options, backend="cudnn"), q, k, v)
        return out, pullback(g)

    arrays = {"q": q, "k": k, "v": v}
    outs = []
    for seed in (94, 96):
        aux = {n: jnp.asarray(x) for n, x in _aux(seed).items()}
        out, grads = run(q, k, v, aux["factor"], aux["key_bias"])
        options = {"mask": "causal", "score_mod": scaled_with_key_bias, "score_mod_bprop": scaled_with_key_bias_bprop,
                   "score_mod_tensors": aux}
        same = jax_reference(arrays, options, g)
        exact = jax_reference(arrays, options, g, wide=True)
        assert_close_to_exact("out", as_float64(out), same[0], exact[0])
        for name, grad in zip("qkv", grads):
            assert_close_to_exact(f"d{name}", as_float64(grad), same[2][name], exact[2][name])
        outs.append(np.asarray(out))
    assert not np.array_equal(outs[0], outs[1]), "the second aux values changed nothing: baked in at trace time?"
    assert_cudnn_ran(cudnn_calls)


# ----------------------------------------------------------------------------- flex-style callbacks

@pytest.mark.parametrize("name", sorted(FLEX_CORPUS))
def test_flex_corpus_entry(cudnn_calls, name):
    """Every corpus callback, written once and traced by make_jaxpr, on cuDNN under jit: out, lse
    and dq/dk/dv against the references of the same callback (the float64 one's arrays made under x64)."""
    q, k, v = _bf16(*qkv(97, hkv=2, scale_q=2.0))
    jarrays = {"q": q, "k": k, "v": v}
    names = ("score_mod", "mask_mod")
    joptions = {n: f for n, f in zip(names, FLEX_CORPUS[name](jax_array, B, H, S)) if f is not None}
    g = jnp.asarray(normal(98, q.shape), BF16)
    same = jax_reference(jarrays, joptions, g)
    with jax.enable_x64(True):  # the callback's captured arrays in float64 too
        wide_options = {n: f for n, f in zip(names, FLEX_CORPUS[name](jax_array, B, H, S)) if f is not None}
    exact = jax_reference(jarrays, wide_options, g, wide=True)
    try:
        got = jax_cudnn(jarrays, joptions, g)
    except fusedattn.NoBackendError as error:
        pytest.fail(f"cuDNN declined a flex callback from JAX: {error}")
    compare(got, same, exact, list(jarrays))
    assert_cudnn_ran(cudnn_calls)


@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_half_precision_tables_run_on_cudnn(cudnn_calls, dtype):
    """A table captured in bfloat16 (or float16): traced (bfloat16 was not, and such calls left cuDNN), run
    on cuDNN under jit, against the references of the same table values."""
    q, k, v = _bf16(*qkv(99, hkv=2, scale_q=2.0))
    jarrays = {"q": q, "k": k, "v": v}
    table = jnp.asarray(normal(100, (H, 2 * S - 1)), dtype)
    g = jnp.asarray(normal(101, q.shape), BF16)

    def options(t):
        return {"mask": "causal", "score_mod": sm.relative_position_bias(t)}

    same = jax_reference(jarrays, options(table), g)
    with jax.enable_x64(True):
        exact = jax_reference(jarrays, options(jnp.asarray(np.asarray(table, np.float64))), g, wide=True)
    try:
        got = jax_cudnn(jarrays, options(table), g)
    except fusedattn.NoBackendError as error:
        pytest.fail(f"cuDNN declined a half-precision table from JAX: {error}")
    compare(got, same, exact, list(jarrays))
    assert_cudnn_ran(cudnn_calls)


# ----------------------------------------------------------------------------- Flax

def _adam(lr: float):
    """A minimal Adam (no optax dependency): (init(params), update(grads, state, params))."""
    b1, b2, eps = 0.9, 0.999, 1e-8

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return (zeros, zeros, jnp.zeros((), jnp.int32))

    def update(grads, state, params):
        m, v, t = state
        t = t + 1
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
        m_hat_scale, v_hat_scale = 1 / (1 - b1 ** t), 1 / (1 - b2 ** t)
        params = jax.tree.map(lambda p, m, v: p - lr * (m * m_hat_scale) / (jnp.sqrt(v * v_hat_scale) + eps),
                              params, m, v)
        return params, (m, v, t)

    return init, update


@pytest.mark.parametrize("attention_dropout", [0.0, 0.1], ids=["no_dropout", "dropout"])
def test_flax_transformer_layer_trains_on_cudnn(cudnn_calls, attention_dropout):
    """fp32 parameters, bf16 compute, GQA (a fused QKV projection: bshd_bs2hd), causal: learn to copy the
    previous token."""
    pytest.importorskip("flax")
    e = 256
    x = jnp.asarray(normal(100, (B, S, e)))
    target = jnp.concatenate([jnp.zeros((B, 1, e)), x[:, :-1]], axis=1)
    layer = fj.TransformerLayer(hidden_size=e, num_heads=H, num_kv_heads=2, mask="causal", dtype=BF16,
                                attention_dropout=attention_dropout, backend="cudnn")
    params = layer.init(jax.random.key(0), x)
    init, update = _adam(1e-3)
    state = init(params)

    @jax.jit
    def step(params, state, key):
        def loss(p):
            out = layer.apply(p, x, deterministic=False, rngs={"dropout": key})
            return jnp.mean((out.astype(F32) - target) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        params, state = update(grads, state, params)
        return value, params, state

    losses = []
    for i in range(25):
        value, params, state = step(params, state, jax.random.key(100 + i))
        losses.append(float(value))
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < 0.5 * losses[0], losses
    assert_cudnn_ran(cudnn_calls)
    jax_cfgs = [cfg for _, cfg in cudnn_calls if cfg.framework == "jax"]
    assert all(cfg.dtype == "bfloat16" and (cfg.heads_q, cfg.heads_kv) == (H, 2) for cfg in jax_cfgs)
    assert any(cfg.dropout_p == attention_dropout for cfg in jax_cfgs)


# ----------------------------------------------------------------------------- selection

def test_auto_selection_picks_cudnn_for_jax_on_a_gpu(cudnn_calls):
    cfg = fusedattn.AttentionConfig(dtype="bfloat16", layout="bshd", batch=B, seqlen_q=S, seqlen_kv=S, heads_q=H,
                                    heads_kv=2, head_dim_qk=D, head_dim_v=D, mask="causal", device="cuda",
                                    framework="jax", is_training=True)
    selection = fusedattn.select_backend(cfg)
    assert selection.name == "cudnn" and selection.forced_by is None, fusedattn.explain(cfg)
    q, k, v = _bf16(*qkv(110))
    out = jax.jit(lambda q, k, v: fj.attention(q, k, v, mask="causal"))(q, k, v)  # no backend named
    np.asarray(out)
    assert_cudnn_ran(cudnn_calls, phases=("forward",))
    assert all(cfg.device == "cuda" for _, cfg in cudnn_calls)


def test_forcing_cudnn_on_a_call_it_cannot_run_raises_with_its_reasons():
    q = jnp.zeros((1, 64, 2, 576), BF16)  # 576 > 256: a cheap rule, no graph is built
    with pytest.raises(fusedattn.NoBackendError, match="head_dim_qk=576 > 256") as error:
        jax.eval_shape(lambda: fj.attention(q, q, q, backend="cudnn"))
    assert "backend 'cudnn' cannot run this call (forced by backend='cudnn')" in str(error.value)
    assert "framework=jax" in str(error.value)


# ----------------------------------------------------------------------------- sharding over 2 GPUs

COLLECTIVES = ("all-gather", "all-to-all", "collective-permute", "all-reduce", "reduce-scatter")


def _two_device_mesh():
    from jax.sharding import Mesh

    if jax.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, JAX sees {jax.device_count()}")
    return Mesh(np.array(jax.devices()[:2]), ("x",))


@pytest.mark.parametrize("axis", ["batch", "heads"])
def test_sharded_over_two_gpus_runs_shard_local(cudnn_calls, axis):
    """jit with in_shardings (the split declared by shard_axes= inside jax.set_mesh), and an eager call
    on sharded arrays: no collective in the compiled programs, the unsharded results, and every
    cuDNN run sees half of the sharded axis."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _two_device_mesh()
    q, k, v = _bf16(*qkv(120, b=4))  # B=4, Hq=4, Hkv=2: each halves
    sharding = NamedSharding(mesh, P("x") if axis == "batch" else P(None, None, "x"))

    def f(q, k, v, **split):
        return fj.attention(q, k, v, mask="causal", backend="cudnn", **split)

    def loss(q, k, v, **split):
        return (f(q, k, v, **split).astype(F32) ** 2).sum()

    want = jax.jit(f)(q, k, v)
    want_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    np.asarray(want), np.asarray(want_grads[0])  # their cuDNN runs are done (and recorded) before the count
    calls_before = len(cudnn_calls)
    split = {"shard_axes": {axis: "x"}}
    forward = jax.jit(lambda q, k, v: f(q, k, v, **split), in_shardings=(sharding,) * 3, out_shardings=sharding)
    backward = jax.jit(jax.grad(lambda q, k, v: loss(q, k, v, **split), argnums=(0, 1, 2)),
                       in_shardings=(sharding,) * 3, out_shardings=(sharding,) * 3)
    placed = [jax.device_put(x, sharding) for x in (q, k, v)]
    with jax.set_mesh(mesh):
        for label, fn in (("forward", forward), ("gradients", backward)):
            hlo = fn.lower(*placed).compile().as_text()
            bridge = native.TARGET if native.unavailable() is None else "xla_buffer_python_gpu_callback"
            assert bridge in hlo, f"{label}: the bridge ({bridge}) is not in the compiled program"
            found = [c for c in COLLECTIVES if c in hlo]
            assert not found, f"{axis}-sharded {label}: {found} in the compiled program"
        out = forward(*placed)
        grads = backward(*placed)
    assert out.sharding.is_equivalent_to(sharding, out.ndim), out.sharding
    assert_near(out, want, "out (sharded vs one device)")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads):
        assert_near(got, ref, f"{name} (sharded vs one device)")
    eager = f(*placed)  # outside jit the split comes from the arrays' own sharding
    assert eager.sharding.is_equivalent_to(sharding, eager.ndim), eager.sharding
    assert_near(eager, want, "out (eager, sharded arrays)")
    sharded_calls = [(phase, cfg) for phase, cfg in cudnn_calls[calls_before:] if cfg.framework == "jax"]
    assert {phase for phase, _ in sharded_calls} == {"forward", "backward"}, sharded_calls
    local = [(cfg.batch, cfg.heads_q, cfg.heads_kv) for _, cfg in sharded_calls]
    assert set(local) == ({(2, 4, 2)} if axis == "batch" else {(4, 2, 1)}), local


def test_sequence_sharding_raises_a_clear_error():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = _two_device_mesh()
    q, k, v = _bf16(*qkv(130))
    seq = NamedSharding(mesh, P(None, "x"))
    message = "sequence axis (S of BSHD) sharded over mesh axis 'x'"
    with pytest.raises(ValueError, match=r"sequence axis \(S of BSHD\)"):
        fj.attention(*(jax.device_put(x, seq) for x in (q, k, v)), mask="causal", backend="cudnn")
    with pytest.raises(Exception) as error:  # XLA wraps the ValueError of the partitioning callback
        with jax.set_mesh(mesh):
            jax.jit(lambda q, k, v: fj.attention(q, k, v, mask="causal", backend="cudnn",
                                                 shard_axes={"batch": "x"}),
                    in_shardings=(seq,) * 3)(q, k, v)
    assert message in str(error.value), error.value


@requires_torch("runs the callback path, which goes through torch")
def test_plain_calls_run_from_raw_addresses_and_match_the_torch_path(cudnn_calls, monkeypatch):
    """q, k, v-only calls skip torch (pointer_run); FUSEDATTN_JAX_LEAN=0 takes the torch path: same bits.
    (The callback paths, so with the native custom call off.)"""
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    q, k, v = (jax.random.normal(key, (2, 256, 4, 64), jnp.bfloat16) for key in jax.random.split(jax.random.key(5), 3))

    def step(q, k, v):
        out, pullback = jax.vjp(lambda *x: fj.attention(*x, mask="causal", deterministic=True, backend="cudnn"),
                                q, k, v)
        return (out, *pullback(jnp.ones_like(out)))

    from fusedattn.backends.cudnn import core_launch

    lean_step = jax.jit(step)
    first = [np.asarray(x) for x in lean_step(q, k, v)]  # cuDNN's public execute, then the core's launch
    again = [np.asarray(x) for x in lean_step(q, k, v)]
    assert cudnn_calls.lean == ["forward", "backward"] * 2, cudnn_calls.lean
    monkeypatch.setenv("FUSEDATTN_JAX_LEAN", "0")
    through_torch = [np.asarray(x) for x in jax.jit(lambda *x: step(*x))(q, k, v)]  # a new trace reads the env
    assert cudnn_calls.lean == ["forward", "backward"] * 2, "the torch path ran from raw addresses"
    assert_cudnn_ran(cudnn_calls)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), first, again, through_torch):
        np.testing.assert_array_equal(a.view(np.uint16), c.view(np.uint16), err_msg=f"{name}: public execute")
        np.testing.assert_array_equal(b.view(np.uint16), c.view(np.uint16), err_msg=f"{name}: the core's launch")
    assert core_launch.unavailable() is None, core_launch.unavailable()
    launched = [bound[0] for runner in cudnn_calls.runners for bound in runner._bound.values()]
    assert launched and all(isinstance(g, core_launch.CoreLaunch) for g in launched), launched



@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_forward_without_gradient_runs_an_inference_graph(cudnn_calls, mask):
    """A jitted forward that nothing differentiates runs cuDNN without the LSE (is_training=False)
    and still matches the reference; the same call under jax.vjp runs the training graph."""
    q, k, v = qkv(61, sq=256, d=128)
    options = {"mask": mask}
    if mask == "padding":
        lengths = cumulative([200, 256])
        options.update(cu_seqlens_q=lengths, cu_seqlens_kv=lengths)
    arrays, joptions = jax_inputs({"q": q, "k": k, "v": v}, options, BF16)
    out = jax.jit(lambda q, k, v: fj.attention(q, k, v, **joptions, backend="cudnn"))(*arrays.values())
    g = jnp.ones(out.shape, BF16)
    same = jax_reference(arrays, joptions, g)[0]
    exact = jax_reference(arrays, joptions, g, wide=True)[0]
    assert_close_to_exact("out", as_float64(out), same, exact)
    assert [(phase, cfg.is_training) for phase, cfg in cudnn_calls] == [("forward", False)], cudnn_calls
    trained, _ = jax.jit(lambda *x: jax.vjp(lambda *y: fj.attention(*y, **joptions, backend="cudnn"), *x))(
        *arrays.values())
    assert ("forward", True) in [(phase, cfg.is_training) for phase, cfg in cudnn_calls], cudnn_calls
    assert_close_to_exact("out (training graph)", as_float64(trained), same, exact)


def _plain_step(mask: str = "causal"):
    def step(q, k, v):
        out, pullback = jax.vjp(lambda *x: fj.attention(*x, mask=mask, deterministic=True, backend="cudnn"), q, k, v)
        return (out, *pullback(jnp.cos(out)))

    return step


def test_native_library_builds_here():
    """On a GPU machine with the frontend's wheel, the native custom call must be available."""
    assert native.unavailable() is None, native.unavailable()


@requires_torch("compares with the callback path, which goes through torch")
@pytest.mark.parametrize("mask,heads_kv,d", [("causal", 4, 64), ("none", 1, 128), ("causal_bottom_right", 2, 128)])
def test_native_custom_call_gives_the_callback_paths_bits(cudnn_calls, monkeypatch, mask, heads_kv, d):
    """Plain calls compile to fusedattn's native custom call, forward and backward, with no Python
    callback in the program, and give exactly the bits of the callback path (FUSEDATTN_JAX_NATIVE=0)."""
    keys = jax.random.split(jax.random.key(9), 3)
    q = jax.random.normal(keys[0], (2, 256, 4, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 320, heads_kv, d), jnp.bfloat16) for key in keys[1:])
    step = _plain_step(mask)
    program = jax.jit(step).lower(q, k, v).as_text()
    assert program.count(native.TARGET) == 2 and "python" not in program, program[-2000:]
    fast = [np.asarray(x) for x in jax.jit(step)(q, k, v)]
    assert cudnn_calls.native == ["forward", "backward"], cudnn_calls.native
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    slow = [np.asarray(x) for x in jax.jit(lambda *x: step(*x))(q, k, v)]
    assert cudnn_calls.native == ["forward", "backward"] and cudnn_calls.lean == ["forward", "backward"]
    for name, a, b in zip(("out", "dq", "dk", "dv"), fast, slow):
        assert np.isfinite(a.astype(np.float32)).all(), name
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=name)


def test_native_programs_survive_the_cores_eviction():
    """The launch core keeps plans by digest in a bounded registry. With room for one plan, two
    compiled programs that alternate (each evicting the other's plans) still run, from the bytes
    they carry, and give their first bits."""
    from fusedattn.backends.cudnn.native import core

    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (2, 192, 4, 64), jnp.bfloat16)
    k, v = (jax.random.normal(key, (2, 192, 2, 64), jnp.bfloat16) for key in keys[1:])
    programs = [jax.jit(_plain_step(mask)) for mask in ("causal", "none")]
    first = [[np.asarray(x) for x in program(q, k, v)] for program in programs]
    try:
        core.bounds(1)
        for _ in range(3):
            for program, expected in zip(programs, first):
                for a, b in zip(program(q, k, v), expected):
                    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), b.view(np.uint16))
        assert core.bounds() == 1
    finally:
        core.bounds(core.PLAN_CAPACITY)


def test_native_custom_call_matches_the_reference_under_vmap_and_inference():
    """The native path against the float64 reference: a vmapped training step and a forward that
    nothing differentiates (the inference graph, no stats buffer bound)."""
    q, k, v = qkv(71, sq=256, d=64)
    arrays, _ = jax_inputs({"q": q, "k": k, "v": v}, {}, BF16)
    stacked = [jnp.stack([x, 0.5 * x]) for x in arrays.values()]
    outs = jax.jit(jax.vmap(_plain_step("causal")))(*stacked)
    inference = jax.jit(lambda *x: fj.attention(*x, mask="causal", backend="cudnn"))(*arrays.values())
    for member in range(2):
        members = {n: x[member] for n, x in zip(arrays, stacked)}
        g = jnp.cos(outs[0][member])
        out, _, grads = jax_reference(members, {"mask": "causal"}, g)
        out64, _, grads64 = jax_reference(members, {"mask": "causal"}, g, wide=True)
        assert_close_to_exact(f"out[{member}]", as_float64(outs[0][member]), out, out64)
        for i, name in enumerate(("q", "k", "v"), start=1):
            assert_close_to_exact(f"d{name}[{member}]", as_float64(outs[i][member]), grads[name], grads64[name])
    g = jnp.ones_like(arrays["q"])
    same, exact = (jax_reference(arrays, {"mask": "causal"}, g, wide=wide)[0] for wide in (False, True))
    assert_close_to_exact("inference out", as_float64(inference), same, exact)


def test_a_call_whose_buffers_do_not_match_its_plan_is_refused():
    """The native call carries its plan's uids, one per buffer and scalar; a call with another number of
    them fails with a clear error instead of binding the wrong ones."""
    assert native.unavailable() is None, native.unavailable()  # loads the handler and registers its target
    q = jax.random.normal(jax.random.key(3), (2, 128, 4, 64), jnp.bfloat16)
    stray = jax.ffi.ffi_call(native.TARGET, (jax.ShapeDtypeStruct((1,), jnp.uint8),), vmap_method="sequential")
    attributes = {"plan": np.int64(12345), "blob": np.zeros(4, np.uint8), "uids": np.asarray([1, 2, 3, 4], np.int64),
                  "scalars": np.asarray([7], np.int32)}
    with pytest.raises(Exception, match="binds 4 slots, the call has 2 buffers and 1 scalars"):
        np.asarray(jax.jit(lambda q: stray(q, **attributes)[0])(q))


def test_a_captured_table_differentiated_outside_jit_is_refused_on_cudnn_not_left_at_zero(cudnn_calls):
    """jax.grad outside jit of a call whose score_mod captures the differentiated table: the call was traced
    before that was known, and cuDNN gives score_mod arrays no gradient. It raises, naming the way out,
    instead of a zero gradient; the same table under stop_gradient still runs."""
    q, k, v = _bf16(*qkv(95, hkv=H))
    table = jnp.asarray(normal(96, (H, 2 * S - 1)), jnp.float32)

    def f(t):
        return fj.attention(q, k, v, mask="causal", backend="cudnn",
                            score_mod=lambda s, b, h, qi, ki: s + t[h, ki - qi + S - 1]).astype(jnp.float32).sum()

    with pytest.raises(ValueError, match="a captured array is differentiated"):
        jax.grad(jax.jit(f))(table)
    jax.jit(f)(jax.lax.stop_gradient(table)).block_until_ready()
    assert_cudnn_ran(cudnn_calls, phases=("forward",))
