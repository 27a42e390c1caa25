"""The two float64 naives agree: tests/naive_jax.py (jax.numpy, the torch-free run's reference) against
tests/naive.py (torch, the ground truth) on generated calls, out, lse, max_logit and every gradient.

Calls are drawn from fixed seeds: every layout (packed ones too), every mask with Sq != Skv, windows,
GQA/MQA, D != Dv, bias pre/post scale in several broadcast shapes, ALiBi per head and per batch and
head, both sinks, a custom scale, dropout masks, a score_mod that masks, empty and one-token sequences,
THD with and without padded offsets. A tally proves each was drawn; mutated twins prove a wrong one fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from needs_torch import import_torch

torch = import_torch("compares tests/naive_jax.py with tests/naive.py, which is torch's")
jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

from fusedattn import score_mods as sm  # noqa: E402

try:
    import naive
    import naive_jax
except ImportError:  # tests/ collected as a package
    from tests import naive, naive_jax

LAYOUTS = tuple(naive_jax.BASE_LAYOUT)
MASKS = ("none", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right")
CASES = 60
RTOL = 1e-10  # float64 against float64: summation order only


def _mod(score, b, h, q_idx, kv_idx):
    """A softcap, a relative-position term and a band that masks (a row may lose every key); exact in both
    frameworks (torch makes int * float a float32: only multiples of 0.25 here)."""
    score = 4.0 * sm.tanh(score / 4.0) * sm.where(h % 2 == 0, 1.0, 0.5) + 0.25 * (kv_idx - q_idx) + 0.5 * b
    return sm.where((kv_idx > q_idx + 2) | (kv_idx + 2 + b <= q_idx), sm.MASKED, score)


def _lengths(rng, n, longest):
    """n sequence lengths up to `longest`, empty and one-token sequences often."""
    return [int(rng.choice([0, 1, longest, rng.integers(0, longest + 1)])) for _ in range(n)]


def draw_call(seed: int) -> dict:
    """One call: layout, float64 arrays by keyword, offsets, options (naive's keywords), features drawn."""
    rng = np.random.default_rng(seed)
    layout = LAYOUTS[seed % len(LAYOUTS)]
    base = naive_jax.BASE_LAYOUT[layout]
    ragged, self_attention = base == "thd", layout in naive_jax.PACKED_QKV
    mask = MASKS[rng.integers(len(MASKS))]
    batch = int(rng.integers(1, 4))
    heads_kv = int(rng.choice([1, 2]))
    heads_q = heads_kv if self_attention else heads_kv * int(rng.choice([1, 2, 3]))
    d = int(rng.choice([2, 4]))
    dv = d if layout in naive_jax.PACKED_QKV + naive_jax.PACKED_KV else int(rng.choice([2, 3, 4]))
    options, offsets, features = {"mask": mask}, {}, {f"layout={layout}", f"mask={mask}"}

    if ragged:
        lens_q = _lengths(rng, batch, 5)
        lens_kv = lens_q if self_attention else _lengths(rng, batch, 5)
        cu_q, cu_kv = np.cumsum([0, *lens_q]), np.cumsum([0, *lens_kv])
        offsets.update(cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv)
        tq, tkv = int(cu_q[-1]), int(cu_kv[-1])
        if rng.random() < 0.6:  # padded offsets: gaps between the sequences and tokens after the last
            gaps_q = rng.integers(0, 3, batch)
            gaps_kv = gaps_q if self_attention else rng.integers(0, 3, batch)
            pad_q, pad_kv = np.cumsum([0, *(lens_q + gaps_q)]), np.cumsum([0, *(lens_kv + gaps_kv)])
            offsets.update(cu_seqlens_q_padded=pad_q, cu_seqlens_kv_padded=pad_kv)
            tq, tkv = int(pad_q[-1]) + 1, int(pad_kv[-1]) + (1 if self_attention else 2)
            features.add("THD gaps")
        lead_q, lead_kv = (tq,), (tkv,)
        longest_q, longest_kv = max(lens_q), max(lens_kv)
    else:
        seqlen_q = int(rng.integers(1, 8))
        seqlen_kv = seqlen_q if self_attention else int(rng.integers(1, 8))
        if mask.startswith("padding"):
            lens_q = _lengths(rng, batch, seqlen_q)
            lens_kv = lens_q if self_attention else _lengths(rng, batch, seqlen_kv)
            offsets.update(cu_seqlens_q=np.cumsum([0, *lens_q]), cu_seqlens_kv=np.cumsum([0, *lens_kv]))
        else:
            lens_q, lens_kv = [seqlen_q] * batch, [seqlen_kv] * batch
        lead_q = {"bshd": (batch, seqlen_q), "sbhd": (seqlen_q, batch), "bhsd": (batch,)}[base]
        lead_kv = {"bshd": (batch, seqlen_kv), "sbhd": (seqlen_kv, batch), "bhsd": (batch,)}[base]
        longest_q, longest_kv = seqlen_q, seqlen_kv
    if any(n == 0 for n in lens_q + lens_kv):
        features.add("empty sequence")
    if any(n == 1 for n in lens_q + lens_kv):
        features.add("one-token sequence")
    if "bottom_right" in mask and any(a != b for a, b in zip(lens_q, lens_kv)):
        features.add("bottom-right, Sq != Skv")

    magnitude = float(rng.choice([0.5, 1.0, 3.0]))  # 3: sharp softmaxes, large logits

    def normal(*shape):
        return rng.standard_normal(shape) * magnitude

    if base == "bhsd":
        arrays = {"q": normal(batch, heads_q, seqlen_q, d), "k": normal(batch, heads_kv, seqlen_kv, d),
                  "v": normal(batch, heads_kv, seqlen_kv, dv)}
    elif self_attention:
        arrays = {"q": normal(*lead_q, 3, heads_q, d)}
    elif layout in naive_jax.PACKED_KV:
        arrays = {"q": normal(*lead_q, heads_q, d), "k": normal(*lead_kv, 2, heads_kv, d)}
    else:
        arrays = {"q": normal(*lead_q, heads_q, d), "k": normal(*lead_kv, heads_kv, d),
                  "v": normal(*lead_kv, heads_kv, dv)}
    if heads_q > heads_kv:
        features.add("GQA" if heads_kv > 1 else "MQA")
    if dv != d:
        features.add("D != Dv")

    if rng.random() < 0.5:
        options["window"] = (int(rng.integers(-1, 4)), int(rng.integers(-1, 3)))
        features.add("window")
    if not ragged and rng.random() < 0.4:
        shape = [(batch, heads_q, seqlen_q, seqlen_kv), (1, heads_q, seqlen_q, seqlen_kv),
                 (batch, 1, seqlen_q, 1), (1, 1, 1, seqlen_kv), (seqlen_q, seqlen_kv)][rng.integers(5)]
        arrays["bias"] = rng.standard_normal(shape)
        bias_type = ["pre_scale", "post_scale", None][rng.integers(3)]
        if bias_type:
            options["bias_type"] = bias_type
        features.add(f"bias {bias_type or 'default'}")
    if rng.random() < 0.3:
        per_batch = rng.random() < 0.5
        arrays["alibi_slopes"] = np.abs(rng.standard_normal((batch, heads_q) if per_batch else (heads_q,))) * 0.5
        features.add("alibi (B, Hq)" if per_batch else "alibi (Hq,)")
    softmax_type = ["vanilla", "off_by_one", "learnable"][rng.integers(3)]
    if softmax_type != "vanilla":
        options["softmax_type"] = softmax_type
        features.add(f"sink {softmax_type}")
    if softmax_type == "learnable":
        arrays["sink"] = rng.standard_normal(heads_q) * 2.0
    if rng.random() < 0.2:
        options["scale"] = float(rng.uniform(0.2, 1.5))
        features.add("scale")
    if rng.random() < 0.3:
        options["score_mod"] = _mod
        features.add("score_mod")
    if rng.random() < 0.2:
        options["dropout_p"] = float(rng.choice([0.25, 0.5]))
        options["dropout_keep"] = rng.random((batch, heads_q, longest_q, longest_kv)) >= options["dropout_p"]
        features.add("dropout")
    return dict(seed=seed, layout=layout, arrays=arrays, offsets=offsets, options=options, features=features,
                lens=(lens_q, lens_kv))


REQUIRED_FEATURES = {
    *(f"layout={layout}" for layout in LAYOUTS), *(f"mask={mask}" for mask in MASKS),
    "THD gaps", "empty sequence", "one-token sequence", "bottom-right, Sq != Skv", "GQA", "MQA", "D != Dv",
    "window", "bias pre_scale", "bias post_scale", "bias default", "alibi (Hq,)", "alibi (B, Hq)",
    "sink off_by_one", "sink learnable", "scale", "score_mod", "dropout",
}
CALLS = [draw_call(seed) for seed in range(CASES)]


def torch_naive(call, g_out=None, g_lse=None):
    """(out, lse, max_logit, grads) of tests/naive.py, gradients by torch autograd, as NumPy arrays."""
    tensors = {n: torch.tensor(x, dtype=torch.float64, requires_grad=True) for n, x in call["arrays"].items()}
    options = dict(call["options"])
    if "dropout_keep" in options:
        options["dropout_keep"] = torch.tensor(options["dropout_keep"])
    out, lse, max_logit = naive.naive_attention(
        **tensors, **{n: torch.tensor(x, dtype=torch.int64) for n, x in call["offsets"].items()},
        layout=call["layout"], **options)
    grads = None
    if g_out is not None:
        loss = (out * torch.tensor(g_out)).sum() + (torch.where(torch.isfinite(lse), lse, 0.0)
                                                    * torch.tensor(g_lse)).sum()
        found = torch.autograd.grad(loss, list(tensors.values()), allow_unused=True) if loss.requires_grad \
            else [None] * len(tensors)
        grads = {n: (np.zeros(t.shape) if g is None else g.numpy()) for (n, t), g in zip(tensors.items(), found)}
    return out.detach().numpy(), lse.detach().numpy(), max_logit.numpy(), grads


_EXPECTED = {}


def expected(call):
    """The torch naive's results and the cotangents they were taken with (computed once per call)."""
    if call["seed"] not in _EXPECTED:
        out, lse, _, _ = torch_naive(call)
        rng = np.random.default_rng(10_000 + call["seed"])
        g_out, g_lse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
        _EXPECTED[call["seed"]] = (g_out, g_lse, *torch_naive(call, g_out, g_lse))
    return _EXPECTED[call["seed"]]


def differences(call) -> list[str]:
    """Where naive_jax disagrees with naive.py on `call` (empty when they agree)."""
    g_out, g_lse, *want = expected(call)
    got = naive_jax.value_and_grads(call["arrays"], g_out, g_lse, layout=call["layout"], **call["offsets"],
                                    **call["options"])
    problems = []
    pairs = [("out", got[0], want[0]), ("lse", got[1], want[1]), ("max_logit", got[2], want[2])]
    pairs += [(f"d{name}", got[3][name], want[3][name]) for name in call["arrays"]]
    for what, a, e in pairs:
        a, e = np.asarray(a), np.asarray(e)
        if a.shape != e.shape:
            problems.append(f"{what}: shape {a.shape} != {e.shape}")
            continue
        if np.isnan(a).any() or np.isnan(e).any():
            problems.append(f"{what}: NaN (naive_jax {np.isnan(a).sum()}, naive {np.isnan(e).sum()})")
            continue
        finite = np.isfinite(e)
        if not (np.isfinite(a) == finite).all() or (a[~finite] != e[~finite]).any():
            where = np.argwhere((np.isfinite(a) != finite) | (~finite & (a != e)))
            problems.append(f"{what}: infinities differ at {where[:3].tolist()}")
            continue
        if finite.any():
            scale = max(1.0, float(np.abs(e[finite]).max()))
            err = float(np.abs(a[finite] - e[finite]).max())
            if err > RTOL * scale:
                problems.append(f"{what}: max abs error {err:.3g} (scale {scale:.3g})")
    return problems


def describe(call) -> str:
    shapes = {n: x.shape for n, x in call["arrays"].items()}
    options = {k: ("<keep>" if k == "dropout_keep" else getattr(v, "__name__", v)) for k, v in call["options"].items()}
    return (f"seed {call['seed']}: {call['layout']} {shapes} lens {call['lens']} "
            f"offsets { {k: v.tolist() for k, v in call['offsets'].items()} } {options}")


def test_generated_calls_cover_every_feature():
    drawn = set().union(*(call["features"] for call in CALLS))
    assert not REQUIRED_FEATURES - drawn, f"never drawn: {sorted(REQUIRED_FEATURES - drawn)}"


def test_naive_jax_matches_naive():
    failures = [f"{describe(call)}\n    " + "\n    ".join(problems)
                for call in CALLS if (problems := differences(call))]
    assert not failures, f"{len(failures)} of {len(CALLS)} calls differ:\n" + "\n".join(failures)


def _flip_diagonal(monkeypatch):
    original = naive_jax._visibility
    monkeypatch.setattr(naive_jax, "_visibility",
                        lambda *a, bottom_right, **kw: original(*a, bottom_right=not bottom_right, **kw))


def _wrong_call(change):
    """A twin that reads its call's keywords wrong, `change` says how."""
    def mutate(monkeypatch):
        original = naive_jax._prepare
        monkeypatch.setattr(naive_jax, "_prepare", lambda *a, **kw: original(*a, **change(kw)))
    return mutate


MUTANTS = {
    "diagonal flipped": (_flip_diagonal, lambda call: "bottom-right, Sq != Skv" in call["features"]),
    "no sink term": (_wrong_call(lambda kw: {**kw, "softmax_type": "vanilla"} if kw.get("softmax_type") == "off_by_one"
                                 else kw), lambda call: "sink off_by_one" in call["features"]),
    "pre_scale as post_scale": (_wrong_call(lambda kw: {**kw, "bias_type": "post_scale"}),
                                lambda call: "bias pre_scale" in call["features"]),
    "padded offsets ignored": (_wrong_call(lambda kw: {**kw, "cu_seqlens_q_padded": None,
                                                       "cu_seqlens_kv_padded": None}),
                               lambda call: "THD gaps" in call["features"]),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_wrong_twin_fails(monkeypatch, mutant):
    """The comparison can fail: a twin with one rule wrong differs on a call that uses the rule."""
    mutate, uses_rule = MUTANTS[mutant]
    mutate(monkeypatch)
    for call in CALLS:
        if uses_rule(call) and differences(call):
            return
    pytest.fail(f"{mutant}: no generated call told the wrong twin apart")


def test_value_and_grads_leaves_the_x64_setting_as_it_was():
    call, before = CALLS[0], jax.config.jax_enable_x64
    naive_jax.value_and_grads(call["arrays"], layout=call["layout"], **call["offsets"], **call["options"])
    assert jax.config.jax_enable_x64 == before, "value_and_grads must not turn float64 on for the tests after it"


def test_naive_attention_itself_under_jit_and_grad():
    """naive_attention called as tests/naive.py's is (float64 arrays, autodiff for the gradients: jax.grad,
    under jax.jit) gives tests/naive.py's numbers: a THD call with padded offsets, a score_mod, a learnable sink."""
    call = next(c for c in CALLS if {"THD gaps", "score_mod", "sink learnable"} <= c["features"])
    g_out, g_lse, *want = expected(call)
    keywords = dict(layout=call["layout"], **call["offsets"], **call["options"])
    with jax.enable_x64(True):
        arrays = {name: jnp.asarray(x) for name, x in call["arrays"].items()}

        def loss(arrays):
            out, lse, max_logit = naive_jax.naive_attention(**arrays, **keywords)
            return (out * g_out).sum() + jnp.where(jnp.isfinite(lse), lse * g_lse, 0.0).sum(), (out, lse, max_logit)

        grads, (out, lse, max_logit) = jax.jit(jax.grad(loss, has_aux=True))(arrays)
    for what, got, expected_value in [("out", out, want[0]), ("lse", lse, want[1]), ("max_logit", max_logit, want[2]),
                                      *((f"d{n}", grads[n], want[3][n]) for n in arrays)]:
        np.testing.assert_allclose(np.asarray(got), expected_value, rtol=RTOL, atol=RTOL, err_msg=what)
