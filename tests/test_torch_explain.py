"""fusedattn.torch.explain: the selection table of a real call, from its tensors and keywords."""

from __future__ import annotations

import pytest
import torch

import fusedattn.torch as fat


def test_explain_shows_the_call_as_selection_sees_it_and_runs_nothing(ran):
    q = torch.randn(2, 48, 8, 32)
    k = v = torch.randn(2, 64, 2, 32)
    text = fat.explain(q, k, v, mask="causal_bottom_right", window=(16, 0))
    assert text.startswith("config: layout=bshd dtype=float32 B=2 Sq=48 Skv=64 Hq=8 Hkv=2 D=32 Dv=32 "
                           "mask=causal_bottom_right window=(16, 0)")
    assert "selected: reference" in text and "  cudnn: rejected" in text
    assert ran == []  # configured and selected, never run


def test_explain_of_a_forced_backend_that_cannot_run_says_so():
    q = torch.randn(1, 8, 2, 16)
    text = fat.explain(q, q, q, backend="cudnn")
    assert "selected: none; backend 'cudnn' (forced by backend='cudnn') cannot run this call" in text


def test_explain_raises_for_bad_arguments_as_attention_does():
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="mask: expected one of"):
        fat.explain(q, q, q, mask="nope")


def test_attention_runs_as_usual_after_explain(ran):
    q = torch.randn(1, 8, 2, 16)
    fat.explain(q, q, q, mask="causal")
    out = fat.attention(q, q, q, mask="causal")
    assert out.shape == q.shape and [name for name, _, _ in ran] == ["reference"]


def test_a_term_over_kv_idx_alone_is_not_reported_as_a_materialized_gather():
    """s + t[h, kv_idx] is a zero-stride view over Sq (no copy): explain said it was a gather that mixes
    q_idx and kv_idx, with its memory per call; a real gather (t[h, kv_idx - q_idx + M]) still is."""
    q = torch.randn(1, 16, 2, 8)
    t = torch.randn(2, 64)
    text = str(fat.explain(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + t[h, kv_idx]))
    assert "over every (q_idx, kv_idx) pair" not in text, text
    text = str(fat.explain(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + t[h, kv_idx - q_idx + 20]))
    assert "over every (q_idx, kv_idx) pair" in text and "an index that mixes q_idx and kv_idx" in text, text
