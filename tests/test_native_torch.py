"""The native torch operator (backends/cudnn/native) without a GPU: it builds from source with torch's
headers alone, its meta kernels and C++ autograd give the shapes and strides the plans say, its bounded
registry evicts and says so, and the Python side declines what the operator does not run.

The launch core (launch_core.cc) needs the cuDNN frontend's headers and a GPU: tests/gpu covers it.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

from fusedattn.backends.cudnn.native import build, torch_plans
from fusedattn.config import AttentionConfig

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler")


@pytest.fixture(scope="module")
def operator(tmp_path_factory):
    """The operator library built into a fresh cache (once for the module), loaded into torch."""
    import os

    cache = tmp_path_factory.mktemp("native-cache")
    before = os.environ.get(build.ENV_CACHE)
    os.environ[build.ENV_CACHE] = str(cache)
    try:
        messages = []
        path = build.library_path("torch", announce=messages.append)
        assert len(messages) == 2 and "compiling" in messages[0] and "built in" in messages[1]
        assert build.library_path("torch", announce=messages.append) == path and len(messages) == 2  # cached
    finally:
        if before is None:
            os.environ.pop(build.ENV_CACHE)
        else:
            os.environ[build.ENV_CACHE] = before
    return torch_plans.load_operator(path)


def _cfg(**changes):
    base = dict(dtype="bfloat16", layout="bshd", batch=2, seqlen_q=48, seqlen_kv=40, heads_q=4, heads_kv=2,
                head_dim_qk=64, head_dim_v=32, mask="causal", device="cuda", is_training=True)
    return AttentionConfig(**{**base, **changes})


def _register(library, cfg, stats=True):
    shape = torch_plans.plan_shape(cfg, stats)
    return library.fusedattn_torch_plan(0, 1, (ctypes.c_int64 * len(shape))(*shape), len(shape))


def _meta(cfg, role, requires_grad=False):
    from fusedattn.backends.cudnn.spec import sdpa_spec

    spec = getattr(sdpa_spec(cfg), role)
    order = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}[cfg.layout.value]
    sizes = [spec.dim[a] for a in order]
    return torch.empty(sizes, dtype=torch.bfloat16, device="meta").requires_grad_(requires_grad)


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_meta_kernels_give_the_plans_shapes_and_strides(operator, layout):
    cfg = _cfg(layout=layout)
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    out, lse = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None)
    assert out.shape == (*q.shape[:-1], 32) and out.dtype == torch.bfloat16
    base = {"bshd": "BSHD", "sbhd": "SBHD", "bhsd": "BHSD"}[layout]
    dense = torch.empty([{"B": 2, "S": 48, "H": 4, "D": 32}[a] for a in base], device="meta")
    assert out.stride() == tuple(dense.permute([base.index(a) for a in base]).stride())
    assert lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    grads = torch.ops.fusedattn_native.backward(plan, torch.empty_like(out), None, q, k, v, out, lse, None, None, None)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert len(grads) == 3  # no sink, no dSink


def test_inference_plans_return_no_lse(operator):
    plan = _register(operator, _cfg(is_training=False), stats=False)
    q, k, v = (_meta(_cfg(), role) for role in ("q", "k", "v"))
    _, lse = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None)
    assert lse.numel() == 0


def test_the_cpp_autograd_node_runs_the_backward_operator(operator):
    cfg = _cfg(softmax="learnable")
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    sink = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, sink, None, None)
    assert out.grad_fn.name() == "FusedAttentionBackward" and lse.grad_fn is out.grad_fn
    assert len(out.grad_fn.next_functions) == 4  # q, k, v, sink
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert sink.grad.shape == (4,) and sink.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()  # the node released its saved tensors


def test_the_node_is_made_only_when_a_gradient_is_wanted(operator):
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None)
    assert out.grad_fn is None and not out.requires_grad
    k.requires_grad_(True)
    with torch.no_grad():
        assert torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None)[0].grad_fn is None
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None)
    (grad_k,) = torch.autograd.grad(lse.sum() * 0 + out.sum(), (k,))  # q and v get none: no edge to them
    assert grad_k.shape == k.shape


def test_a_gradient_through_the_lse_reaches_the_backward_op(operator):
    """The backward op takes the LSE's gradient and its CUDA kernel refuses a nonzero one (a GPU test):
    eager and compiled graphs, which pass zeros for an unused LSE, get the same check."""
    arguments = [a.name for a in torch.ops.fusedattn_native.backward.default._schema.arguments]
    assert arguments[:3] == ["plan", "grad_out", "grad_lse"]
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None)
    (out.sum() + lse.sum()).backward()  # meta kernels check shapes only
    assert q.grad.shape == q.shape


def test_shapes_other_than_the_plans_are_refused(operator):
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    with pytest.raises(RuntimeError, match=r"q: expected shape \[2, 48, 4, 64\]"):
        torch.ops.fusedattn_native.forward(plan, k, k, v, None, None, None)


def test_the_registry_is_bounded_and_says_when_a_plan_was_dropped(operator):
    try:
        operator.fusedattn_torch_bounds(4)
        plans = [_register(operator, _cfg()) for _ in range(10)]
        assert operator.fusedattn_torch_bounds(0) == 4
        q, k, v = (_meta(_cfg(), role) for role in ("q", "k", "v"))
        with pytest.raises(RuntimeError, match=f"native plan {plans[0]} is not registered in this process"):
            torch.ops.fusedattn_native.forward(plans[0], q, k, v, None, None, None)
        torch.ops.fusedattn_native.forward(plans[-1], q, k, v, None, None, None)
    finally:
        operator.fusedattn_torch_bounds(torch_plans.PLAN_CAPACITY)


def test_plans_with_a_wrong_shape_list_are_refused(operator):
    assert operator.fusedattn_torch_plan(0, 1, (ctypes.c_int64 * 3)(1, 2, 3), 3) == -1


@pytest.mark.parametrize("changes, reason", [
    (dict(layout="thd", mask="padding", batch=2), "THD layouts"),
    (dict(mask="padding"), "mask 'padding'"),
    (dict(bias="post_scale", bias_shape=(1, 4, 48, 40)), "a bias tensor"),
    (dict(return_max_logit=True), "return_max_logit"),
    (dict(mask="causal_bottom_right", seqlen_q=64, seqlen_kv=40), "rows without keys"),
])
def test_the_operator_declines_what_it_does_not_run(changes, reason):
    assert any(reason in r for r in torch_plans.reasons(_cfg(**changes)))
    assert torch_plans.reasons(_cfg()) == []


def test_the_switch_turns_the_operator_off(monkeypatch):
    monkeypatch.setenv(torch_plans.ENV_SWITCH, "0")
    assert torch_plans.unavailable() == f"{torch_plans.ENV_SWITCH}=0"
    assert torch_plans.plan_for(_cfg(), 0) is None


def test_the_cache_key_follows_the_source_and_the_versions(monkeypatch, tmp_path):
    monkeypatch.setenv(build.ENV_CACHE, str(tmp_path))
    first = build.built_path("torch")
    assert first.parent.parent == tmp_path / "native" and first.name == "libfusedattn_torch.so"
    monkeypatch.setattr(build, "_versions", lambda kind: ("another", "version"))
    assert build.built_path("torch") != first
    monkeypatch.setenv(build.env_library("torch"), "/prebuilt/lib.so")
    assert str(build.library_path("torch")) == "/prebuilt/lib.so"


def test_validation_is_never_skipped_by_the_plan_cache():
    import fusedattn.torch as fat

    q = torch.randn(1, 8, 2, 16)
    fat.attention(q, q, q, window=(2, 0))
    with pytest.raises(ValueError, match=r"window: expected \(left, right\), two integers"):
        fat.attention(q, q, q, window=(2.0, 0))
    fat.attention(q, q, q, deterministic=True)
    with pytest.raises(ValueError, match="deterministic: expected a bool, got 1"):
        fat.attention(q, q, q, deterministic=1)
    fat.attention(q, q, q, scale=0.5)
    fat.attention(q, q, q, scale=1)  # an int scale is valid, and its own plan


@pytest.fixture(scope="module")
def entry(operator):
    """The library's Python entry (built where Python's headers are, as here)."""
    if build.python_headers() is None:
        pytest.skip("this interpreter has no C headers: the library is built without its Python entry")
    found = torch_plans.python_entry(operator._name)
    assert found is not None, "built with Python's headers, yet the library has no Python entry"
    return found


def test_the_python_entry_calls_the_operator_with_its_autograd(operator, entry):
    cfg = _cfg(softmax="learnable")
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    sink = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = entry(plan, q, k, v, sink, None, None)
    expected = torch.ops.fusedattn_native.attention(plan, q, k, v, sink, None, None)
    assert (out.shape, out.stride(), lse.shape) == (expected[0].shape, expected[0].stride(), expected[1].shape)
    assert out.grad_fn.name() == "FusedAttentionBackward"
    out.sum().backward()
    assert q.grad.shape == q.shape and sink.grad.shape == (4,)
    with torch.no_grad():  # nothing to differentiate: no autograd node
        assert entry(plan, q, k, v, sink, None, None)[0].grad_fn is None


def test_the_python_entry_raises_what_torch_ops_raises(operator, entry):
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    for call in (entry, torch.ops.fusedattn_native.attention.default):
        with pytest.raises(RuntimeError, match=r"q: expected shape \[2, 48, 4, 64\]") as raised:
            call(plan, k, k, v, None, None, None)
        assert "Exception raised from" not in str(raised.value)  # no C++ backtrace
        with pytest.raises(RuntimeError, match="native plan 123456789 is not registered in this process"):
            call(123456789, q, k, v, None, None, None)
        with pytest.raises(NotImplementedError, match="fusedattn_native::forward"):  # no CPU kernel
            call(plan, *(torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v)), None, None, None)


def test_tensors_that_override_torch_functions_take_torch_ops(operator, monkeypatch):
    """The entry skips Python's torch-function handling, so calls with a mode or subclass do not use it."""
    from torch.overrides import TorchFunctionMode

    from fusedattn.torch import functional

    seen = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return "through torch.ops"

    monkeypatch.setattr(torch_plans, "entry", lambda *args: "through the entry")
    q = torch.randn(1, 2, 1, 4)
    assert functional._operator(0, q, q, q, None, None, None) == "through the entry"
    with Recording():
        assert functional._operator(0, q, q, q, None, None, None) == "through torch.ops"
    assert seen == [torch.ops.fusedattn_native.attention.default]
