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
