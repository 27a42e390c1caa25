"""Bottom-right causal with Sq > Skv on the native operator (fusedattn/torch/rows_with_keys.py): the operator
gets the rows that see keys, as a view of q, and the call answers for every row. Here the operator is a
stand-in that computes attention itself, so the padding and the gradients' way back are checked against the
float64 naive on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from naive import naive_attention

import fusedattn.torch as fat
from fusedattn.torch import functional

B, SQ, SKV, H, D = 2, 7, 4, 2, 8


@pytest.fixture
def operator(monkeypatch):
    """Every config has a native plan (its config, kept here); the stand-in runs the plan's rows (top-left causal:
    Sq == Skv there) with the plan's sink."""
    seen, plans = [], {}

    def plan_on(cfg, name, device):
        plans[len(plans)] = cfg
        return len(plans) - 1

    monkeypatch.setattr(functional, "_native_plan_on", plan_on)

    def attend(plan, q, k, v, sink, seed, offset, bias=None, *rest):
        seen.append(tuple(q.shape))
        if plans[plan].softmax.value == "off_by_one":
            sink = torch.zeros(q.shape[2], dtype=q.dtype)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        if bias is not None:
            scores = scores + bias
        rows, keys = scores.shape[-2:]
        visible = torch.ones(rows, keys, dtype=torch.bool).tril()
        scores = scores.masked_fill(~visible, float("-inf"))
        if sink is not None:  # the sink's logit as one more key that adds to the denominator only
            scores = torch.cat([scores, sink.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], -1)
        lse = torch.logsumexp(scores, -1)
        weights = torch.softmax(scores, -1)[..., :keys]
        return torch.einsum("bhqk,bkhd->bqhd", weights, v), lse

    monkeypatch.setattr(functional, "_operator", attend)
    return seen


@pytest.mark.parametrize("bias_shape", [None, (1, H, SQ, SKV), (B, 1, 1, SKV)])
def test_rows_without_keys_run_on_the_operator_and_come_back_empty(operator, bias_shape):
    gen = torch.Generator().manual_seed(61)
    leaves = [torch.randn(B, n, H, D, generator=gen, dtype=torch.float64) for n in (SQ, SKV, SKV)]
    if bias_shape is not None:
        leaves.append(torch.randn(bias_shape, generator=gen, dtype=torch.float64))
    got_leaves = [x.clone().requires_grad_() for x in leaves]
    options = dict(mask="causal_bottom_right", return_lse=True)
    bias = {} if bias_shape is None else {"bias": got_leaves[3]}
    for _ in range(2):  # planned, then recalled
        got = fat.attention(*got_leaves[:3], **bias, **options)
    assert operator == [(B, SKV, H, D)] * 2  # the operator ran the rows with keys, twice
    exact_leaves = [x.clone().requires_grad_() for x in leaves]
    out, lse, _ = naive_attention(*exact_leaves[:3], mask="causal_bottom_right",
                                  bias=None if bias_shape is None else exact_leaves[3])
    torch.testing.assert_close(got.out, out)
    torch.testing.assert_close(got.lse, lse)
    assert (got.out[:, :SQ - SKV] == 0).all() and torch.isneginf(got.lse[:, :, :SQ - SKV]).all()
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    found = torch.autograd.grad((got.out * weight).sum(), got_leaves)
    expected = torch.autograd.grad((out * weight).sum(), exact_leaves)
    for name, a, b in zip(("q", "k", "v", "bias"), found, expected):
        torch.testing.assert_close(a, b, msg=name)
    assert (found[0][:, :SQ - SKV] == 0).all()


def test_a_plain_output_is_padded_too(operator):
    q, k, v = (torch.randn(B, n, H, D, dtype=torch.float64) for n in (SQ, SKV, SKV))
    out = fat.attention(q, k, v, mask="causal_bottom_right", layout="bshd")
    assert out.shape == (B, SQ, H, D) and (out[:, :SQ - SKV] == 0).all()
    exact, _, _ = naive_attention(q, k, v, mask="causal_bottom_right")
    torch.testing.assert_close(out, exact)


@pytest.mark.parametrize("softmax_type", ["learnable", "off_by_one"])
def test_rows_without_keys_keep_the_sinks_lse(operator, softmax_type):
    """Their LSE is the log of the sink term alone (the sink's logit, 0 for off_by_one), as the reference
    gives and the README promises; it was padded with -inf (sweep 7), here and on the Python path and JAX's."""
    gen = torch.Generator().manual_seed(67)
    q, k, v = (torch.randn(B, n, H, D, generator=gen, dtype=torch.float64) for n in (SQ, SKV, SKV))
    sink = torch.tensor([0.5, -1.0], dtype=torch.float64)
    options = dict(mask="causal_bottom_right", softmax_type=softmax_type, return_lse=True)
    if softmax_type == "learnable":
        options["sink"] = sink
    got = fat.attention(q, k, v, **options)
    assert operator == [(B, SKV, H, D)]
    out, lse, _ = naive_attention(q, k, v, mask="causal_bottom_right", softmax_type=softmax_type,
                                  sink=sink if softmax_type == "learnable" else None)
    torch.testing.assert_close(got.out, out)
    torch.testing.assert_close(got.lse, lse.to(got.lse.dtype))
    expected = sink if softmax_type == "learnable" else torch.zeros(H, dtype=torch.float64)
    torch.testing.assert_close(got.lse[:, :, :SQ - SKV], expected.view(1, -1, 1).expand(B, -1, SQ - SKV).to(got.lse))
