"""Shared checks of the GPU tests: run a call on a backend, compare with the float64 reference.

Error rule (STYLE 15): exact_rule.py.
"""

from __future__ import annotations

import pytest
import torch
from exact_rule import FACTOR, assert_close_to_exact  # noqa: F401 (the tests import them from here too)

import fusedattn
import fusedattn.torch as fat

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _pack(layout, q, k, v):
    """(tensors to pass, which leaf tensors get gradients) for a layout, from bshd q, k, v."""
    if layout == "bshd":
        return (q, k, v), (q, k, v)
    if layout == "sbhd":
        return tuple(x.transpose(0, 1).contiguous() for x in (q, k, v)), None
    if layout == "bhsd":
        return tuple(x.transpose(1, 2).contiguous() for x in (q, k, v)), None
    if layout == "bs3hd":
        return (torch.stack([q, k, v], dim=2),), None
    if layout == "sb3hd":
        return (torch.stack([q, k, v], dim=2).transpose(0, 1).contiguous(),), None
    if layout == "bshd_bs2hd":
        return (q, torch.stack([k, v], dim=2)), None
    if layout == "sbhd_sb2hd":
        return (q.transpose(0, 1).contiguous(), torch.stack([k, v], dim=2).transpose(0, 1).contiguous()), None
    raise ValueError(layout)


def run(backend, tensors, options, grad_seed=7, max_logit=False):
    """Forward (with lse and max_logit) and gradients of every tensor that requires one."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    extra = {}
    for name in ("bias", "sink"):
        if options.get(name) is not None:
            extra[name] = options[name].detach().clone().requires_grad_(True)
    opts = {**options, **extra}
    result = fat.attention(*leaves, backend=backend, return_lse=True, return_max_logit=max_logit, **opts)
    gen = torch.Generator(device="cuda").manual_seed(grad_seed)
    grad = torch.randn(result.out.shape, generator=gen, device="cuda", dtype=torch.float32)
    result.out.float().backward(grad)
    grads = [leaf.grad for leaf in leaves] + [extra[n].grad for n in extra]
    return result, grads


def check_against_reference(tensors, options, dtype, max_logit=False, known_limit=None):
    """cuDNN against the float64 reference. A refusal fails the test (a regression must not hide as a
    skip) unless known_limit says which documented limit the call meets: then it skips, naming it."""
    cfg_reasons = None
    try:
        fused, fused_grads = run("cudnn", tensors, options, max_logit=max_logit)
    except fusedattn.NoBackendError as error:
        cfg_reasons = str(error)
    if cfg_reasons:
        if known_limit is None:
            pytest.fail("cudnn declined a call it should run: " + cfg_reasons)
        pytest.skip(f"cudnn declined ({known_limit}): " + cfg_reasons.splitlines()[-1])
    same, same_grads = run("reference", tensors, options, max_logit=max_logit)
    wide = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in options.items()}
    exact, exact_grads = run("reference", [t.double() for t in tensors], wide, max_logit=max_logit)
    assert torch.isfinite(fused.out).all()
    assert_close_to_exact("out", fused.out, same.out, exact.out)
    finite = torch.isfinite(exact.lse)
    torch.testing.assert_close(fused.lse[finite], exact.lse[finite].float(), atol=2e-2, rtol=2e-3)
    if max_logit:
        torch.testing.assert_close(fused.max_logit, exact.max_logit.float(), atol=5e-2, rtol=1e-2)
    for i, (g, s, e) in enumerate(zip(fused_grads, same_grads, exact_grads)):
        assert g is not None, f"gradient {i} missing"
        assert_close_to_exact(f"grad {i}", g, s, e, reduction=i >= len(tensors))


def make(b, sq, skv, hq, hkv, d, dv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(b, skv, hkv, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(b, skv, hkv, dv, generator=gen, device="cuda").to(dtype)
    return q, k, v


def _lengths(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.cuda()


def _thd(layout, lens_q, lens_kv, hq, hkv, d, seed, gaps=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total_q, total_kv = sum(lens_q) + gaps * len(lens_q), sum(lens_kv) + gaps * len(lens_kv)
    rand = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    if layout == "t3hd":
        return (rand(total_q, 3, hq, d),)
    if layout == "thd_t2hd":
        return rand(total_q, hq, d), rand(total_kv, 2, hkv, d)
    return rand(total_q, hq, d), rand(total_kv, hkv, d), rand(total_kv, hkv, d)




def assert_replay_matches(setup):
    """setup() -> step, a callable returning tensors. Warm it up, capture it in a CUDA graph,
    replay, and require the replayed results to equal an eager run bit for bit.

    As torch's CUDA-graph recipe asks, setup and warm-up run on a side stream, never on the
    legacy default stream, whose autograd accumulators capture cannot join.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step = setup()
        expected = [x.clone() for x in step()]  # also builds and caches the graphs before capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        captured = step()
    cuda_graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
