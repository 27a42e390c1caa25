"""fusedattn.torch.flex_attention against torch's own FlexAttention on the CPU: the corpus of
flex-style callbacks (tests/flex_corpus.py) as score_mods and as BlockMasks, output and LSE
on the same float64 inputs (BHSD)."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
flex_module = pytest.importorskip("torch.nn.attention.flex_attention")

from flex_corpus import CORPUS, torch_array  # noqa: E402

from fusedattn.torch import flex_attention  # noqa: E402

B, H, S, D = 2, 4, 24, 16


def _inputs(seed: int, heads_kv: int = H):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, H, S, D), (B, heads_kv, S, D), (B, heads_kv, S, D))
    return [torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in shapes]


def _run(function, tensors, **kwargs):
    """(out, lse); FlexAttention has no backward on the CPU, so gradients are tested elsewhere
    (test_flex_score_mods.py, against a naive float64 attention)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention warns that eager mode is slow
        return function(*tensors, return_lse=True, **kwargs)


def _close(name, got, want):
    torch.testing.assert_close(got.double(), want.double(), atol=1e-9, rtol=1e-7, msg=name)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_agrees_with_torch_flex_attention(name):
    score_mod, mask_mod = CORPUS[name](torch_array, B, H, S)
    kwargs = {"score_mod": score_mod}
    if mask_mod is not None:
        kwargs["block_mask"] = flex_module.create_block_mask(mask_mod, B, H, S, S, device="cpu")
    tensors = _inputs(11)
    ours = _run(flex_attention, tensors, **kwargs)
    theirs = _run(flex_module.flex_attention, tensors, **kwargs)
    _close("out", ours[0], theirs[0])
    _close("lse", ours[1], theirs[1])


def test_gqa_scale_and_plain_output():
    tensors = _inputs(12, heads_kv=2)
    ours = flex_attention(*tensors, scale=0.3, enable_gqa=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = flex_module.flex_attention(*tensors, scale=0.3, enable_gqa=True)
    assert isinstance(ours, torch.Tensor)
    _close("out", ours, theirs)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: flex_attention(q[0], k, v), "query: expected a 4-D tensor"),
    (lambda q, k, v: flex_attention(q, k[:, :2], v[:, :2]), "enable_gqa: expected True"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=3), "block_mask: expected a FlexAttention BlockMask"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=flex_module.create_block_mask(
        lambda b, h, qi, ki: qi >= ki, None, None, S + 128, S + 128, device="cpu")),
     "block_mask: expected one made for"),
])
def test_bad_arguments_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(*_inputs(13))
