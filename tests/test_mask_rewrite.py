"""mask_mods run as native masks (score_mods.mask_forms, mask_rewrite, torch.documents).

Three checks: the native masks chosen for a mask_mod hide exactly the keys the mask_mod hides
(an independent NumPy reading of our mask options against the mask_mod itself, generated
cases included); a call through the rewrite gives the same output, LSE and gradients as the
same mask written as a score_mod select (float64, reference backend, torch and JAX); a
document mask runs as THD only when its ids are sorted, reading them once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from needs_torch import HAS_TORCH, requires_torch

import fusedattn.jax as fj
from fusedattn.score_mods import flex
from fusedattn.score_mods.mask_forms import Band, Document, Length
from fusedattn.score_mods.mask_rewrite import rewrite_mask

LENGTH_VALUES = [5, 0, 40]  # one short, one empty, one past the end
WINDOW = 6

torch_side = requires_torch("reads, rewrites and runs the mask_mods on torch tensors")
if HAS_TORCH:
    import torch

    import fusedattn.torch as fat
    from fusedattn.torch import documents as documents_thd

    LENGTHS = torch.tensor(LENGTH_VALUES)


def _masks(lengths):
    """name -> (mask_mod, forms expected, every condition native at Sq == Skv)."""
    return {
        "causal": (lambda b, h, q, kv: q >= kv, [Band(None, 0)], True),
        "causal_mirrored": (lambda b, h, q, kv: kv <= q, [Band(None, 0)], True),
        "causal_negated": (lambda b, h, q, kv: ~(kv > q), [Band(None, 0)], True),
        "sliding": (lambda b, h, q, kv: (q - kv <= WINDOW) & (q >= kv), [Band(WINDOW, None), Band(None, 0)], True),
        "sliding_strict": (lambda b, h, q, kv: (q - kv < WINDOW) & (kv - q <= 0), [Band(WINDOW - 1, None),
                                                                                   Band(None, 0)], True),
        "two_sided": (lambda b, h, q, kv: abs(q - kv) <= 3, [Band(3, 3)], True),
        "shifted": (lambda b, h, q, kv: q + 2 >= kv, [Band(None, 2)], True),
        "diagonal": (lambda b, h, q, kv: q == kv, [Band(0, 0)], True),
        "strictly_lower": (lambda b, h, q, kv: q > kv, [Band(None, -1)], False),
        "key_padding": (lambda b, h, q, kv: kv < lengths[b], [Length("kv_idx", 0, 0)], True),
        "both_padding": (lambda b, h, q, kv: (q < lengths[b]) & (kv < lengths[b]),
                         [Length("q_idx", 0, 0), Length("kv_idx", 0, 0)], True),
        "padding_plus_one": (lambda b, h, q, kv: kv <= lengths[b], [Length("kv_idx", 0, 1)], True),
        "padded_causal": (lambda b, h, q, kv: (kv < lengths[b]) & (q >= kv), [Length("kv_idx", 0, 0),
                                                                                Band(None, 0)], True),
        "padded_window": (lambda b, h, q, kv: (kv < lengths[b]) & (abs(q - kv) <= 2),
                          [Length("kv_idx", 0, 0), Band(2, 2)], False),  # a window moves with padding
        "constant_length": (lambda b, h, q, kv: kv < 7, [Length("kv_idx", None, 7)], True),
        "head_dependent": (lambda b, h, q, kv: (h == 0) | (q >= kv), [None], False),
        "prefix_lm": (lambda b, h, q, kv: (kv < 4) | (q >= kv), [None], False),
    }


def _grid_mask(options: dict, batch: int, seqlen_q: int, seqlen_kv: int) -> np.ndarray:
    """(B, Sq, Skv) keys our mask options keep, read independently of the library's own code."""
    q = np.arange(seqlen_q)[:, None]
    kv = np.arange(seqlen_kv)[None, :]
    mask = options.get("mask", "none")
    keep = np.ones((batch, seqlen_q, seqlen_kv), dtype=bool)
    if "cu_seqlens_q" in options:
        lengths_q = np.diff(np.asarray(options["cu_seqlens_q"]))
        lengths_kv = np.diff(np.asarray(options["cu_seqlens_kv"]))
        keep &= (q[None] < lengths_q[:, None, None]) & (kv[None] < lengths_kv[:, None, None])
    top_left = mask in ("causal", "padding_causal")
    diagonal = q if top_left else q + seqlen_kv - seqlen_q  # the key on each query's diagonal
    left, right = options.get("window") or (-1, -1)
    if "causal" in mask:
        right = 0
    if right >= 0:
        keep &= kv <= diagonal + right
    if left >= 0:
        keep &= kv >= diagonal - left
    return keep


def _user_mask(mask_mod, batch: int, seqlen_q: int, seqlen_kv: int, heads: int = 1) -> np.ndarray:
    b = torch.arange(batch)[:, None, None, None]
    h = torch.arange(heads)[None, :, None, None]
    q = torch.arange(seqlen_q)[None, None, :, None]
    kv = torch.arange(seqlen_kv)[None, None, None, :]
    out = torch.as_tensor(mask_mod(b, h, q, kv))
    return out.broadcast_to((batch, heads, seqlen_q, seqlen_kv)).numpy()


def _rewritten(mask_mod, batch, seqlen_q, seqlen_kv):
    q = torch.zeros(batch, seqlen_q, 2, 4)
    k = torch.zeros(batch, seqlen_kv, 2, 4)
    return rewrite_mask("torch", q, k, k, {"mask_mod": mask_mod}, document_ok=False)[0]


def _check_native_is_exact(mask_mod, batch, seqlen_q, seqlen_kv):
    options = _rewritten(mask_mod, batch, seqlen_q, seqlen_kv)
    native = _grid_mask(options, batch, seqlen_q, seqlen_kv)[:, None]
    wanted = _user_mask(mask_mod, batch, seqlen_q, seqlen_kv)
    kept = options["mask_mod"]
    if kept is None:
        np.testing.assert_array_equal(native, wanted)
    else:  # what stays in the graph is the whole mask_mod or a part of it: the native part may not hide more
        assert not (wanted & ~native).any()
    return options


MASK_NAMES = list(_masks(None))


@torch_side
@pytest.mark.parametrize("name", MASK_NAMES)
def test_each_condition_is_read_as_its_native_form(name):
    mask_mod, expected, _ = _masks(LENGTHS)[name]
    forms = flex.trace_mask("torch", mask_mod, torch.device("cpu"))
    assert [form for _, form in forms.conditions] == expected


@pytest.mark.parametrize("name", ["causal", "sliding", "two_sided", "key_padding", "both_padding", "prefix_lm"])
def test_jax_reads_the_same_forms(name):
    mask_mod, expected, _ = _masks(jnp.asarray(LENGTH_VALUES))[name]
    forms = flex.trace_mask("jax", mask_mod)
    assert [form for _, form in forms.conditions] == expected


@torch_side
@pytest.mark.parametrize("shape", [(3, 9, 9), (3, 4, 11), (3, 11, 4), (3, 1, 13), (3, 1, 1)])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_native_masks_hide_exactly_what_the_mask_mod_hides(name, shape):
    mask_mod, _, all_native = _masks(LENGTHS)[name]
    options = _check_native_is_exact(mask_mod, *shape)
    if all_native and shape[1] == shape[2]:
        assert options["mask_mod"] is None, options


_OPS = ["lt", "le", "gt", "ge"]


def _compare(op: str, a, b):
    return {"lt": a < b, "le": a <= b, "gt": a > b, "ge": a >= b}[op]


def _band_condition(arrangement: int, op: str, c: int):
    """One comparison of q_idx - kv_idx with c, written in one of several arrangements."""
    forms = [
        lambda q, kv: _compare(op, q - kv, c),
        lambda q, kv: _compare(op, q, kv + c),
        lambda q, kv: _compare(op, -c, kv - q),
        lambda q, kv: _compare(op, q - c, kv),
        lambda q, kv: ~_compare(op, kv - q, -c),
        lambda q, kv: _compare(op, 2 * q - q - kv, c),
    ]
    return forms[arrangement]


@torch_side
@settings(max_examples=120, deadline=None)
@given(conditions=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(_OPS), st.integers(-6, 6)),
                           min_size=1, max_size=3),
       padded=st.booleans(), batch=st.integers(1, 3), seqlen_q=st.integers(1, 12), seqlen_kv=st.integers(1, 12))
def test_generated_bands_and_padding_are_exact(conditions, padded, batch, seqlen_q, seqlen_kv):
    parts = [_band_condition(*c) for c in conditions]
    lengths = torch.tensor([3, 0, 12])[:batch]

    def mask_mod(b, h, q, kv):
        keep = parts[0](q, kv)
        for part in parts[1:]:
            keep = keep & part(q, kv)
        return (keep & (kv < lengths[b])) if padded else keep

    options = _check_native_is_exact(mask_mod, batch, seqlen_q, seqlen_kv)
    forms = flex.trace_mask("torch", mask_mod, torch.device("cpu"))
    assert all(form is not None for _, form in forms.conditions)  # every arrangement was read
    if not padded and options["mask_mod"] is None:
        assert "cu_seqlens_q" not in options


# ------------------------------------------------------------------ the same results through a call

def _select(mask_mod, where):
    """The mask written as a score_mod select: the path the rewrite replaces."""
    return lambda score, b, h, q, kv: where(mask_mod(b, h, q, kv), score, -float("inf"))


def _torch_run(q, k, v, layout, **options):
    result = fat.attention(q, k, v, layout=layout, return_lse=True, **options)
    lse = torch.where(torch.isfinite(result.lse), result.lse, 0.0)
    loss = (result.out * torch.cos(result.out)).sum() + (lse * torch.sin(lse)).sum()
    return result.out, result.lse, torch.autograd.grad(loss, (q, k, v))


CALLS = [  # (name, batch, Sq, Skv, heads_q, heads_kv, layout)
    ("causal", 3, 17, 17, 4, 2, "bshd"),
    ("causal", 3, 5, 19, 2, 2, "bhsd"),
    ("sliding", 3, 19, 19, 2, 1, "sbhd"),
    ("two_sided", 3, 7, 15, 2, 2, "bshd"),
    ("shifted", 3, 15, 7, 2, 2, "bshd"),
    ("key_padding", 3, 13, 21, 2, 2, "bshd"),
    ("both_padding", 3, 21, 21, 2, 2, "bhsd"),
    ("padded_causal", 3, 21, 21, 4, 1, "bshd"),
    ("padded_window", 3, 9, 9, 2, 2, "bshd"),
    ("constant_length", 3, 1, 9, 2, 2, "bshd"),
    ("prefix_lm", 3, 9, 9, 2, 2, "bshd"),
]


def _shape(layout, batch, seqlen, heads, dim=8):
    return {"bshd": (batch, seqlen, heads, dim), "bhsd": (batch, heads, seqlen, dim),
            "sbhd": (seqlen, batch, heads, dim)}[layout]


_EXTRAS = {  # options whose meaning depends on the mask a rewrite picks (ALiBi's diagonal, a sink's rows)
    "none": {},
    "alibi": {"alibi_slopes": torch.tensor([0.5, 0.25], dtype=torch.float64)} if HAS_TORCH else {},
    "learnable": {"softmax_type": "learnable",
                  "sink": torch.tensor([0.3, -1.0], dtype=torch.float64)} if HAS_TORCH else {},
    "off_by_one": {"softmax_type": "off_by_one"},
}


@torch_side
@settings(max_examples=80, deadline=None)
@given(conditions=st.lists(st.tuples(st.integers(0, 5), st.sampled_from(_OPS), st.integers(-6, 6)), max_size=2),
       q_length=st.booleans(), kv_length=st.booleans(), extra=st.sampled_from(sorted(_EXTRAS)),
       batch=st.integers(1, 3), seqlen_q=st.integers(1, 10), seqlen_kv=st.integers(1, 10))
def test_generated_rewrites_with_alibi_and_sinks_give_what_the_select_gives(conditions, q_length, kv_length, extra,
                                                                          batch, seqlen_q, seqlen_kv):
    """A rewritten mask_mod means what its select means with ALiBi slopes (distances from the mask's
    diagonal) and sinks (rows without keys keep the sink's term): out, LSE and gradients, float64. (Both
    once differed: found by an independent sweep.)"""
    parts = [_band_condition(*c) for c in conditions]
    lengths_q, lengths_kv = torch.tensor([2, 0, 9])[:batch], torch.tensor([3, 10, 0])[:batch]

    def mask_mod(b, h, q, kv):
        keep = q >= 0
        for part in parts:
            keep = keep & part(q, kv)
        if q_length:
            keep = keep & (q < lengths_q[b])
        return (keep & (kv < lengths_kv[b])) if kv_length else keep

    gen = torch.Generator().manual_seed(seqlen_q * 16 + seqlen_kv)
    q = torch.randn(batch, seqlen_q, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_kv, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    options = _EXTRAS[extra]
    native = _torch_run(q, k, v, "bshd", mask_mod=mask_mod, **options)
    select = _torch_run(q, k, v, "bshd", score_mod=_select(mask_mod, torch.where), **options)
    torch.testing.assert_close(native[0], select[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(native[1], select[1], rtol=1e-10, atol=1e-10)
    for a, b in zip(native[2], select[2]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@torch_side
@pytest.mark.parametrize("call", CALLS, ids=[f"{c[0]}-{c[2]}x{c[3]}-{c[6]}" for c in CALLS])
def test_a_torch_call_gives_what_the_select_gives(call):
    name, batch, seqlen_q, seqlen_kv, heads_q, heads_kv, layout = call
    mask_mod = _masks(LENGTHS)[name][0]
    gen = torch.Generator().manual_seed(len(name) * seqlen_q)
    q = torch.randn(_shape(layout, batch, seqlen_q, heads_q), generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(_shape(layout, batch, seqlen_kv, heads_kv), generator=gen, dtype=torch.float64,
                        requires_grad=True) for _ in range(2))
    native = _torch_run(q, k, v, layout, mask_mod=mask_mod)
    select = _torch_run(q, k, v, layout, score_mod=_select(mask_mod, torch.where))
    torch.testing.assert_close(native[0], select[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(native[1], select[1], rtol=1e-10, atol=1e-10)
    for a, b in zip(native[2], select[2]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@torch_side
def test_a_softcap_with_a_causal_mask_mod_keeps_the_softcap():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 11, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def softcap(score, b, h, q_idx, kv_idx):
        return 2.0 * torch.tanh(score / 2.0)

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    native = _torch_run(q, k, v, "bshd", score_mod=softcap, mask_mod=causal)
    select = _torch_run(q, k, v, "bshd", score_mod=lambda s, b, h, qi, ki: torch.where(
        qi >= ki, softcap(s, b, h, qi, ki), -float("inf")))
    for a, b in zip([native[0], native[1], *native[2]], [select[0], select[1], *select[2]]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", ["causal", "sliding", "both_padding", "padded_causal", "prefix_lm"])
def test_a_jitted_jax_call_gives_what_the_select_gives(name):
    jax.config.update("jax_enable_x64", True)
    try:
        mask_mod = _masks(jnp.asarray(LENGTH_VALUES))[name][0]
        keys = jax.random.split(jax.random.key(7), 3)
        q, k, v = (jax.random.normal(key, (3, 13, 2, 8), jnp.float64) for key in keys)

        def loss(q, k, v, **options):
            result = fj.attention(q, k, v, return_lse=True, **options)
            lse = jnp.where(jnp.isfinite(result.lse), result.lse, 0.0)
            return (result.out * jnp.cos(result.out)).sum() + (lse * jnp.sin(lse)).sum()

        native = jax.jit(jax.value_and_grad(lambda *x: loss(*x, mask_mod=mask_mod), argnums=(0, 1, 2)))(q, k, v)
        # Both jitted: XLA's own sin/cos differ from the eager ones in the last bits of float64.
        select = jax.jit(jax.value_and_grad(lambda *x: loss(*x, score_mod=_select(mask_mod, jnp.where)),
                                            argnums=(0, 1, 2)))(q, k, v)
        np.testing.assert_allclose(native[0], select[0], rtol=1e-10)
        for a, b in zip(native[1], select[1]):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-9)
    finally:
        jax.config.update("jax_enable_x64", False)


@torch_side
def test_explain_shows_the_native_mask():
    q = torch.randn(1, 16, 2, 8)
    text = fat.explain(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx <= 4))
    assert "mask=causal" in text and "window=(4, 0)" in text


@torch_side
def test_a_call_that_names_a_mask_keeps_its_mask_mod_in_the_graph():
    q = torch.zeros(1, 8, 2, 4)
    mask_mod = _masks(LENGTHS)["causal"][0]
    options, _ = rewrite_mask("torch", q, q, q, {"mask_mod": mask_mod, "mask": "causal"}, document_ok=True)
    assert options["mask_mod"] is mask_mod and options["mask"] == "causal" and "window" not in options


@torch_side
def test_the_kept_part_is_one_object_per_shape():
    """The warm path's signature names the mask_mod by identity: the same call must pass the same object."""
    mask_mod = _masks(LENGTHS)["prefix_lm"][0]
    first = _rewritten(lambda b, h, q, kv: (kv < 4) | (q >= kv), 1, 8, 8)["mask_mod"]
    assert first is not None
    assert _rewritten(mask_mod, 1, 8, 8)["mask_mod"] is _rewritten(mask_mod, 1, 8, 8)["mask_mod"]


# ------------------------------------------------------------------ repeat calls keep their rewrite

def _counted_rewrites(monkeypatch) -> list:
    from fusedattn.torch import functional

    made = []
    original = functional.rewrite_mask
    monkeypatch.setattr(functional, "rewrite_mask", lambda *a, **kw: made.append(1) or original(*a, **kw))
    return made


@torch_side
def test_a_repeat_call_keeps_its_rewrite_until_the_mask_mod_reads_other_objects(monkeypatch):
    """A kept rewrite (torch/mask_rewrites.py) serves repeat calls; a closure that now holds another window
    is rewritten again, and every call agrees with the same mask written as a select."""
    made = _counted_rewrites(monkeypatch)
    window = 3

    def sliding(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

    gen = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 13, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    results = [_torch_run(q, k, v, "bshd", mask_mod=sliding) for _ in range(3)]
    assert len(made) == 1
    narrow = _torch_run(q, k, v, "bshd", score_mod=_select(sliding, torch.where))
    window = 1  # the closure cell holds another int now: rewritten again, never the kept window
    made.clear()
    wide = [_torch_run(q, k, v, "bshd", mask_mod=sliding) for _ in range(2)]
    assert len(made) == 1
    select = _torch_run(q, k, v, "bshd", score_mod=_select(sliding, torch.where))
    for got, want in ((results[0], narrow), (results[2], narrow), (wide[1], select)):
        for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(results[0][0], wide[1][0])
    made.clear()
    shorter = [x[:, :9].detach().requires_grad_(True) for x in (q, k, v)]
    _torch_run(*shorter, "bshd", mask_mod=sliding)
    assert len(made) == 1  # another shape: another signature, rewritten


@torch_side
def test_padding_lengths_from_a_tensor_are_rewritten_every_call(monkeypatch):
    """Lengths computed from a captured tensor are not kept: an in-place change must show in the next call."""
    made = _counted_rewrites(monkeypatch)
    lengths = torch.tensor([5, 11])

    def key_padding(b, h, q_idx, kv_idx):
        return kv_idx < lengths[b]

    gen = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 11, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    first = _torch_run(q, k, v, "bshd", mask_mod=key_padding)
    lengths[0] = 2
    second = _torch_run(q, k, v, "bshd", mask_mod=key_padding)
    assert len(made) == 2
    select = _torch_run(q, k, v, "bshd", score_mod=_select(key_padding, torch.where))
    torch.testing.assert_close(second[0], select[0], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(first[0], second[0])


@torch_side
def test_a_rewrite_that_made_tensors_is_never_kept():
    """Offsets computed from a captured tensor (trusted on a GPU, so the call has a signature) stay per call."""
    from fusedattn.torch import mask_rewrites

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < LENGTHS[b]

    before = {"mask_mod": mask_mod}
    mask_rewrites.remember(("made tensors",), before, {**before, "mask": "padding", "cu_seqlens_kv": LENGTHS},
                           ("rewritten",))
    assert mask_rewrites.recall(("made tensors",), before) is None
    mask_rewrites.remember(("made none",), before, {**before, "mask": "causal", "mask_mod": None}, ("rewritten",))
    options, signature, documents = mask_rewrites.recall(("made none",), before)
    assert options == {"mask_mod": None, "mask": "causal"} and signature == ("rewritten",) and documents is None


# ------------------------------------------------------------------ document masks as THD

def _counted(monkeypatch, module, name: str) -> list:
    """A list that gets one item per call of module.name (which still runs)."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or original(*a))
    return calls


def _document_ids(batch, seqlen, seed, sort=True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 4, (batch, seqlen), generator=gen)
    return torch.sort(ids, dim=1).values if sort else ids


@torch_side
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True])
def test_a_document_mask_runs_as_thd_and_agrees(layout, causal, monkeypatch):
    batch, seqlen = 3, 23
    ids = _document_ids(batch, seqlen, 5)
    reads = _counted(monkeypatch, documents_thd, "_read")

    def mask_mod(b, h, q_idx, kv_idx):
        same = ids[b, q_idx] == ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(_shape(layout, batch, seqlen, 2), generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    assert "layout=thd" in fat.explain(q, k, v, layout=layout, mask_mod=mask_mod)
    native = _torch_run(q, k, v, layout, mask_mod=mask_mod)
    native_again = _torch_run(q, k, v, layout, mask_mod=mask_mod)
    select = _torch_run(q, k, v, layout, score_mod=_select(mask_mod, torch.where))
    assert len(reads) == 1  # the ids were read once for three calls
    assert native[0].shape == select[0].shape and native[1].shape == select[1].shape
    for a, b, c in zip([native[0], native[1], *native[2]], [select[0], select[1], *select[2]],
                       [native_again[0], native_again[1], *native_again[2]]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


@torch_side
@pytest.mark.parametrize("reads", ["score and h", "q_idx", "b"])
def test_a_document_mask_with_a_score_mod_of_the_score_and_h_runs_as_thd(reads):
    """A score_mod that reads only the score and h (a per-head softcap) means the same in the documents' THD
    call, so the pair runs as THD; one that reads a position or b (others there) keeps the dense select.
    Either way out, LSE and gradients equal the mask written as a select beside the score_mod."""
    batch, seqlen = 3, 23
    ids = _document_ids(batch, seqlen, 7)
    caps = torch.tensor([3.0, 5.0], dtype=torch.float64)
    score_mod = {"score and h": lambda s, b, h, q, kv: caps[h] * torch.tanh(s / caps[h]),
                 "q_idx": lambda s, b, h, q, kv: s + 0.1 * q,
                 "b": lambda s, b, h, q, kv: s * (1.0 + 0.5 * b)}[reads]

    def mask_mod(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)

    gen = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(_shape("bshd", batch, seqlen, 2), generator=gen, dtype=torch.float64,
                           requires_grad=True) for _ in range(3))
    native = _torch_run(q, k, v, "bshd", mask_mod=mask_mod, score_mod=score_mod)
    assert ("layout=thd" in fat.explain(q, k, v, mask_mod=mask_mod, score_mod=score_mod)) == (reads == "score and h")
    selected = _select(mask_mod, torch.where)
    select = _torch_run(q, k, v, "bshd", score_mod=lambda s, b, h, q_, kv: selected(score_mod(s, b, h, q_, kv), b,
                                                                                     h, q_, kv))
    for a, c in zip([native[0], native[1], *native[2]], [select[0], select[1], *select[2]]):
        torch.testing.assert_close(a, c, rtol=1e-9, atol=1e-9)


def test_a_jax_document_mask_with_a_per_head_softcap_runs_as_thd(monkeypatch, x64):
    import fusedattn.jax.functional as jax_functional

    batch, seqlen = 3, 23
    ids = jnp.asarray(_jax_documents(batch, seqlen, 9))
    caps = jnp.asarray([3.0, 5.0])
    thd = _counted(monkeypatch, jax_functional, "call_as_thd")

    def score_mod(s, b, h, q_idx, kv_idx):
        return caps[h] * jnp.tanh(s / caps[h])

    def mask_mod(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    q, k, v = (jnp.asarray(np.random.default_rng(20 + i).standard_normal(_shape("bshd", batch, seqlen, 2)))
               for i in range(3))
    native = _jax_run(q, k, v, "bshd", mask_mod=mask_mod, score_mod=score_mod)
    assert thd, "the document mask with a softcap did not run as THD"
    selected = _select(mask_mod, jnp.where)
    select = _jax_run(q, k, v, "bshd", score_mod=lambda s, b, h, q_, kv: selected(score_mod(s, b, h, q_, kv), b, h,
                                                                                   q_, kv))
    _assert_runs_agree(native, select)


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=torch_side), "jax"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
def test_tokens_round_trip_and_bshd_is_one_view(framework, layout):
    """A document call's tokens: (B*S, H, D) batch-major from every dense layout and back (and its LSE);
    for BSHD in torch one view of the same memory (its backward is one node), also for q sliced from a
    packed QKV tensor."""
    from fusedattn.layout import dense_to_tokens, lse_tokens_to_dense, tokens_to_dense

    batch, seqlen, heads, dim = 3, 5, 2, 4
    packed = np.random.default_rng(0).standard_normal((batch, seqlen, 3, heads, dim))
    packed = torch.tensor(packed) if framework == "torch" else jnp.asarray(packed)
    bshd = packed[:, :, 0]  # not contiguous
    moved = {"bshd": (1, 1), "bhsd": (2, 1), "sbhd": (1, 0)}[layout]
    x = bshd if layout == "bshd" else (bshd.movedim if framework == "torch" else
                                       lambda *a: jnp.moveaxis(bshd, *a))(*moved)
    tokens = dense_to_tokens(x, layout)
    assert tokens.shape == (batch * seqlen, heads, dim)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(bshd).reshape(batch * seqlen, heads, dim))
    np.testing.assert_array_equal(np.asarray(tokens_to_dense(tokens, layout, batch)), np.asarray(x))
    lse = tokens[:, :, 0]  # (T, H): row t = b * S + s
    np.testing.assert_array_equal(np.asarray(lse_tokens_to_dense(lse, batch)),
                                  np.moveaxis(np.asarray(bshd)[..., 0], 1, 2))
    if framework == "torch" and layout == "bshd":
        assert tokens.data_ptr() == x.data_ptr() and tokens._base is not None


@torch_side
def test_one_dimensional_document_ids_and_a_changed_tensor():
    seqlen = 17
    ids = torch.tensor([0] * 5 + [1] * 9 + [2] * 3)

    def mask_mod(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, seqlen, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    first = _torch_run(q, k, v, "bshd", mask_mod=mask_mod)
    ids[5:] = 1  # in place: the cached boundaries must not be reused
    changed = _torch_run(q, k, v, "bshd", mask_mod=mask_mod)
    select = _torch_run(q, k, v, "bshd", score_mod=_select(mask_mod, torch.where))
    torch.testing.assert_close(changed[0], select[0], rtol=1e-9, atol=1e-9)
    assert not torch.allclose(first[0], changed[0])


@torch_side
def test_unsorted_document_ids_run_in_the_graph_and_agree():
    batch, seqlen = 2, 15
    ids = _document_ids(batch, seqlen, 9, sort=False)

    def mask_mod(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(batch, seqlen, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    native = _torch_run(q, k, v, "bshd", mask_mod=mask_mod)
    select = _torch_run(q, k, v, "bshd", score_mod=_select(mask_mod, torch.where))
    for a, b in zip([native[0], native[1], *native[2]], [select[0], select[1], *select[2]]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert documents_thd.boundaries(ids, batch, seqlen) is None


def _jax_run(q, k, v, layout, **options):
    """(out, lse, (dq, dk, dv)) of a JAX call, the loss reading out and LSE, as _torch_run."""
    def loss(q, k, v):
        result = fj.attention(q, k, v, layout=layout, return_lse=True, **options)
        lse = jnp.where(jnp.isfinite(result.lse), result.lse, 0.0)
        return (result.out * jnp.cos(result.out)).sum() + (lse * jnp.sin(lse)).sum(), result

    (_, result), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return result.out, result.lse, grads


def _jax_documents(batch: int, seqlen: int, seed: int, sort: bool = True) -> np.ndarray:
    ids = np.random.default_rng(seed).integers(0, 4, (batch, seqlen))
    return np.sort(ids, axis=1) if sort else ids


def _assert_runs_agree(*runs):
    """Outputs to float64 roundings; the LSE and the gradients through it to float32's (the LSE is float32
    by design, and XLA rounds it at other places under jit)."""
    first = runs[0]
    for other in runs[1:]:
        np.testing.assert_allclose(np.asarray(first[0]), np.asarray(other[0]), rtol=1e-9, atol=1e-9)
        for a, b in zip([first[1], *first[2]], [other[1], *other[2]]):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "sbhd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("jit", [False, True])
def test_a_jax_document_mask_runs_as_thd_and_agrees(layout, causal, jit, monkeypatch, x64):
    """Concrete (captured) ids: the call runs as THD, eager and under jit, out, LSE and gradients as the
    mask written as a select."""
    import fusedattn.jax.functional as jax_functional

    batch, seqlen = 3, 23
    ids = jnp.asarray(_jax_documents(batch, seqlen, 5))
    thd = _counted(monkeypatch, jax_functional, "call_as_thd")

    def mask_mod(b, h, q_idx, kv_idx):
        same = ids[b, q_idx] == ids[b, kv_idx]
        return same & (q_idx >= kv_idx) if causal else same

    shape = _shape(layout, batch, seqlen, 2)
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal(shape)) for i in range(3))
    run = jax.jit(_jax_run, static_argnums=3, static_argnames=("mask_mod", "score_mod")) if jit else _jax_run
    native = run(q, k, v, layout, mask_mod=mask_mod)
    assert thd, "the document mask did not run as THD"
    select = _jax_run(q, k, v, layout, score_mod=_select(mask_mod, jnp.where))
    _assert_runs_agree(native, select)


def test_jax_document_offsets_found_in_one_jit_trace_serve_the_next():
    """The first call of the ids is traced by jit; a second trace (other shapes) reuses the kept offsets:
    they must be concrete, not the first trace's tracer."""
    ids = jnp.asarray(_jax_documents(2, 15, 12))

    def mask_mod(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    run = jax.jit(lambda q, k, v: fj.attention(q, k, v, mask_mod=mask_mod))
    for dim in (8, 16):
        q = jnp.asarray(np.random.default_rng(dim).standard_normal((2, 15, 2, dim)), jnp.float32)
        want = fj.attention(q, q, q, score_mod=_select(mask_mod, jnp.where))
        np.testing.assert_allclose(np.asarray(run(q, q, q)), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_jax_document_ids_that_are_traced_or_unsorted_stay_a_select(monkeypatch, x64):
    import fusedattn.jax.functional as jax_functional

    thd = _counted(monkeypatch, jax_functional, "call_as_thd")
    q, k, v = (jnp.asarray(np.random.default_rng(i).standard_normal((2, 15, 2, 8))) for i in range(3))

    def same_document(ids):
        return lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx]

    unsorted = jnp.asarray(_jax_documents(2, 15, 9, sort=False))
    native = _jax_run(q, k, v, "bshd", mask_mod=same_document(unsorted))
    _assert_runs_agree(native, _jax_run(q, k, v, "bshd", score_mod=_select(same_document(unsorted), jnp.where)))

    sorted_ids = jnp.asarray(_jax_documents(2, 15, 10))
    traced = jax.jit(lambda ids, q, k, v: _jax_run(q, k, v, "bshd", mask_mod=same_document(ids)))(sorted_ids, q, k, v)
    _assert_runs_agree(traced, _jax_run(q, k, v, "bshd", score_mod=_select(same_document(sorted_ids), jnp.where)))
    assert thd == []


def test_a_document_mask_is_recognized_in_jax_too():
    ids = jnp.asarray([0, 0, 1, 1, 1])
    forms = flex.trace_mask("jax", lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])
    assert [form for _, form in forms.conditions] == [Document(0, batched=False)]


@torch_side
def test_a_mask_mod_made_anew_at_each_call_keeps_its_rewrite(monkeypatch):
    """A closure written inside a model's forward is a new function each call with the same code and
    reads: it finds the kept rewrite, and one that reads another number is rewritten and gives its own mask."""
    made = _counted_rewrites(monkeypatch)

    def sliding(window):
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

    gen = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(2, 11, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    first = [_torch_run(q, k, v, "bshd", mask_mod=sliding(2)) for _ in range(3)]
    assert len(made) == 1
    other = _torch_run(q, k, v, "bshd", mask_mod=sliding(5))
    assert len(made) == 2
    again = _torch_run(q, k, v, "bshd", mask_mod=sliding(2))
    assert len(made) == 2  # each window keeps its own rewrite
    for got, window in ((first[2], 2), (other, 5), (again, 2)):
        want = _torch_run(q, k, v, "bshd", score_mod=_select(sliding(window), torch.where))
        for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@torch_side
def test_a_document_mask_keeps_its_rewrite_and_follows_its_ids(monkeypatch):
    """A repeat document call (a closure made anew too) reuses its rewrite: the ids are read once; an in-place
    change that unsorts them runs the mask as a select, and one that sorts them again runs as THD again."""
    made = _counted_rewrites(monkeypatch)
    batch, seqlen = 2, 19
    ids = _document_ids(batch, seqlen, 4)

    def documents(ids):
        return lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx]

    gen = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(batch, seqlen, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    runs = [_torch_run(q, k, v, "bshd", mask_mod=documents(ids)) for _ in range(3)]
    assert len(made) == 1
    select = _torch_run(q, k, v, "bshd", score_mod=_select(documents(ids), torch.where))
    sorted_ids = ids.clone()
    ids.copy_(ids.flip(1))  # unsorted rows: no longer THD
    unsorted = _torch_run(q, k, v, "bshd", mask_mod=documents(ids))
    unsorted_select = _torch_run(q, k, v, "bshd", score_mod=_select(documents(ids), torch.where))
    ids.copy_(sorted_ids)
    back = _torch_run(q, k, v, "bshd", mask_mod=documents(ids))
    assert len(made) == 1
    for got, want in ((runs[2], select), (unsorted, unsorted_select), (back, select)):
        for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(unsorted[0], runs[0][0])


@torch_side
@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
@pytest.mark.parametrize("scored", [False, True], ids=["mask", "with_softcap"])
def test_a_kept_document_call_goes_to_the_operator_in_one_attention_call(layout, scored, monkeypatch):
    """The warm document path: with its rewrite kept and its THD plan known, a repeat call reaches the native
    operator without a second attention() (functional._DOCUMENT_CALLS), with the THD call's own plan, tokens
    and offsets, and gives what the full way gives; new boundaries (ids changed in place) take the full way
    once, then the short one. The operator is stubbed and the tensors pass as GPU ones (its offsets are then
    trusted, as on a GPU). With a softcap beside the documents (scored), the repeat calls take the binding
    kept for the THD call, and a new cap reaches the operator as its scalar."""
    from fusedattn.torch import functional

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(functional, "_native_plan_on", lambda cfg, name, device: 7)
    seen = []

    def operator(plan, q, k, v, sink, seed, offset, *extra):  # as the operator answers a THD plan (tokens or rows)
        seen.append((plan, tuple(q.shape), extra[-1][0].tolist(), list(extra[2]) if len(extra) > 2 else None))
        lse = q[..., 0].float() * 3
        return (q * 2 + k - v).clone(), lse.permute(0, 2, 1) if q.dim() == 4 else lse

    monkeypatch.setattr(functional, "_operator", operator)
    inner, attention = [], functional.attention  # the module's own name: the THD call's way in
    monkeypatch.setattr(functional, "attention", lambda *a, **kw: inner.append(1) or attention(*a, **kw))
    batch, seqlen = 2, 19
    ids = _document_ids(batch, seqlen, 4)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(_shape(layout, batch, seqlen, 2), generator=gen) for _ in range(3))

    cap = [7.0]

    def softcap(score, b, h, i, j):
        return cap[0] * torch.tanh(score / cap[0])

    def run():
        return fat.attention(q, k, v, layout=layout, mask_mod=lambda b, h, i, j: ids[b, i] == ids[b, j],
                             return_lse=True, **({"score_mod": softcap} if scored else {}))

    first = run()
    assert len(inner) == 1 and seen[-1][1] == (batch * seqlen, 2, 8)  # the full way: the THD call's tokens
    offsets = seen[-1][2]
    assert offsets[0] == 0 and offsets[-1] == batch * seqlen and len(offsets) > batch + 1
    repeats = [run() for _ in range(3)]
    assert len(inner) == 1 and len(seen) == 4 and all(s[2] == offsets for s in seen)
    assert seen[-1][1] == ((batch, seqlen, 2, 8) if layout == "bshd" else (batch * seqlen, 2, 8))  # BSHD: its rows
    for got in repeats:
        torch.testing.assert_close(got.out, first.out, rtol=0, atol=0)
        torch.testing.assert_close(got.lse, first.lse, rtol=0, atol=0)
    want = 2 * q + k - v  # what the stub gives, back in the caller's layout
    torch.testing.assert_close(first.out, want, rtol=0, atol=0)
    if scored:
        assert 7.0 in seen[-1][3]
        cap[0] = 5.0  # the kept binding's check sees the new number: bound again (the full way once), then kept
        run(), run()
        assert 5.0 in seen[-1][3] and 7.0 not in seen[-1][3] and len(inner) == 2
        inner.clear()
    ids.copy_(torch.sort(_document_ids(batch, seqlen, 9), dim=1).values)
    changed = [run() for _ in range(2)]
    assert len(inner) == (1 if scored else 2) and seen[-1][2] != offsets and seen[-1][2] == seen[-2][2]
    torch.testing.assert_close(changed[1].out, want, rtol=0, atol=0)
