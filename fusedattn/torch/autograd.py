"""The autograd bridge: the backend that ran the forward pass also runs the backward."""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from fusedattn.backends.base import ARRAY_NAMES, DIFFERENTIABLE, AttentionInputs, AttentionOutputs, lse_gradient_for


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, cfg, backend, score_mod, *arrays):
        ctx.set_materialize_grads(False)  # unused outputs give None: backends skip their terms
        inputs = AttentionInputs(**dict(zip(ARRAY_NAMES, arrays)), score_mod=score_mod)
        outputs, saved = backend.forward(cfg, inputs)
        ctx.cfg, ctx.backend, ctx.score_mod, ctx.saved = cfg, backend, score_mod, saved
        ctx.save_for_backward(*arrays, outputs.out, outputs.lse)
        ctx.mark_non_differentiable(outputs.max_logit)
        return outputs.out, outputs.lse, outputs.max_logit

    @staticmethod
    def backward(ctx, grad_out, grad_lse, _grad_max_logit):
        # A backend whose backward is the framework's autodiff (the reference) can be differentiated again
        # (create_graph=True); the others' kernels cannot: gradients without a graph would silently drop
        # attention's share of a second derivative, so asking for one there raises.
        if ctx.backend.backward_differentiable:
            return _backward(ctx, grad_out, grad_lse)
        if torch.is_grad_enabled() and any(x.requires_grad for x in ctx.saved_tensors):
            raise RuntimeError(
                f"fusedattn.torch.attention: a second derivative (backward with create_graph=True) through "
                f"backend {ctx.backend.name!r}, whose backward is a kernel with no derivative of its own; pass "
                "backend='reference' to the calls you differentiate twice, or take the gradient without "
                "create_graph")
        return _backward_once(ctx, grad_out, grad_lse)


def _backward(ctx, grad_out, grad_lse):
    *arrays, out, lse = ctx.saved_tensors
    inputs = AttentionInputs(**dict(zip(ARRAY_NAMES, arrays)), score_mod=ctx.score_mod)
    grad_lse = lse_gradient_for(ctx.backend, grad_lse, "fusedattn.torch.attention")
    grads = ctx.backend.backward(ctx.cfg, inputs, ctx.saved, AttentionOutputs(out, lse),
                                 grad_out, grad_lse)
    needed = dict(zip(ARRAY_NAMES, ctx.needs_input_grad[3:]))
    return (None, None, None) + tuple(
        grads.get(name) if name in DIFFERENTIABLE and needed[name] else None for name in ARRAY_NAMES
    )


_backward_once = once_differentiable(_backward)


def run_attention(cfg, backend, score_mod, arrays):
    """(out, lse, max_logit) through autograd; backward goes to the same backend. A score_mod whose tensors
    learn (cfg.score_mod_learns; selection kept a backend with score_mod_gradient) runs the backend's forward
    under autograd itself, which reaches those tensors too."""
    if cfg.score_mod_learns:
        outputs, _ = backend.forward(cfg, AttentionInputs(**dict(zip(ARRAY_NAMES, arrays)), score_mod=score_mod))
        return outputs.out, outputs.lse, outputs.max_logit.detach()
    return _Attention.apply(cfg, backend, score_mod, *arrays)
