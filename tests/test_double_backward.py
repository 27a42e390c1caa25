"""A second derivative through fusedattn.torch.attention (create_graph=True: gradient penalties, MAML, Hessian-
vector products): the reference backend's backward is torch's autograd over its own forward, so it is
differentiable again (torch.autograd.gradgradcheck in float64); a backend whose backward is a kernel raises
where the second derivative is taken, never a silent zero."""

from __future__ import annotations

import pytest
from needs_torch import requires_torch

pytestmark = requires_torch("the torch frontend")

B, SQ, SKV, H, D = 1, 3, 4, 2, 4


def _inputs(seed, heads_kv=H):
    import torch

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, SQ, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, SKV, heads_kv, D, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    return gen, q, k, v


CASES = ["plain", "causal", "bias", "sink", "score_mod", "padding", "gqa", "window"]


@pytest.mark.parametrize("case", CASES)
def test_the_reference_backward_is_differentiable_again(case):
    import torch

    import fusedattn.torch as fat

    gen, q, k, v = _inputs(70, heads_kv=1 if case == "gqa" else H)
    extra, options = [], {}
    if case == "causal":
        options = {"mask": "causal_bottom_right"}
    elif case == "bias":
        extra = [torch.randn(1, H, SQ, SKV, generator=gen, dtype=torch.float64, requires_grad=True)]
    elif case == "sink":
        extra, options = [torch.randn(H, generator=gen, dtype=torch.float64, requires_grad=True)], \
            {"softmax_type": "learnable"}
    elif case == "score_mod":
        options = {"score_mod": lambda s, b, h, q_idx, kv_idx: 2.0 * torch.tanh(s / 2.0) - 0.1 * (q_idx - kv_idx)}
    elif case == "padding":
        options = {"mask": "padding", "cu_seqlens_q": torch.tensor([0, 2]), "cu_seqlens_kv": torch.tensor([0, 3])}
    elif case == "window":
        options = {"mask": "causal", "window": (1, 0)}

    def attend(q, k, v, *rest):
        named = {"bias": rest[0]} if case == "bias" else {"sink": rest[0]} if case == "sink" else {}
        return fat.attention(q, k, v, backend="reference", **options, **named)

    assert torch.autograd.gradgradcheck(attend, (q, k, v, *extra))


def test_a_gradient_penalty_matches_plain_torch():
    """The gradient of |dL/dq|^2 (a penalty through attention) against the same written in torch ops."""
    import torch

    import fusedattn.torch as fat

    _, q, k, v = _inputs(71)

    def exact(q, k, v):
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * D ** -0.5
        return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)

    grads = []
    for attend in (fat.attention, exact):
        out = attend(q, k, v)
        (dq,) = torch.autograd.grad(out.square().sum(), q, create_graph=True)
        grads.append(torch.autograd.grad(dq.square().sum(), (q, k, v)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_a_backend_whose_backward_is_a_kernel_refuses_create_graph(monkeypatch):
    """Gradients without a graph would drop attention's share of a second derivative silently (a penalty
    through other layers too still differentiates): create_graph=True raises, naming the backend and the
    way out; a plain backward still works."""
    import torch

    import fusedattn.torch as fat
    from fusedattn.backends import get_backend

    monkeypatch.setattr(type(get_backend("reference")), "backward_differentiable", False)
    _, q, k, v = _inputs(72)
    with pytest.raises(RuntimeError, match="second derivative .* backend 'reference'.*backend='reference'"):
        torch.autograd.grad(fat.attention(q, k, v).sum(), q, create_graph=True)
    (dq,) = torch.autograd.grad(fat.attention(q, k, v).sum(), q)
    assert dq.shape == q.shape and not dq.requires_grad
