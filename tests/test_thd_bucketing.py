"""FUSEDATTN_THD_BUCKET rounds THD max_seqlen up so varying packed batches share configs."""

from __future__ import annotations

import pytest
import torch

import fusedattn
import fusedattn.torch as fat
from fusedattn.arguments import CallArguments, bucket_max_seqlens


def _args(max_q, max_kv, layout="thd"):
    return CallArguments(api="t", framework="torch", layout=layout, tensors=(None, None, None),
                         max_seqlen_q=max_q, max_seqlen_kv=max_kv)


@pytest.mark.parametrize("setting,given,expected", [
    ("pow2", (5, 100), (8, 128)), ("pow2", (64, 1), (64, 1)), ("128", (5, 300), (128, 384)),
    ("off", (5, 7), (5, 7)), (None, (5, 7), (5, 7)),
])
def test_rounding(setting, given, expected):
    args = _args(*given)
    bucket_max_seqlens(args, setting)
    assert (args.max_seqlen_q, args.max_seqlen_kv) == expected


def test_dense_layouts_are_left_alone():
    args = _args(5, 7, layout="bshd")
    bucket_max_seqlens(args, "pow2")
    assert (args.max_seqlen_q, args.max_seqlen_kv) == (5, 7)


def test_bad_setting_names_the_variable():
    with pytest.raises(ValueError, match="FUSEDATTN_THD_BUCKET: expected 'off', 'pow2' or an int"):
        bucket_max_seqlens(_args(5, 7), "lots")


def test_bucketed_results_equal_exact_ones_and_share_a_config(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20, 2, 8, generator=gen, requires_grad=True)
    exact = {}
    for lengths in ([5, 7, 8], [3, 9, 8]):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        exact[tuple(lengths)] = fat.attention(x, x, x, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                              mask="causal", return_lse=True)
    monkeypatch.setenv("FUSEDATTN_THD_BUCKET", "16")
    fusedattn.selection.clear_decisions()
    configs = set()
    original = fusedattn.selection.select_backend
    monkeypatch.setattr(fusedattn.frontend_common, "select_backend",
                        lambda cfg, *a, **k: (configs.add(cfg), original(cfg, *a, **k))[1])
    for lengths, want in exact.items():
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        got = fat.attention(x, x, x, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, mask="causal",
                            return_lse=True)
        torch.testing.assert_close(got.out, want.out)
        torch.testing.assert_close(got.lse, want.lse)
    assert len(configs) == 1 and next(iter(configs)).seqlen_q == 16


@pytest.mark.parametrize("bucket", [None, "pow2"])
@pytest.mark.parametrize("layout", ["thd", "t3hd"])
def test_a_max_seqlen_past_the_tokens_is_the_token_count(monkeypatch, bucket, layout):
    """No sequence is longer than the tokens, so a looser max_seqlen is lowered to T before bucketing: the
    reference once padded every sequence to it (a max_seqlen of 100000 over 7 tokens asked for 160 GB);
    results equal those of the exact bound, torch and JAX."""
    import jax.numpy as jnp
    import numpy as np

    import fusedattn.jax as fja

    if bucket:
        monkeypatch.setenv(fusedattn.arguments.ENV_THD_BUCKET, bucket)
    gen = torch.Generator().manual_seed(62)
    x = torch.randn(7, 3, 2, 8, generator=gen, dtype=torch.float64) if layout == "t3hd" else \
        torch.randn(7, 2, 8, generator=gen, dtype=torch.float64)
    qkv = (x,) if layout == "t3hd" else (x, x.flip(0), x * 0.5)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    exact = fat.attention(*qkv, layout=layout, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4)
    for loose in (100_000, 2**40):
        options = dict(layout=layout, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=loose, max_seqlen_kv=loose)
        torch.testing.assert_close(fat.attention(*qkv, **options), exact, rtol=0, atol=0)
        arrays = [jnp.asarray(t.float().numpy()) for t in qkv]
        jax_options = {**options, "cu_seqlens_q": jnp.asarray(cu.numpy()), "cu_seqlens_kv": jnp.asarray(cu.numpy())}
        np.testing.assert_allclose(np.asarray(fja.attention(*arrays, **jax_options)), exact.float().numpy(),
                                   rtol=2e-5, atol=2e-6)
