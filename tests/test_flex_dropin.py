"""fusedattn.torch.flex_attention against torch's own FlexAttention on the CPU: the corpus of
flex-style callbacks (tests/flex_corpus.py) as score_mods and as BlockMasks, output and LSE
on the same float64 inputs (BHSD)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex_module = pytest.importorskip("torch.nn.attention.flex_attention")

from flex_corpus import CORPUS, torch_array  # noqa: E402

from fusedattn.torch import block_masks, flex_attention  # noqa: E402

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
    torch.testing.assert_close(flex_attention(*tensors, scale=torch.tensor(0.3), enable_gqa=True), ours)


# ------------------------------------------------------------------ block tables

def _as_compiled_flex(q, k, v, block_mask, mask_mod, scale):
    """What compiled FlexAttention computes with a BlockMask, written out densely in float64: a key is
    seen when its block is listed full, or listed partial and mask_mod keeps it; a row seeing no key
    gives 0. Returns (out, lse); out is differentiable."""
    batch, heads, length, _ = q.shape
    key_len = k.shape[2]
    (bq, bkv), table = block_mask.BLOCK_SIZE, block_mask.to_dense().bool()
    full = torch.zeros_like(table)
    if block_mask.full_kv_num_blocks is not None:
        for b, h, i in torch.cartesian_prod(*map(torch.arange, block_mask.full_kv_num_blocks.shape)):
            n = int(block_mask.full_kv_num_blocks[b, h, i])
            full[b, h, i, block_mask.full_kv_indices[b, h, i, :n].long()] = True
    qi, ki = torch.arange(length).view(-1, 1), torch.arange(key_len).view(1, -1)
    b, h = torch.arange(batch).view(-1, 1, 1, 1), torch.arange(heads).view(1, -1, 1, 1)
    blocks = (slice(None), slice(None), qi // bq, ki // bkv)
    wanted = torch.ones(batch, heads, length, key_len, dtype=torch.bool) if mask_mod is None else (
        mask_mod(b, h, qi, ki).expand(batch, heads, length, key_len))
    keep = full.expand(batch, heads, *full.shape[2:])[blocks] | (
        table.expand(batch, heads, *table.shape[2:])[blocks] & wanted)
    scores = torch.where(keep, (q @ k.transpose(-1, -2)) * scale, -torch.inf)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.where(keep, torch.exp(scores - torch.where(lse.isinf(), 0.0, lse).unsqueeze(-1)), 0.0)
    return weights @ v, lse


def _block_cases(length: int):
    causal = lambda b, h, qi, ki: qi >= ki  # noqa: E731
    blocks = -(-length // 128)
    one_block = flex_module.BlockMask.from_kv_blocks(  # every query row sees key block 0 only
        torch.ones(1, 1, blocks, dtype=torch.int32), torch.zeros(1, 1, blocks, blocks, dtype=torch.int32),
        seq_lengths=(length, length))
    counts = torch.arange(1, blocks + 1, dtype=torch.int32).view(1, 1, -1)
    indices = torch.arange(blocks, dtype=torch.int32).expand(1, 1, blocks, blocks).contiguous()
    whole_diagonal = flex_module.BlockMask.from_kv_blocks(  # causal's diagonal blocks listed as full
        torch.zeros_like(counts), indices, counts, indices, seq_lengths=(length, length), mask_mod=causal)
    return {"from create_block_mask": (flex_module.create_block_mask(causal, B, None, length, length, device="cpu"),
                                       causal, True),
            "from_kv_blocks, no mask_mod": (one_block, None, False),
            "full blocks the mask_mod masks partly": (whole_diagonal, causal, False)}


def _agrees_with_compiled_flex(block_mask, mask_mod, length: int, seed: int, key_len: int | None = None) -> None:
    """The drop-in's out, LSE and dq, dk, dv against _as_compiled_flex on fresh float64 inputs."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
               for n in (length, key_len or length, key_len or length))
    out, lse = _run(flex_attention, (q, k, v), block_mask=block_mask)
    want, want_lse = _as_compiled_flex(q, k, v, block_mask, mask_mod, D ** -0.5)
    _close("out", out, want)
    _close("lse", lse, want_lse)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for name, got, expected in zip("qkv", torch.autograd.grad(out, (q, k, v), dout),
                                   torch.autograd.grad(want, (q, k, v), dout)):
        _close(f"d{name}", got, expected)


@pytest.mark.parametrize("length", [200, 256])
@pytest.mark.parametrize("case", ["from create_block_mask", "from_kv_blocks, no mask_mod",
                                  "full blocks the mask_mod masks partly"])
def test_a_block_table_means_what_compiled_flex_attention_computes(case, length):
    block_mask, mask_mod, agrees = _block_cases(length)[case]
    assert (block_masks.table_issue(block_mask, mask_mod, B, H, length, length) is None) == agrees
    _agrees_with_compiled_flex(block_mask, mask_mod, length, seed=21)


@pytest.mark.parametrize("seed", range(12))
def test_random_block_tables_mean_what_compiled_flex_attention_computes(seed):
    """Tables drawn at random (each block left out, partial or full; per batch and head or broadcast),
    with or without a mask_mod, lengths on and off the block size, queries and keys of other lengths and
    block sizes (odd seeds)."""
    rng = np.random.default_rng(seed)
    length, block = int(rng.choice([64, 100, 128])), 32
    key_len, key_block = (int(rng.choice([40, 96, 150])), 64) if seed % 2 else (length, block)
    batch_dims = (int(rng.choice([1, B])), int(rng.choice([1, H])))
    kind = rng.integers(0, 3, (*batch_dims, -(-length // block), -(-key_len // key_block)))  # left out/partial/full

    def listed(which):
        counts = torch.tensor((kind == which).sum(-1), dtype=torch.int32)
        order = np.argsort(kind != which, axis=-1, kind="stable")  # the listed blocks first
        return counts, torch.tensor(order, dtype=torch.int32)

    mask_mod = [None, lambda b, h, qi, ki: qi >= ki, lambda b, h, qi, ki: (qi + ki + h) % 3 != 0][seed % 3]
    block_mask = flex_module.BlockMask.from_kv_blocks(*listed(1), *listed(2), BLOCK_SIZE=(block, key_block),
                                                      seq_lengths=(length, key_len),
                                                      **({} if mask_mod is None else {"mask_mod": mask_mod}))
    _agrees_with_compiled_flex(block_mask, mask_mod, length, seed, key_len)


def test_a_table_applied_densely_warns_once_with_its_memory():
    block_mask, _, _ = _block_cases(200)["from_kv_blocks, no mask_mod"]
    with pytest.warns(UserWarning, match=r"dense \(B, H, L, S\) = \(2, 4, 200, 200\) mask, 1.22 MiB per call"):
        flex_attention(*(torch.randn(B, H, 200, D, dtype=torch.float64) for _ in range(3)), block_mask=block_mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the verdict is kept: no second warning
        flex_attention(*(torch.randn(B, H, 200, D, dtype=torch.float64) for _ in range(3)), block_mask=block_mask)
        consistent, _, _ = _block_cases(200)["from create_block_mask"]
        flex_attention(*(torch.randn(B, H, 200, D, dtype=torch.float64) for _ in range(3)), block_mask=consistent)


def test_a_block_table_that_agrees_is_checked_once_and_leaves_the_mask_mod(monkeypatch):
    block_mask, mask_mod, _ = _block_cases(200)["from create_block_mask"]
    checks = []
    original = block_masks.table_issue
    monkeypatch.setattr(block_masks, "table_issue", lambda *a: checks.append(1) or original(*a))
    assert block_masks.mask_of_block_mask(block_mask, mask_mod, B, H, 200, 200) is mask_mod
    assert block_masks.mask_of_block_mask(block_mask, mask_mod, B, H, 200, 200) is mask_mod
    assert len(checks) == 1


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: flex_attention(q[0], k, v), "query: expected a 4-D tensor"),
    (lambda q, k, v: flex_attention(q, k[:, :2], v[:, :2]), "enable_gqa: expected True"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=3), "block_mask: expected a FlexAttention BlockMask"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=flex_module.create_block_mask(
        lambda b, h, qi, ki: qi >= ki, None, None, S + 128, S + 128, device="cpu")),
     "block_mask: expected one made for"),
    (lambda q, k, v: flex_attention(q, k, v, block_mask=flex_module.create_block_mask(
        lambda b, h, qi, ki: qi >= ki, B + 1, None, S, S, device="cpu")),
     "block_mask: expected one made for B in"),
])
def test_bad_arguments_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(*_inputs(13))


def test_kernel_options_and_an_lse_request_are_taken_as_flex_attention_takes_them():
    """A drop-in takes FlexAttention's keywords: kernel_options (its own kernels' hints: accepted, unused) and
    return_aux=AuxRequest(lse=True), answered with an AuxOutput; max_scores, not computed here, is refused."""
    request = getattr(flex_module, "AuxRequest", None)
    if request is None:
        pytest.skip("this torch's FlexAttention has no AuxRequest")
    q, k, v = (torch.randn(2, 2, 24, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's advice to compile it
        want_out, want_aux = flex_module.flex_attention(q, k, v, return_aux=request(lse=True))
    out, aux = flex_attention(q, k, v, return_aux=request(lse=True), kernel_options={"BLOCK_M": 64})
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(aux.lse, want_aux.lse, rtol=1e-5, atol=1e-5)
    assert aux.max_scores is None
    with pytest.raises(ValueError, match="return_aux: max_scores is not computed"):
        flex_attention(q, k, v, return_aux=request(max_scores=True))
    with pytest.raises(ValueError, match="return_aux: expected None when return_lse=True"):
        flex_attention(q, k, v, return_lse=True, return_aux=request(lse=True))


def test_a_block_table_shorter_than_the_queries_is_refused_by_name():
    """A BlockMask made for fewer queries than the call has: the error named an internal captured tensor."""
    from torch.nn.attention.flex_attention import BlockMask

    q = k = v = torch.randn(2, 2, 6, 8)
    block_mask = BlockMask.from_kv_blocks(torch.tensor([[[1]]], dtype=torch.int32),
                                          torch.tensor([[[[0]]]], dtype=torch.int32), BLOCK_SIZE=4, seq_lengths=(6, 6))
    with pytest.raises(ValueError, match=r"^flex_attention: block_mask: its table covers 1 query blocks of 4 \(4 "
                                         r"queries\), the call has L=6; make it for this length"):
        flex_attention(q, k, v, block_mask=block_mask)
