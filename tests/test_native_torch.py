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
from fusedattn.score_mods.core import MASKED

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler")


@pytest.fixture(scope="module")
def operator(native_torch_build):
    """The operator library built into a fresh cache (once per process: conftest), loaded into torch."""
    path, messages = native_torch_build
    assert len(messages) == 2 and "compiling" in messages[0] and "built in" in messages[1]
    return torch_plans.load_operator(path)


PLAIN = (None, [], [], False, [])  # no bias, aux tensors or scalars; no empty-row fix; no offsets


def _cfg(**changes):
    base = dict(dtype="bfloat16", layout="bshd", batch=2, seqlen_q=48, seqlen_kv=40, heads_q=4, heads_kv=2,
                head_dim_qk=64, head_dim_v=32, mask="causal", device="cuda", is_training=True)
    return AttentionConfig(**{**base, **changes})


def _register(library, cfg, stats=True, bias_grad=False):
    shape = torch_plans.plan_shape(cfg, stats, bias_grad)
    return library.fusedattn_torch_plan(0, 1 if cfg.is_training else -1, (ctypes.c_int64 * len(shape))(*shape),
                                        len(shape), cfg.scale)


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
    out, lse = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, *PLAIN)
    assert out.shape == (*q.shape[:-1], 32) and out.dtype == torch.bfloat16
    base = {"bshd": "BSHD", "sbhd": "SBHD", "bhsd": "BHSD"}[layout]
    dense = torch.empty([{"B": 2, "S": 48, "H": 4, "D": 32}[a] for a in base], device="meta")
    assert out.stride() == tuple(dense.permute([base.index(a) for a in base]).stride())
    assert lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    grads = torch.ops.fusedattn_native.backward(plan, torch.empty_like(out), None, q, k, v, out, lse, None, None, None,
                                                *PLAIN[:3], None)
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert len(grads) == 3  # no sink, no dSink


def test_inference_plans_return_no_lse(operator):
    plan = _register(operator, _cfg(is_training=False), stats=False)
    q, k, v = (_meta(_cfg(), role) for role in ("q", "k", "v"))
    _, lse = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, *PLAIN)
    assert lse.numel() == 0


def test_the_cpp_autograd_node_runs_the_backward_operator(operator):
    cfg = _cfg(softmax="learnable")
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    sink = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, sink, None, None, *PLAIN)
    assert out.grad_fn.name() == "FusedAttentionBackward" and lse.grad_fn is out.grad_fn
    assert len(out.grad_fn.next_functions) == 5  # q, k, v, sink, bias (none here)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    assert sink.grad.shape == (4,) and sink.grad.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()  # the node released its saved tensors


def test_the_node_is_made_only_when_a_gradient_is_wanted(operator):
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, *PLAIN)
    assert out.grad_fn is None and not out.requires_grad
    k.requires_grad_(True)
    with torch.no_grad():
        assert torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, *PLAIN)[0].grad_fn is None
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, *PLAIN)
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
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, *PLAIN)
    (out.sum() + lse.sum()).backward()  # meta kernels check shapes only
    assert q.grad.shape == q.shape


def test_shapes_other_than_the_plans_are_refused(operator):
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    with pytest.raises(RuntimeError, match=r"q: expected shape \[2, 48, 4, 64\]"):
        torch.ops.fusedattn_native.forward(plan, k, k, v, None, None, None, *PLAIN)


def test_the_registry_is_bounded_and_says_when_a_plan_was_dropped(operator):
    try:
        operator.fusedattn_torch_bounds(4)
        plans = [_register(operator, _cfg()) for _ in range(10)]
        assert operator.fusedattn_torch_bounds(0) == 4
        q, k, v = (_meta(_cfg(), role) for role in ("q", "k", "v"))
        with pytest.raises(RuntimeError, match=f"native plan {plans[0]} is not registered in this process"):
            torch.ops.fusedattn_native.forward(plans[0], q, k, v, None, None, None, *PLAIN)
        torch.ops.fusedattn_native.forward(plans[-1], q, k, v, None, None, None, *PLAIN)
    finally:
        operator.fusedattn_torch_bounds(torch_plans.PLAN_CAPACITY)


def test_plans_with_a_wrong_shape_list_are_refused(operator):
    assert operator.fusedattn_torch_plan(0, 1, (ctypes.c_int64 * 3)(1, 2, 3), 3, 1.0) == -1
    shape = torch_plans.plan_shape(_cfg(), True)
    shape[-1] = 2  # two scalars announced, no type given for them
    assert operator.fusedattn_torch_plan(0, 1, (ctypes.c_int64 * len(shape))(*shape), len(shape), 1.0) == -1


@pytest.mark.parametrize("changes, reason", [
    (dict(return_max_logit=True, mask="padding"), "return_max_logit with sequence lengths"),
    (dict(mask="causal_bottom_right", seqlen_q=64, seqlen_kv=40), "rows without keys"),
])
def test_the_operator_declines_what_it_does_not_run(changes, reason):
    assert any(reason in r for r in torch_plans.reasons(_cfg(**changes)))
    assert torch_plans.reasons(_cfg()) == []


@pytest.mark.parametrize("changes", [dict(layout="thd", mask="padding_causal"), dict(mask="padding"),
                                     dict(return_max_logit=True),
                                     dict(layout="thd", mask="padding", padded_offsets=True, dropout_p=0.1),
                                     dict(layout="thd", mask="padding", score_mod_key="mod"),
                                     dict(mask="padding_causal", score_mod_key="mod")])
def test_the_operator_runs_padded_and_thd_calls(changes):
    assert torch_plans.reasons(_cfg(**changes)) == []


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


@pytest.fixture(params=["python", "native"])
def signature_key(request, monkeypatch):
    """The plan-cache signature's tensor part as each process computes it: in Python, or through the
    library's tensor_key where the library is loaded with its Python entry."""
    if request.param == "native":
        monkeypatch.setattr(torch_plans, "tensor_key", request.getfixturevalue("tensor_key"))
    else:
        monkeypatch.setattr(torch_plans, "tensor_key", None)
    return request.param


def test_validation_is_never_skipped_by_the_plan_cache(signature_key):
    import fusedattn.torch as fat
    from fusedattn.selection import clear_decisions

    clear_decisions()  # the other parametrization's plans
    q = torch.randn(1, 8, 2, 16)
    fat.attention(q, q, q, window=(2, 0))
    with pytest.raises(ValueError, match=r"window: expected \(left, right\), two integers"):
        fat.attention(q, q, q, window=(2.0, 0))
    fat.attention(q, q, q, deterministic=True)
    with pytest.raises(ValueError, match="deterministic: expected a bool, got 1"):
        fat.attention(q, q, q, deterministic=1)
    fat.attention(q, q, q, scale=0.5)
    fat.attention(q, q, q, scale=1)  # an int scale is valid, and its own plan
    fat.attention(q, q, q, return_lse=False)
    with pytest.raises(ValueError, match="return_lse: expected a bool, got 0"):
        fat.attention(q, q, q, return_lse=0)


def test_a_call_that_loads_the_library_keeps_its_plan_under_the_librarys_key(tensor_key, monkeypatch):
    """The first call of a process loads the library while it runs (it selects, then registers): its plan
    is kept under the signature the next call computes, with the library's tensor_key, so the second
    call is already warm."""
    import fusedattn.torch as fat
    from fusedattn.selection import clear_decisions, recall_call
    from fusedattn.torch import functional

    clear_decisions()
    monkeypatch.setattr(torch_plans, "tensor_key", None)
    plan_on = functional._native_plan_on

    def loading(*args):  # what registering the first plan does to the module
        monkeypatch.setattr(torch_plans, "tensor_key", tensor_key)
        return plan_on(*args)

    monkeypatch.setattr(functional, "_native_plan_on", loading)
    q = torch.randn(1, 8, 2, 16)
    fat.attention(q, q, q, mask="causal")
    assert torch_plans.tensor_key is tensor_key
    assert recall_call(functional._signature(q, q, q, None, None, (), {"mask": "causal"}, None)) is not None


def test_the_tensor_key_tells_apart_what_a_plan_depends_on(tensor_key):
    """The library's tensor_key: equal bytes for tensors alike in shape, strides, dtype, device and
    requires_grad (whatever their values), different bytes when any of those differs; None for an
    argument that is no strided tensor (the full path explains it)."""
    x = torch.randn(2, 3, 4)
    key = tensor_key(x, None, x)
    assert isinstance(key, bytes) and key == tensor_key(torch.randn(2, 3, 4), None, torch.zeros(2, 3, 4))
    others = [(x.reshape(3, 2, 4), None, x), (x.transpose(0, 1).contiguous().transpose(0, 1), None, x),
              (x.double(), None, x), (x.to("meta"), None, x), (x.clone().requires_grad_(True), None, x),
              (x, x, None), (x, None, x, None), (x, None), (x[:, :, :2], None, x)]
    keys = [tensor_key(*args) for args in others]
    assert key not in keys and len(set(keys)) == len(keys)
    assert tensor_key(x, "x") is None and tensor_key(x.to_sparse()) is None and tensor_key() == b""
    with pytest.warns(UserWarning, match="nested tensors is in prototype stage"):
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
    assert tensor_key(x, nested) is None  # its sizes raise in C++: no key, never a crash


@pytest.mark.parametrize("odd", ["nested", "sparse"])
def test_nested_and_sparse_tensors_are_refused_by_name(signature_key, odd):
    import warnings

    import fusedattn.torch as fat

    x = torch.randn(1, 4, 2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bad = (torch.nested.nested_tensor([torch.randn(4, 2, 8), torch.randn(3, 2, 8)]) if odd == "nested"
               else x.to_sparse())
    expected = "a nested tensor" if odd == "nested" else "a sparse_coo tensor"
    with pytest.raises(ValueError, match=f"q: expected a dense \\(strided\\) torch.Tensor, got {expected}"):
        fat.attention(bad, x, x)
    with pytest.raises(ValueError, match=f"bias: expected a dense \\(strided\\) torch.Tensor, got {expected}"):
        fat.attention(x, x, x, bias=bad)


@pytest.fixture(scope="module")
def entry(operator):
    """The library's Python entry (built where Python's headers are, as here)."""
    if build.python_headers() is None:
        pytest.skip("this interpreter has no C headers: the library is built without its Python entry")
    found = torch_plans.python_module(operator._name)
    assert found is not None, "built with Python's headers, yet the library has no Python entry"
    return found.attention


@pytest.fixture(scope="module")
def tensor_key(operator, entry):
    return torch_plans.python_module(operator._name).tensor_key


def test_the_python_entry_calls_the_operator_with_its_autograd(operator, entry):
    cfg = _cfg(softmax="learnable")
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    sink = torch.empty(4, device="meta", dtype=torch.bfloat16, requires_grad=True)
    out, lse = entry(plan, q, k, v, sink, None, None)
    expected = torch.ops.fusedattn_native.attention(plan, q, k, v, sink, None, None, *PLAIN)
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
    ops = lambda *args: torch.ops.fusedattn_native.attention.default(*args, *PLAIN)  # noqa: E731
    for call in (entry, ops):
        with pytest.raises(RuntimeError, match=r"q: expected shape \[2, 48, 4, 64\]") as raised:
            call(plan, k, k, v, None, None, None)
        assert "Exception raised from" not in str(raised.value)  # no C++ backtrace
        with pytest.raises(RuntimeError, match="native plan 123456789 is not registered in this process"):
            call(123456789, q, k, v, None, None, None)
        with pytest.raises(NotImplementedError, match="fusedattn_native::forward"):  # no CPU kernel
            call(plan, *(torch.empty(x.shape, dtype=x.dtype) for x in (q, k, v)), None, None, None)


def test_the_python_entry_names_a_bad_argument(operator, entry):
    """The entry reads its arguments from CPython itself: a wrong one is a TypeError naming it, and every
    trailing operand may be left out or given (as torch.ops takes them)."""
    cfg = _cfg()
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    bad = {"plan": ("7", q, k, v, None, None, None), "k": (plan, q, "k", v, None, None, None),
           "sink": (plan, q, k, v, 1.0, None, None), "aux": (plan, q, k, v, None, None, None, None, q),
           "scalars": (plan, q, k, v, None, None, None, None, [], ["x"]),
           "empty_rows": (plan, q, k, v, None, None, None, None, [], [], 1),
           "offsets": (plan, q, k, v, None, None, None, None, [], [], False, [None])}
    for name, args in bad.items():
        with pytest.raises(TypeError, match=f"fusedattn_native.attention: {name}: expected"):
            entry(*args)
    for args in ((plan, q, k, v, None, None), (plan, q, k, v, None, None, None, *PLAIN, None)):
        with pytest.raises(TypeError, match=f"expected 7 to 12 positional arguments, got {len(args)}"):
            entry(*args)
    shapes = {entry(plan, q, k, v, None, None, None, *PLAIN[:n])[0].shape for n in range(len(PLAIN) + 1)}
    assert shapes == {(2, 48, 4, 32)}
    assert entry(plan, q, k, v, None, None, None, None, (), (), False, ())[0].shape == (2, 48, 4, 32)


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


# ---------------------------------------------------------------- bias and score_mod operands

@pytest.mark.parametrize("user_shape, config_shape", [((4, 48, 40), (1, 4, 48, 40)), ((2, 4, 1, 40), (2, 4, 1, 40)),
                                                      ((1, 4, 48, 1), (1, 4, 48, 1))])
@pytest.mark.parametrize("kind", ["post_scale", "pre_scale"])
def test_a_learnable_bias_gets_its_gradient_in_its_own_shape_and_dtype(operator, user_shape, config_shape, kind):
    cfg = _cfg(bias=kind, bias_shape=config_shape, bias_requires_grad=True, mask="none")
    plan = _register(operator, cfg, bias_grad=True)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    bias = torch.empty(user_shape, device="meta", dtype=torch.float32, requires_grad=True)
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, bias, [], [], False, [])
    assert len(out.grad_fn.next_functions) == 5  # q, k, v, sink (none), bias
    out.sum().backward()
    assert bias.grad.shape == user_shape and bias.grad.dtype == torch.float32
    assert q.grad.shape == q.shape


def test_a_bias_of_another_size_is_refused(operator):
    cfg = _cfg(bias="post_scale", bias_shape=(1, 4, 48, 40), mask="none")
    plan = _register(operator, cfg)
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    with pytest.raises(RuntimeError, match=r"bias: expected \[1, 4, 48, 40\] elements' worth"):
        torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None,
                                           torch.empty(4, 48, 39, device="meta"), [], [], False, [])
    with pytest.raises(RuntimeError, match="this plan needs the bias"):
        torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, *PLAIN)


def _softcap_config(**changes):
    """A config with a traced flex score_mod (softcap plus a per-head term), and its bound values."""
    from fusedattn.score_mods import tanh
    from fusedattn.score_mods.core import as_score_mod, bind

    slopes = torch.rand(4)

    def softcap(score, b, h, q_idx, kv_idx):
        return 30.0 * tanh(score / 30.0) + slopes[h]

    cfg = _cfg(**changes)
    mod = as_score_mod("test", softcap, framework="torch", device=torch.device("cpu"))
    bound = bind("test", mod, batch=cfg.batch, heads_q=cfg.heads_q, seqlen_q=cfg.seqlen_q, seqlen_kv=cfg.seqlen_kv,
                 device="cpu", training=cfg.is_training, like=torch.empty(1))
    return cfg.replace(score_mod_key=bound.key, score_mod_recipe=bound.recipe), bound


def test_score_mod_operands_follow_the_graphs_names_and_the_masks_inputs():
    cfg, bound = _softcap_config()
    operands = torch_plans.operands(cfg)
    names = operands.graph_names()
    assert names[:1] == ("mod:f.a0",) and names[-3:] == ("sm_masked", "sm_col_shift", "sm_right")  # causal
    assert operands.value_names() == names[1:]  # the rest pass by value: their slots register as value slots
    aux, scalars = operands.values(bound.values)
    assert [tuple(a.shape) for a in aux] == [(1, 4, 1, 1)]
    assert 30.0 in scalars and scalars[-3:] == [MASKED, 0, 0]
    assert operands.types() == [0] * (len(scalars) - 2) + [1, 1]  # float32 numbers, int32 window bounds
    assert torch_plans.operands(_cfg()) == torch_plans.Operands()
    assert torch_plans.operands(_softcap_config(mask="none")[0]).constants == ()


def test_score_mod_operands_are_counted_against_the_plan(operator):
    cfg, bound = _softcap_config()
    plan = _register(operator, cfg)
    aux, scalars = torch_plans.operands(cfg).values(bound.values)
    aux = [torch.empty(a.shape, device="meta") for a in aux]
    q, k, v = (_meta(cfg, role) for role in ("q", "k", "v"))
    out, lse = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, aux, scalars, False, [])
    assert out.shape == (*q.shape[:-1], 32)
    with pytest.raises(RuntimeError, match=r"expected 1 score_mod aux tensors \(the registered plan's\), got 0"):
        torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, [], scalars, False, [])
    with pytest.raises(RuntimeError, match=f"expected {len(scalars)} score_mod scalars"):
        torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, aux, scalars[1:], False, [])


def test_empty_rows_keep_the_backwards_stats_apart_and_aux_that_learn_are_refused(operator):
    cfg, bound = _softcap_config()
    plan = _register(operator, cfg)
    aux, scalars = torch_plans.operands(cfg).values(bound.values)
    aux = [torch.empty(a.shape, device="meta") for a in aux]
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    outputs = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, aux, scalars, True, [])
    assert len(outputs) == 3 and outputs[2].shape == outputs[1].shape  # the stats the backward reads
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, aux, scalars, True, [])
    out.sum().backward()
    assert q.grad.shape == q.shape
    learning = [aux[0].clone().requires_grad_(True)]
    with pytest.raises(RuntimeError, match="aux tensors that require grad"):
        torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, learning, scalars, True, [])
    with torch.no_grad():  # nothing learns here
        torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, learning, scalars, True, [])


# ---------------------------------------------------------------- padded and THD plans


def _sequence_plan(library, cfg, stats=True):
    from fusedattn.backends.cudnn.native import sequence_plans

    plan = _register(library, cfg, stats)
    values = sequence_plans.values(cfg)
    assert library.fusedattn_torch_sequences(plan, (ctypes.c_int64 * len(values))(*values), len(values)) == 0
    return plan


def _offsets(batch, count=2):
    return [torch.empty(batch + 1, dtype=torch.int32, device="meta") for _ in range(count)]


def test_thd_plans_take_tokens_and_return_the_table_for_the_backward(operator):
    cfg = _cfg(layout="thd", mask="padding_causal", heads_kv=4)
    plan = _sequence_plan(operator, cfg)
    q = torch.empty(70, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(55, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(55, 4, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    outputs = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, [], [], False, _offsets(2))
    out, lse, table = outputs  # THD: the LSE is the stats the backward reads
    assert out.shape == (70, 4, 32) and lse.shape == (70, 4) and table.dtype == torch.int32
    from fusedattn.backends.cudnn.sequences import config_layout

    layout = config_layout(cfg)
    assert table.shape == (layout.rows, layout.width)
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, [], [], False,
                                                    _offsets(2))
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    with pytest.raises(RuntimeError, match="this plan takes 2 offset tensors, got 0"):
        torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, *PLAIN)
    with pytest.raises(RuntimeError, match=r"cu_seqlens_kv: expected 3 offsets"):
        torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, [], [], False,
                                           [_offsets(2)[0], _offsets(3)[0]])
    with pytest.raises(RuntimeError, match=r"expected a THD tensor \(T, 4, 64\)"):
        torch.ops.fusedattn_native.forward(plan, q[:, :2], k, v, None, None, None, None, [], [], False, _offsets(2))


def test_thd_offsets_past_int32_are_refused(operator):
    cfg = _cfg(layout="thd", mask="padding", heads_kv=4, is_training=False)
    plan = _sequence_plan(operator, cfg, stats=False)
    tokens = 2**31 // (4 * 64) + 1
    q = torch.empty(tokens, 4, 64, dtype=torch.bfloat16, device="meta")
    v = torch.empty(tokens, 4, 32, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match="past cuDNN's int32 ragged offsets"):
        torch.ops.fusedattn_native.forward(plan, q, q, v, None, None, None, None, [], [], False, _offsets(2))


@pytest.mark.parametrize("training", [True, False])
def test_padded_plans_keep_the_stats_apart_from_the_lse(operator, training):
    cfg = _cfg(mask="padding", softmax="learnable", is_training=training)
    plan = _sequence_plan(operator, cfg, stats=training)
    q, k, v = (_meta(cfg, role, requires_grad=training) for role in ("q", "k", "v"))
    sink = torch.empty(4, device="meta", requires_grad=training)
    outputs = torch.ops.fusedattn_native.forward(plan, q, k, v, sink, None, None, None, [], [], False, _offsets(2))
    if not training:
        assert len(outputs) == 2 and outputs[1].numel() == 0
        return
    out, lse, stats, table = outputs
    assert lse.shape == stats.shape == (2, 4, 48) and table.dtype == torch.int32
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, sink, None, None, None, [], [], False,
                                                    _offsets(2))
    out.sum().backward()
    assert q.grad.shape == q.shape and sink.grad.shape == (4,)
    with pytest.raises(RuntimeError, match="takes its forward's sequence table"):
        torch.ops.fusedattn_native.backward(plan, torch.empty_like(out), None, q, k, v, out, lse, sink, None, None,
                                            *PLAIN[:3], None)


def test_the_sequence_plan_lists_the_rows_each_slot_reads():
    from fusedattn.backends.cudnn.native import sequence_plans

    cfg = _cfg(layout="thd", mask="padding", heads_kv=4, padded_offsets=True)
    values = sequence_plans.values(cfg)
    forward_rows = values[-21:-12]
    backward_rows = values[-12:]
    assert values[:2] == [1, 1] and forward_rows[:2] == [0, 1]  # lengths first, then ragged offsets
    assert all(row >= 4 for row in forward_rows[2:7]) and len(set(forward_rows[2:7])) == 5
    assert forward_rows[7:] == [-1, -1]  # no score_mod: no penalties
    assert backward_rows[:9] == forward_rows  # the backward shares the forward's table
    padded = sequence_plans.values(_cfg(mask="padding"))
    assert padded[-21:-12] == [0, 1, -1, -1, -1, -1, -1, -1, -1]  # lengths only
    assert padded[11] == 1  # the table kernel's programs
    scored = sequence_plans.values(_cfg(mask="padding", score_mod_key="mod"))
    from fusedattn.backends.cudnn.sequences import config_layout

    layout = config_layout(_cfg(mask="padding", score_mod_key="mod"))
    assert scored[11] == 1 + 2 and scored[4] == layout.rows  # a program per sequence writes its penalties
    assert scored[-21:-12] == [0, 1, -1, -1, -1, -1, -1, *layout.penalty_rows]
    assert scored[-12:-3] == scored[-21:-12]


def test_the_sequence_kernels_compile_for_the_operator_without_scratch():
    """The kernels compile with the signature the C++ launch passes (every int64, no alignment assumed),
    for a Hopper target, on this CPU machine: the operator launches them as they are. (In a process of
    its own: Triton's interpreter, on in this one, cannot compile.)"""
    import inspect
    import json
    import os
    import subprocess
    import sys

    from fusedattn.backends.cudnn import sequence_kernels

    script = """if True:
        import json
        import triton
        from triton.backends.compiler import GPUTarget
        ptx, compile_now = [], triton.compile

        def recording(*args, **kwargs):
            compiled = compile_now(*args, **kwargs)
            ptx.append([compiled.metadata.name, "st.global.v4" in compiled.asm["ptx"]])
            return compiled

        triton.compile = recording
        from fusedattn.backends.cudnn.native import sequence_plans
        from fusedattn.config import AttentionConfig
        cfg = AttentionConfig(dtype="bfloat16", layout="thd", batch=2, seqlen_q=48, seqlen_kv=40, heads_q=4,
                              heads_kv=4, head_dim_qk=64, head_dim_v=32, mask="padding_causal", softmax="learnable",
                              device="cuda", is_training=True)
        compiled = sequence_plans.kernels(cfg, stats=True, target=GPUTarget("cuda", 90, 32))
        scored = AttentionConfig(dtype="bfloat16", layout="bshd", batch=3, seqlen_q=48, seqlen_kv=40, heads_q=4,
                                 heads_kv=4, head_dim_qk=64, head_dim_v=32, mask="padding", score_mod_key="mod",
                                 device="cuda", is_training=True)
        compiled[1:1] = sequence_plans.kernels(scored, stats=True, target=GPUTarget("cuda", 90, 32))[:2]
        print(json.dumps([[image[:4].hex(), name, warps, shared] for image, name, warps, shared in compiled]))
        print(json.dumps(ptx))
    """
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = json.loads(result.stdout.strip().splitlines()[-2])
    # The fix-ups store 16 bytes at once (compiled without the hints, each element was a store of its own)
    wide_stores = json.loads(result.stdout.strip().splitlines()[-1])
    assert [wide for name, wide in wide_stores if name.startswith("fix_rows")] == [True] * 6, wide_stores
    assert len(compiled) == 6 and all(magic == "7f454c46" and warps >= 1 for magic, _, warps, _ in compiled)
    assert all(c[1].startswith("sequence_tables") for c in compiled[:2])  # without and with penalties
    assert all(c[1].startswith("fix_rows") for c in compiled[2:])  # the first writes the backward's stats too

    def runtime_arguments(kernel):  # the words C++ passes: one per argument that is not a constexpr
        parameters = inspect.signature(kernel.fn).parameters.values()
        return [p.name for p in parameters if "constexpr" not in str(p.annotation)]

    assert len(runtime_arguments(sequence_kernels.fix_rows)) == 24  # fix_rows's words in torch_op.cc
    assert len(runtime_arguments(sequence_kernels.sequence_tables)) == 11


def test_max_logit_plans_return_the_lse_and_the_largest_logit_per_head(operator):
    cfg = _cfg(return_max_logit=True)
    plan = _register(operator, cfg, stats=False)
    q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
    out, lse, max_logit = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, *PLAIN)
    assert lse.shape == (2, 4, 48) and max_logit.shape == (4,) and max_logit.dtype == torch.float32
    out, lse, max_logit = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, *PLAIN)
    assert out.grad_fn is lse.grad_fn is not None and max_logit.grad_fn is None
    out.sum().backward()  # the backward reads the LSE made from the row maxima
    assert q.grad.shape == q.shape


def test_thd_plans_take_dense_rows_as_tokens_and_give_dense_outputs(operator):
    """A document mask's THD call passes dense (B, S, H, D) tensors (torch/functional.py): out and the LSE come
    back dense, (B, S, H, Dv) and (B, H, S), and the gradients in the inputs' shapes, from one autograd node
    with the inputs themselves as its edges (no view nodes between)."""
    cfg = _cfg(layout="thd", mask="padding_causal", heads_kv=4)
    plan = _sequence_plan(operator, cfg)
    q = torch.empty(3, 24, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    k = torch.empty(3, 24, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    v = torch.empty(3, 24, 4, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, [], [], False,
                                                    _offsets(2))
    assert out.shape == (3, 24, 4, 32) and out.is_contiguous() and not out._is_view()
    assert lse.shape == (3, 4, 24) and lse.stride() == (96, 1, 4)
    assert out.grad_fn.name() == "FusedAttentionBackward" and lse.grad_fn is out.grad_fn
    assert [edge[0].name() for edge in out.grad_fn.next_functions[:3]] == ["torch::autograd::AccumulateGrad"] * 3
    (out.sum() + lse.sum() * 0).backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.is_contiguous()
    # out is saved for the backward: changed in place after the forward, autograd says so (its version counts)
    out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, [], [], False,
                                                    _offsets(2))
    with torch.no_grad():
        out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    # Rows that are not evenly strided (a slice of longer ones) are copied into tokens; one batch row is read
    # where it lies.
    for rows in (torch.empty(3, 30, 4, 64, dtype=torch.bfloat16, device="meta")[:, 3:27],
                 torch.empty(1, 24, 8, 64, dtype=torch.bfloat16, device="meta")[:, :, ::2]):
        kv = (rows.new_empty(rows.shape), rows.new_empty(rows.shape[:3] + (32,)))
        rows.requires_grad_(True)
        out, lse = torch.ops.fusedattn_native.attention(plan, rows, *kv, None, None, None, None, [], [], False,
                                                        _offsets(2))
        assert out.shape == rows.shape[:3] + (32,) and lse.shape == (rows.shape[0], 4, 24)
        out.sum().backward()
        assert rows.grad.shape == rows.shape
    with pytest.raises(RuntimeError, match="takes k and v of q's batch"):
        torch.ops.fusedattn_native.attention(plan, q, k.reshape(72, 4, 64), v, None, None, None, None, [], [], False,
                                             _offsets(2))


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_score_mod_plans_with_sequences_keep_the_backwards_stats_apart(operator, layout):
    """A score_mod with padding or THD: the table holds the graph's penalties, and a training forward
    returns the stats its backward reads (+inf where the LSE is -inf) apart from the LSE, with or
    without the empty-rows fix."""
    from fusedattn.backends.cudnn.sequences import config_layout

    cfg = _cfg(layout=layout, mask="padding", heads_kv=4, score_mod_key="mod")
    plan = _sequence_plan(operator, cfg)
    if layout == "thd":
        q = torch.empty(70, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
        k = torch.empty(55, 4, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
        v = torch.empty(55, 4, 32, dtype=torch.bfloat16, device="meta", requires_grad=True)
        lse_shape = (70, 4)
    else:
        q, k, v = (_meta(cfg, role, requires_grad=True) for role in ("q", "k", "v"))
        lse_shape = (2, 4, 48)
    for empty_rows in (False, True):
        out, lse, stats, table = torch.ops.fusedattn_native.forward(plan, q, k, v, None, None, None, None, [], [],
                                                                    empty_rows, _offsets(2))
        assert lse.shape == stats.shape == lse_shape and table.shape == (config_layout(cfg).rows, 4)
        out, lse = torch.ops.fusedattn_native.attention(plan, q, k, v, None, None, None, None, [], [], empty_rows,
                                                        _offsets(2))
        out.sum().backward()
        assert q.grad.shape == q.shape and v.grad.shape == v.shape
