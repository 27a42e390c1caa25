"""fusedattn.layout (specs, packing views, BHSD views, THD <-> padded, offsets helpers) and
AttentionConfig's value semantics (frozen, hashable, normalised, summary)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from needs_torch import requires_torch

from fusedattn import AttentionConfig, Layout, Mask
from fusedattn.layout import (
    check_cu_seqlens,
    cu_seqlens_to_segment_ids,
    from_bhsd,
    layout_spec,
    padded_to_thd,
    segment_ids_to_cu_seqlens,
    split_packed,
    thd_to_padded,
    to_bhsd,
)

jax = pytest.importorskip("jax")
jnp = jax.numpy

torch_tensors = requires_torch("checks the helpers on torch tensors")


def to_framework(framework, array, dtype=None):
    array = np.asarray(array) if dtype is None else np.asarray(array, dtype=dtype)
    if framework == "torch":
        import torch

        return torch.from_numpy(array.copy())
    return jnp.asarray(array)


def to_numpy(x):
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)  # torch tensors have .detach


FRAMEWORKS = [pytest.param("torch", marks=torch_tensors), "jax"]

# --------------------------------------------------------------------------- layout_spec

SPECS = {
    "bshd": ((("q", "BSHD"), ("k", "BSHD"), ("v", "BSHD")), "bshd"),
    "sbhd": ((("q", "SBHD"), ("k", "SBHD"), ("v", "SBHD")), "sbhd"),
    "bhsd": ((("q", "BHSD"), ("k", "BHSD"), ("v", "BHSD")), "bhsd"),
    "thd": ((("q", "THD"), ("k", "THD"), ("v", "THD")), "thd"),
    "bs3hd": ((("qkv", "BS3HD"),), "bshd"),
    "sb3hd": ((("qkv", "SB3HD"),), "sbhd"),
    "t3hd": ((("qkv", "T3HD"),), "thd"),
    "bshd_bs2hd": ((("q", "BSHD"), ("kv", "BS2HD")), "bshd"),
    "sbhd_sb2hd": ((("q", "SBHD"), ("kv", "SB2HD")), "sbhd"),
    "thd_t2hd": ((("q", "THD"), ("kv", "T2HD")), "thd"),
}


def test_every_layout_has_a_spec():
    assert set(SPECS) == {layout.value for layout in Layout}


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_layout_spec(layout):
    tensors, base = SPECS[layout]
    spec = layout_spec(layout)
    assert spec.layout is Layout(layout)
    assert spec.tensors == tensors
    assert spec.base is Layout(base)
    assert spec.names == tuple(name for name, _ in tensors)
    assert layout_spec(Layout(layout)) is spec
    assert spec.layout.is_ragged == layout.startswith("t")


def test_layout_spec_unknown_name():
    with pytest.raises(ValueError, match=r"layout: expected one of .* got 'bsh3d'"):
        layout_spec("bsh3d")


# --------------------------------------------------------------------------- split_packed

# (layout, shapes of the tensors the layout takes, packing axis per tensor or None)
PACKED = [
    ("bs3hd", [(2, 5, 3, 4, 8)], [2]),
    ("sb3hd", [(5, 2, 3, 4, 8)], [2]),
    ("t3hd", [(7, 3, 4, 8)], [1]),
    ("bshd_bs2hd", [(2, 5, 4, 8), (2, 6, 2, 2, 8)], [None, 2]),
    ("sbhd_sb2hd", [(5, 2, 4, 8), (6, 2, 2, 2, 8)], [None, 2]),
    ("thd_t2hd", [(7, 4, 8), (9, 2, 2, 8)], [None, 1]),
]


def _expected_split(arrays, axes):
    out = []
    for x, axis in zip(arrays, axes):
        if axis is None:
            out.append(x)
        else:
            out.extend(np.take(x, i, axis=axis) for i in range(x.shape[axis]))
    return out


@pytest.mark.parametrize("layout, shapes, axes", PACKED, ids=[p[0] for p in PACKED])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_split_packed_slices(framework, layout, shapes, axes):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    got = split_packed(layout, [to_framework(framework, a) for a in arrays])
    expected = _expected_split(arrays, axes)
    assert len(got) == 3
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(to_numpy(g), e)


@torch_tensors
@pytest.mark.parametrize("layout, shapes, axes", PACKED, ids=[p[0] for p in PACKED])
def test_split_packed_torch_returns_views(layout, shapes, axes):
    import torch

    tensors = [torch.randn(shape) for shape in shapes]
    got = list(split_packed(layout, tensors))
    position = 0
    for x, axis in zip(tensors, axes):
        parts = 1 if axis is None else x.shape[axis]
        for i in range(parts):
            part = got[position]
            position += 1
            if axis is None:
                assert part is x
                continue
            assert part.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
            assert part.data_ptr() == x.data_ptr() + i * x.stride(axis) * x.element_size()
    # a write through a view lands in the packed tensor: nothing was copied
    got[-1].fill_(7.0)
    packed, axis = tensors[-1], axes[-1]
    assert (packed.select(axis, packed.shape[axis] - 1) == 7.0).all()


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "thd"])
def test_split_unpacked_layouts_return_the_same_tensors(layout):
    tensors = [jnp.zeros((2, 3, 4, 5)) for _ in range(3)]
    got = split_packed(layout, tensors)
    assert all(g is t for g, t in zip(got, tensors))


# --------------------------------------------------------------------------- to_bhsd / from_bhsd

PERMUTATIONS = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3), "bhsd": (0, 1, 2, 3)}


@pytest.mark.parametrize("base", sorted(PERMUTATIONS))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_to_bhsd_and_back(framework, base):
    array = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    x = to_framework(framework, array)
    bhsd = to_bhsd(x, base)
    np.testing.assert_array_equal(to_numpy(bhsd), array.transpose(PERMUTATIONS[base]))
    back = from_bhsd(bhsd, base)
    np.testing.assert_array_equal(to_numpy(back), array)
    np.testing.assert_array_equal(to_numpy(from_bhsd(x, base)),
                                  array.transpose(np.argsort(PERMUTATIONS[base])))


@torch_tensors
@pytest.mark.parametrize("base", sorted(PERMUTATIONS))
def test_to_bhsd_torch_is_a_view(base):
    import torch

    x = torch.randn(2, 3, 4, 5)
    assert to_bhsd(x, base).data_ptr() == x.data_ptr()
    assert from_bhsd(to_bhsd(x, base), base).data_ptr() == x.data_ptr()


@pytest.mark.parametrize("function", [to_bhsd, from_bhsd])
def test_bhsd_rejects_thd(function):
    with pytest.raises(ValueError, match=r"expected layout bshd, sbhd or bhsd, got 'thd'"):
        function(jnp.zeros((2, 3, 4)), "thd")


# --------------------------------------------------------------------------- THD <-> padded

def naive_thd_to_padded(x, cu, max_seqlen, padded=None):
    starts = (padded if padded is not None else cu)[:-1]
    lengths = np.diff(cu)
    out = np.zeros((len(lengths), max_seqlen) + x.shape[1:], x.dtype)
    for b, (start, length) in enumerate(zip(starts, lengths)):
        out[b, :length] = x[start:start + length]
    return out


def naive_padded_to_thd(y, cu, total, padded=None):
    starts = (padded if padded is not None else cu)[:-1]
    lengths = np.diff(cu)
    out = np.zeros((total,) + y.shape[2:], y.dtype)
    for b, (start, length) in enumerate(zip(starts, lengths)):
        out[start:start + length] = y[b, :length]
    return out


# (id, cu_seqlens, padded offsets or None, total tokens, max_seqlen)
THD_CASES = [
    ("uneven", [0, 3, 8, 9], None, 9, 5),
    ("zero-length-middle", [0, 3, 3, 8], None, 8, 5),
    ("zero-length-first-and-last", [0, 0, 4, 6, 6], None, 6, 4),
    ("trailing-tokens", [0, 2, 5], None, 8, 3),
    ("max-seqlen-larger", [0, 2, 5], None, 5, 7),
    ("padded-gaps", [0, 3, 3, 8], [0, 4, 6, 12], 12, 5),
    ("padded-gap-first", [0, 2, 4], [1, 4, 8], 9, 2),
    ("padded-zero-length-shared-start", [0, 3, 3, 5], [0, 4, 4, 7], 8, 3),
    ("single", [0, 4], None, 4, 4),
    ("all-empty", [0, 0, 0], None, 3, 2),
]


@pytest.mark.parametrize("cu, padded, total, max_seqlen", [c[1:] for c in THD_CASES], ids=[c[0] for c in THD_CASES])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_thd_padded_round_trip(framework, cu, padded, total, max_seqlen):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((total, 2, 3)).astype(np.float32) + 10.0  # no accidental zeros
    cu_np = np.asarray(cu, np.int32)
    padded_np = None if padded is None else np.asarray(padded, np.int32)
    to = lambda a: None if a is None else to_framework(framework, a)  # noqa: E731

    def convert(x, cu, padded):
        y = thd_to_padded(x, cu, max_seqlen, padded)
        return y, padded_to_thd(y, cu, total, padded)

    if framework == "jax":
        convert = jax.jit(convert)  # also proves the conversions trace (and keeps the test fast)
    y, back = convert(to(x), to(cu_np), to(padded_np))
    expected_y = naive_thd_to_padded(x, cu_np, max_seqlen, padded_np)
    np.testing.assert_array_equal(to_numpy(y), expected_y)
    expected_back = naive_padded_to_thd(expected_y, cu_np, total, padded_np)
    np.testing.assert_array_equal(to_numpy(back), expected_back)
    # tokens inside a sequence come back unchanged; gap and trailing tokens come back 0
    inside = expected_back != 0
    np.testing.assert_array_equal(to_numpy(back)[inside], x[inside])
    assert not to_numpy(back)[~inside].any()


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_thd_with_no_tokens(framework):
    cu = to_framework(framework, np.zeros(3, np.int32))
    x = to_framework(framework, np.zeros((0, 2, 3), np.float32))
    y = thd_to_padded(x, cu, 4)
    assert tuple(y.shape) == (2, 4, 2, 3) and not to_numpy(y).any()
    assert tuple(padded_to_thd(y, cu, 0).shape) == (0, 2, 3)


@torch_tensors
def test_thd_conversions_torch_gradients():
    import torch

    cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    padded = torch.tensor([0, 4, 6, 12], dtype=torch.int32)
    x = torch.randn(12, 2, requires_grad=True)
    y = thd_to_padded(x, cu, 5, padded)
    weight = torch.randn_like(y)
    (y * weight).sum().backward()
    expected = torch.zeros(12, 2)
    expected[0:3] = weight[0, :3]
    expected[6:11] = weight[2, :5]
    torch.testing.assert_close(x.grad, expected)

    y2 = torch.randn(3, 5, 2, requires_grad=True)
    t = padded_to_thd(y2, cu, 12, padded)
    weight2 = torch.randn_like(t)
    (t * weight2).sum().backward()
    expected2 = torch.zeros(3, 5, 2)
    expected2[0, :3] = weight2[0:3]
    expected2[2, :5] = weight2[6:11]
    torch.testing.assert_close(y2.grad, expected2)


def test_thd_conversions_jax_gradients():
    cu = jnp.asarray([0, 3, 3, 8], jnp.int32)
    x = jnp.arange(8 * 2, dtype=jnp.float32).reshape(8, 2)
    weight = jnp.asarray(np.random.default_rng(2).standard_normal((3, 5, 2)), jnp.float32)
    grad = jax.jit(jax.grad(lambda x: (thd_to_padded(x, cu, 5) * weight).sum()))(x)
    expected = np.zeros((8, 2), np.float32)
    expected[0:3] = weight[0, :3]
    expected[3:8] = weight[2, :5]
    np.testing.assert_allclose(np.asarray(grad), expected)


@requires_torch("the property runs on torch tensors, eagerly (JAX would compile every example)")
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=1, max_size=5),
       gaps=st.lists(st.integers(0, 3), min_size=6, max_size=6),
       use_padded=st.booleans())
def test_thd_round_trip_property(lengths, gaps, use_padded):
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    if use_padded:
        padded = np.concatenate([[gaps[0]], gaps[0] + np.cumsum(np.asarray(lengths) + gaps[1:len(lengths) + 1])])
        total = int(padded[-1]) + gaps[-1]
    else:
        padded, total = None, int(cu[-1]) + gaps[-1]
    import torch

    max_seqlen = max(lengths) + gaps[0] % 2
    x = np.arange(1, total * 2 + 1, dtype=np.float64).reshape(total, 2)
    t = lambda a: None if a is None else torch.from_numpy(np.asarray(a))  # noqa: E731
    y = thd_to_padded(t(x), t(cu), max_seqlen, t(padded))
    np.testing.assert_array_equal(y.numpy(), naive_thd_to_padded(x, cu, max_seqlen, padded))
    back = padded_to_thd(y, t(cu), total, t(padded))
    np.testing.assert_array_equal(back.numpy(), naive_padded_to_thd(y.numpy(), cu, total, padded))


# --------------------------------------------------------------------------- segment ids <-> cu_seqlens

# (id, segment ids, batch, cu_seqlens)
SEGMENT_CASES = [
    ("plain", [0, 0, 1, 1, 1, 2], 3, [0, 2, 5, 6]),
    ("zero-length", [0, 0, 2, 2, 2], 3, [0, 2, 2, 5]),
    ("trailing-padding", [0, 0, 2, 2, 2, 3, 3], 3, [0, 2, 2, 5]),
    ("leading-empty", [1, 1, 1], 2, [0, 0, 3]),
    ("all-padding", [2, 2], 2, [0, 0, 0]),
]


@pytest.mark.parametrize("ids, batch, cu", [c[1:] for c in SEGMENT_CASES], ids=[c[0] for c in SEGMENT_CASES])
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_segment_ids_round_trip(framework, ids, batch, cu):
    got_cu = segment_ids_to_cu_seqlens(to_framework(framework, np.asarray(ids, np.int32)), batch)
    np.testing.assert_array_equal(to_numpy(got_cu), cu)
    assert str(to_numpy(got_cu).dtype) == "int32"
    got_ids = cu_seqlens_to_segment_ids(to_framework(framework, np.asarray(cu, np.int32)), len(ids))
    np.testing.assert_array_equal(to_numpy(got_ids), ids)


def test_segment_ids_large_padding_id():
    """Any id >= B marks padding, not only B itself."""
    got = segment_ids_to_cu_seqlens(jnp.asarray([0, 1, 1, 9, 9]), 2)
    assert got.tolist() == [0, 1, 3]


# --------------------------------------------------------------------------- check_cu_seqlens

@pytest.mark.parametrize("cu, total, padded, longest", [
    ([0, 3, 8, 9], 9, None, 5),
    ([0, 3, 3, 8], 10, None, 5),
    ([0, 0], 0, None, 0),
    ([0, 3, 3, 8], 12, [0, 4, 6, 12], 5),
    ([0, 2, 4], 8, [2, 4, 8], 2),
])
def test_check_cu_seqlens_returns_the_longest_sequence(cu, total, padded, longest):
    padded = None if padded is None else np.asarray(padded)
    assert check_cu_seqlens("cu_seqlens_q", np.asarray(cu), total, padded, "cu_seqlens_q_padded") == longest


@pytest.mark.parametrize("cu, total, padded, message", [
    ([[0, 3]], 3, None, "cu_seqlens_q: expected a 1-D tensor of B+1 offsets (B >= 0), got shape (1, 2)"),
    ([], 3, None, "cu_seqlens_q: expected a 1-D tensor of B+1 offsets (B >= 0), got shape (0,)"),
    ([2, 3], 3, None, "cu_seqlens_q: expected the first offset to be 0, got 2"),
    ([0, 5, 3, 6], 9, None, "cu_seqlens_q: expected non-decreasing offsets, got 5 then 3 at index 1"),
    ([0, 3, 10], 9, None, "cu_seqlens_q: last offset 10 exceeds the 9 packed tokens of the tensor"),
    ([0, 3, 6], 9, [0, 3], "cu_seqlens_q_padded: expected shape (3,) like cu_seqlens_q, got (2,)"),
    ([0, 3, 6], 9, [-1, 3, 6], "cu_seqlens_q_padded: expected offsets >= 0, got -1"),
    ([0, 3, 6], 9, [0, 2, 6],
     "cu_seqlens_q_padded: sequence 0 holds 3 tokens but its padded slot [0, 2) has room for 2"),
    ([0, 3, 6], 9, [0, 4, 10], "cu_seqlens_q_padded: last offset 10 exceeds the 9 packed tokens of the tensor"),
    ([0, 0, 0], 9, [0, 4, 3],
     "cu_seqlens_q_padded: expected non-decreasing offsets, got 4 then 3 at index 1"),
], ids=["2d", "no-offset", "first-not-0", "decreasing", "beyond", "padded-shape", "padded-negative",
        "padded-no-room", "padded-beyond", "padded-decreasing"])
def test_check_cu_seqlens_rejects(cu, total, padded, message):
    padded = None if padded is None else np.asarray(padded)
    with pytest.raises(ValueError) as info:
        check_cu_seqlens("cu_seqlens_q", np.asarray(cu), total, padded, "cu_seqlens_q_padded")
    assert str(info.value) == message


# --------------------------------------------------------------------------- AttentionConfig

def cfg(**changes) -> AttentionConfig:
    base = dict(dtype="float16", layout="bshd", batch=2, seqlen_q=8, seqlen_kv=8, heads_q=4, heads_kv=2,
                head_dim_qk=16, head_dim_v=16)
    return AttentionConfig(**{**base, **changes})


def test_config_is_frozen():
    c = cfg()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.batch = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.window = (1, 0)


@pytest.mark.parametrize("a, b", [
    (dict(), dict()),
    (dict(scale=None), dict(scale=0.25)),
    (dict(scale=1), dict(scale=1.0)),
    (dict(mask="causal"), dict(mask=Mask.CAUSAL)),
    (dict(layout="bshd"), dict(layout=Layout.BSHD)),
    (dict(k_dtype=None, v_dtype=None), dict(k_dtype="float16", v_dtype="float16")),
    (dict(mask="causal", window=(-1, -1)), dict(mask="causal", window=(-1, 0))),
    (dict(dropout_p=0), dict(dropout_p=0.0)),
], ids=["same", "default-scale", "int-scale", "mask-enum", "layout-enum", "kv-dtypes", "causal-window",
        "int-dropout"])
def test_equal_configs_hash_equal(a, b):
    x, y = cfg(**a), cfg(**b)
    assert x == y and hash(x) == hash(y)
    assert len({x, y}) == 1


@pytest.mark.parametrize("change", [
    dict(batch=3), dict(mask="causal"), dict(window=(4, 4)), dict(dtype="bfloat16"), dict(is_training=True),
    dict(device="cuda"), dict(framework="jax"), dict(score_mod_key=("tanh", 30.0)), dict(scale=0.5),
    dict(bias="post_scale", bias_shape=(1, 4, 8, 8)), dict(softmax="off_by_one"), dict(deterministic=True),
])
def test_different_configs_differ(change):
    assert cfg() != cfg(**change)
    assert len({cfg(), cfg(**change)}) == 2


@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right", "padding_causal", "padding_causal_bottom_right"])
@pytest.mark.parametrize("window, normal", [((-1, -1), (-1, 0)), ((16, -1), (16, 0)), ((16, 0), (16, 0))])
def test_causal_normalises_window_right_to_zero(mask, window, normal):
    assert cfg(mask=mask, window=window).window == normal


@pytest.mark.parametrize("mask", ["none", "padding"])
def test_non_causal_keeps_the_window(mask):
    assert cfg(mask=mask).window == (-1, -1)
    assert cfg(mask=mask, window=(3, 5)).window == (3, 5)


def test_config_enums_and_defaults_are_normalised():
    c = cfg(mask="padding", scale=None)
    assert c.mask is Mask.PADDING and c.layout is Layout.BSHD
    assert c.scale == 0.25 and isinstance(c.scale, float)
    assert (c.k_dtype, c.v_dtype, c.out_dtype) == ("float16",) * 3
    assert c.gqa_group == 2 and not c.has_window
    assert c.replace(window=(4, 4)).has_window
    assert cfg(mask="padding_causal").mask is Mask.PADDING_CAUSAL


def test_summary_minimal():
    assert cfg().summary() == ("layout=bshd dtype=float16 B=2 Sq=8 Skv=8 Hq=4 Hkv=2 D=16 Dv=16 mask=none "
                               "scale=0.25 training=False device=cpu framework=torch")


def test_summary_everything():
    c = cfg(layout="thd", mask="padding_causal_bottom_right", window=(6, 0), dtype="bfloat16",
            head_dim_v=8, bias="alibi", bias_shape=(2, 4), softmax="learnable", dropout_p=0.1, scale=0.5,
            is_training=True, deterministic=True, return_lse=True, return_max_logit=True, padded_offsets=True,
            score_mod_key=("tanh",), device="cuda", framework="jax")
    assert c.summary() == (
        "layout=thd dtype=bfloat16 B=2 Sq=8 Skv=8 Hq=4 Hkv=2 D=16 Dv=8 mask=padding_causal_bottom_right "
        "window=(6, 0) bias=alibi[2, 4] softmax=learnable dropout_p=0.1 scale=0.5 training=True "
        "deterministic return_lse return_max_logit padded_offsets score_mod device=cuda framework=jax")


@pytest.mark.parametrize("changes, shown", [
    (dict(mask="causal"), None),  # the causal window (-1, 0) is the mask itself: not repeated
    (dict(mask="causal", window=(4, 0)), "window=(4, 0)"),
    (dict(window=(-1, 0)), "window=(-1, 0)"),
    (dict(window=(3, 5)), "window=(3, 5)"),
    (dict(bias="pre_scale", bias_shape=(1, 1, 8, 8)), "bias=pre_scale[1, 1, 8, 8]"),
])
def test_summary_window_and_bias(changes, shown):
    text = cfg(**changes).summary()
    if shown is None:
        assert "window" not in text
    else:
        assert shown in text.split(" mask=")[1]
