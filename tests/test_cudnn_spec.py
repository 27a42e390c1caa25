"""The cuDNN backend's description of a call (no cudnn needed): strides, masks, keys, reasons."""

from __future__ import annotations

import pytest
import torch

from fusedattn.backends import get_backend
from fusedattn.backends.cudnn.spec import (
    gradient_spec,
    graph_key,
    layout_strides,
    sdpa_spec,
    short_reason,
    unsupported,
)
from fusedattn.config import AttentionConfig, BiasType, Layout, Mask, SoftmaxType
from fusedattn.layout import layout_spec, split_packed, to_bhsd

PACKED_QKV = ("bs3hd", "sb3hd")


def cfg_for(layout="bshd", **changes):
    same = layout in PACKED_QKV or layout == "t3hd"
    base = dict(dtype="bfloat16", layout=layout, batch=2, seqlen_q=5, seqlen_kv=5 if same else 7, heads_q=4,
                heads_kv=4 if same else 2, head_dim_qk=8, head_dim_v=8, device="cuda")
    return AttentionConfig(**{**base, **changes})


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd", "bs3hd", "sb3hd", "bshd_bs2hd", "sbhd_sb2hd"])
def test_strides_match_real_tensors_of_the_layout(layout):
    cfg = cfg_for(layout)
    sizes = {"B": cfg.batch, "D": 8, "3": 3, "2": 2}
    tensors = []
    for name, axes in layout_spec(layout).tensors:
        query = name.startswith("q")
        dims = {**sizes, "S": cfg.seqlen_q if query else cfg.seqlen_kv, "H": cfg.heads_q if query else cfg.heads_kv}
        tensors.append(torch.empty([dims[a] for a in axes]))
    for role, x in zip("qkv", split_packed(layout, tensors)):
        view = to_bhsd(x, layout_spec(layout).base)
        spec = layout_strides(cfg, role)
        assert (tuple(view.shape), view.stride()) == (spec.dim, spec.stride)
    out = layout_strides(cfg, "o")
    contiguous = to_bhsd(torch.empty(out.dim).movedim(1, 2).contiguous(), "bshd") if layout.startswith("bs") else None
    if contiguous is not None:
        assert contiguous.stride() == out.stride


@pytest.mark.parametrize("layout", ["bs3hd", "sb3hd", "bshd_bs2hd"])
def test_gradients_are_dense_in_the_same_axis_order(layout):
    cfg = cfg_for(layout)
    for role in "qkv":
        packed = layout_strides(cfg, role)
        dense = gradient_spec(packed)
        order = sorted(range(4), key=lambda a: -packed.stride[a])
        assert sorted(range(4), key=lambda a: -dense.stride[a]) == order
        numel = 1
        for size in dense.dim:
            numel *= size
        assert sum(s * (d - 1) for s, d in zip(dense.stride, dense.dim)) + 1 == numel  # no gaps


@pytest.mark.parametrize("mask,window,sq,skv,top_left,right,left", [
    ("none", (-1, -1), 5, 7, False, None, None),  # no bounds: the alignment is not used
    ("causal", (-1, -1), 5, 7, True, 0, None),
    ("causal", (3, 0), 5, 7, True, 0, 4),  # left bound L masks j <= i - L: a window of 3 keeps 3 earlier keys
    ("causal_bottom_right", (-1, -1), 5, 7, False, 0, None),
    ("causal_bottom_right", (-1, -1), 6, 6, True, 0, None),  # equal lengths: the diagonals coincide
    ("none", (2, 2), 5, 7, False, 2, 3),  # non-causal windows align bottom-right
    ("none", (2, 2), 6, 6, True, 2, 3),
])
def test_masks_and_windows_map_to_cudnn_bounds(mask, window, sq, skv, top_left, right, left):
    spec = sdpa_spec(cfg_for(mask=mask, window=window, seqlen_q=sq, seqlen_kv=skv))
    assert (spec.top_left, spec.right_bound, spec.left_bound) == (top_left, right, left)


def test_bias_broadcast_axes_get_stride_zero():
    spec = sdpa_spec(cfg_for(bias="post_scale", bias_shape=(1, 4, 1, 7)))
    assert spec.bias.dim == (1, 4, 5, 7)
    assert spec.bias.stride[2] == 0 and spec.bias.stride[3] == 1


@pytest.mark.parametrize("changes,needle", [
    (dict(layout="thd", mask="padding", return_max_logit=True), "return_max_logit"),
    (dict(bias="alibi", bias_shape=(4,)), "paper's slopes"),
    (dict(bias="alibi", bias_shape=(4,), alibi_standard=True), "needs mask"),
    (dict(score_mod_key=("eager-callable",)), "score_mod"),
    (dict(batch=65536), "B=65536 > 65535"),
])
def test_unsupported_features_give_reasons(changes, needle):
    reasons = unsupported(cfg_for(**changes))
    assert reasons and needle in " ".join(reasons)
    assert unsupported(cfg_for()) == []


def test_graph_keys_come_from_the_config():
    a, b = cfg_for(), cfg_for()
    assert graph_key(a, "forward", 0) == graph_key(b, "forward", 0)
    assert hash(graph_key(a, "forward", 0)) == hash(graph_key(b, "forward", 0))
    different = {graph_key(a, "forward", 0), graph_key(a, "backward", 0), graph_key(a, "forward", 1),
                 graph_key(cfg_for(scale=0.5), "forward", 0), graph_key(cfg_for(dropout_p=0.1), "forward", 0),
                 graph_key(cfg_for(deterministic=True), "forward", 0)}
    assert len(different) == 6
    with pytest.raises(ValueError, match="direction"):
        graph_key(a, "sideways", 0)


def test_short_reason_keeps_cudnns_words_and_drops_engine_noise():
    class cudnnGraphNotSupportedError(Exception):
        pass

    error = cudnnGraphNotSupportedError(
        "no engine — python or backend — proposed a plan for this graph (the backend declined: "
        "Bottom right causal mask does not support max_s_q > max_s_kv; python engines declined: "
        "sdpa_fwd_sm90: requires the cutedsl extra)")
    assert short_reason(error) == ("cudnnGraphNotSupportedError: Bottom right causal mask does not support "
                                   "max_s_q > max_s_kv")
    assert short_reason(ValueError("line one\n  line two")) == "ValueError: line one line two"


def test_backend_without_the_package_says_so(monkeypatch):
    import fusedattn.backends.base as base

    monkeypatch.setattr(base, "package_missing", lambda name: name == "cudnn")
    reasons = get_backend("cudnn").supports(cfg_for())
    assert reasons == ["package nvidia-cudnn-frontend not installed (import cudnn)"]


def test_thd_tensors_use_bshd_strides_and_token_major_stats():
    spec = sdpa_spec(cfg_for("thd", mask="padding"))
    assert spec.ragged and spec.padding
    assert spec.q.stride == (5 * 4 * 8, 8, 4 * 8, 1)  # (B, H, S, D) over a (T, H, D) tensor
    assert spec.token_stride("q") == 32 and spec.token_stride("k") == 16
    assert spec.stats.stride == (5 * 4, 1, 4, 1)  # (T, Hq) floats
    packed = sdpa_spec(cfg_for("t3hd", mask="padding"))
    assert packed.token_stride("q") == 3 * 4 * 8


def test_standard_alibi_slopes_follow_the_paper():
    from fusedattn import standard_alibi_slopes

    assert standard_alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    twelve = standard_alibi_slopes(12)  # 8 from 2^(-8k/8), then 4 odd terms of 2^(-8k/16)
    assert twelve[:8] == standard_alibi_slopes(8)
    assert twelve[8:] == [2.0 ** (-0.5 * k) for k in (1, 3, 5, 7)]


def test_frontend_marks_standard_slopes_in_the_config(monkeypatch):
    import fusedattn
    import fusedattn.torch as fat
    from fusedattn import standard_alibi_slopes

    seen = []
    original = fusedattn.frontend_common.select_backend
    monkeypatch.setattr(fusedattn.frontend_common, "select_backend",
                        lambda cfg, *a, **k: (seen.append(cfg), original(cfg, *a, **k))[1])
    q = torch.randn(1, 6, 4, 8)
    fat.attention(q, q, q, mask="causal", alibi_slopes=torch.tensor(standard_alibi_slopes(4)))
    fat.attention(q, q, q, mask="causal", alibi_slopes=torch.tensor(standard_alibi_slopes(4)) * 2)
    assert [cfg.alibi_standard for cfg in seen] == [True, False]


def test_bottom_right_rows_without_keys_run_as_the_last_skv_rows():
    from fusedattn.backends.cudnn.spec import rows_with_keys_config, rows_without_keys

    cfg = cfg_for(mask="causal_bottom_right", seqlen_q=9, seqlen_kv=5, bias="post_scale", bias_shape=(1, 4, 9, 5))
    assert rows_without_keys(cfg) == 4
    sub = rows_with_keys_config(cfg)
    assert (sub.seqlen_q, sub.seqlen_kv, sub.bias_shape) == (5, 5, (1, 4, 5, 5))
    assert rows_without_keys(cfg_for(mask="causal_bottom_right", seqlen_q=5, seqlen_kv=9)) == 0
    assert rows_with_keys_config(cfg_for()) == cfg_for()


def test_calls_that_run_from_raw_addresses_are_exactly_the_plain_dense_ones():
    """The JAX bridge's lean path (no torch, XLA's addresses straight to cuDNN) takes plain q/k/v calls
    whose graph tensors are dense in the base layout; anything computed around the graph is refused."""
    from fusedattn.backends.cudnn.pointer_run import runs_from_addresses

    def cfg(**changes):
        base = dict(dtype="bfloat16", layout=Layout.BSHD, batch=2, seqlen_q=128, seqlen_kv=128, heads_q=8,
                    heads_kv=2, head_dim_qk=64, head_dim_v=64, is_training=True, framework="jax", device="cuda")
        return AttentionConfig(**{**base, **changes})

    for layout in (Layout.BSHD, Layout.SBHD, Layout.BHSD):
        assert runs_from_addresses(cfg(layout=layout))
        assert runs_from_addresses(cfg(layout=layout, mask=Mask.CAUSAL, window=(32, 0)))
    assert runs_from_addresses(cfg(mask=Mask.CAUSAL_BOTTOM_RIGHT, seqlen_q=64, deterministic=True))
    refused = [cfg(mask=Mask.CAUSAL_BOTTOM_RIGHT, seqlen_kv=64),  # rows without keys are filled in by torch
               cfg(mask=Mask.PADDING), cfg(dropout_p=0.1), cfg(return_max_logit=True),
               cfg(bias=BiasType.POST_SCALE, bias_shape=(1, 8, 128, 128)),
               cfg(softmax=SoftmaxType.OFF_BY_ONE), cfg(layout=Layout.BS3HD, heads_kv=8)]
    for config in refused:
        assert not runs_from_addresses(config), config


def _config_of(*tensors, **options) -> AttentionConfig:
    """The config the torch frontend makes for a call (as explain sees it; nothing runs)."""
    from fusedattn.torch import functional

    token = functional._explaining.set(True)
    try:
        return functional.attention(*tensors, **options).cfg
    finally:
        functional._explaining.reset(token)


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_head_slices_of_one_projection_are_read_where_they_lie(layout):
    """q, k, v sliced by heads out of one fused projection: the frontend keeps their strides in the
    config and cuDNN's graph takes them (no copy); gradients stay dense. Views cuDNN cannot read in
    place (a head dim that is not contiguous, strides off 16 bytes) keep the contiguous strides."""
    B, S, Hq, Hkv, D = 2, 6, 4, 2, 8
    axes = layout.upper()
    shape = {"B": B, "S": S, "H": Hq + 2 * Hkv, "D": D}
    projection = torch.randn([shape[a] for a in axes])
    heads = axes.index("H")
    q, k, v = projection.split([Hq, Hkv, Hkv], dim=heads)
    cfg = _config_of(q, k, v, layout=layout, mask="causal")
    assert cfg.strides == (q.stride(), k.stride(), v.stride())
    spec = sdpa_spec(cfg)
    for role, view in zip("qkv", (q, k, v)):
        bhsd = view.permute([axes.index(a) for a in "BHSD"])
        assert getattr(spec, role).stride == bhsd.stride(), role
        dense = view.contiguous().permute([axes.index(a) for a in "BHSD"])
        assert gradient_spec(getattr(spec, role)).stride == dense.stride(), role
    assert spec.o.stride == torch.empty([{**shape, "H": Hq}[a] for a in axes]).permute(
        [axes.index(a) for a in "BHSD"]).stride()
    contiguous = _config_of(*(x.contiguous() for x in (q, k, v)), layout=layout, mask="causal")
    assert contiguous.strides is None
    odd = torch.randn([{**shape, "D": D + 1}[a] for a in axes])[..., :D]  # rows of 9 elements: off 16 bytes
    odd_q, odd_k, odd_v = odd.split([Hq, Hkv, Hkv], dim=heads)
    odd_cfg = _config_of(odd_q, odd_k, odd_v, layout=layout, mask="causal")
    assert odd_cfg.strides is not None and sdpa_spec(odd_cfg).q == layout_strides(contiguous, "q")


def test_strides_of_axes_of_size_one_do_not_count():
    q, k, v = torch.randn(1, 6, 8, 8).split([4, 2, 2], dim=2)
    cfg = _config_of(q[:1], k, v)
    assert cfg.strides[0][0] == 6 * 4 * 8  # B = 1: the contiguous value, whatever the view's
    with pytest.raises(ValueError, match="strides"):
        cfg_for(strides=((1, 2, 3),))
