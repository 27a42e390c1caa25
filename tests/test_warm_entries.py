"""Warm entries (torch/warm_entries.py, backends/cudnn/native/warm_entries.h): repeat calls answered in C.

The real library runs here on the CPU: its operator dispatches to a CPU kernel registered by this module,
which writes into every output a number naming the plan and operands it was given, so each test sees
which answer a call got. A call is the Python path's until Python hands its answer over; then C answers
it while its key (q, k, v, keywords with types, grad mode, settings) and guards (what callbacks read,
captured tensors' versions) hold, and the Python path otherwise, which validates as always.
"""

from __future__ import annotations

import ctypes
import shutil

import pytest
import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import torch_plans
from fusedattn.cache import clear_all
from fusedattn.selection import ENV_BACKEND, clear_decisions
from fusedattn.torch import functional, warm_entries

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler")


def _stamp(plan, aux, scalars) -> float:
    """The number a call's outputs hold: its plan and operands."""
    return plan * 1000.0 + sum(scalars) + sum(float(x.float().sum()) for x in aux)


def _forward(plan, q, k, v, sink, seed, offset, bias, aux, scalars, empty_rows, offsets):
    stamp = _stamp(plan, aux, scalars) + (0 if seed is None else int(seed) * 1e-12)  # (the seed too, exactly)
    out = torch.full((*q.shape[:-1], v.shape[-1]), stamp, dtype=torch.float64)
    return [out, torch.zeros(q.shape[0], q.shape[2], q.shape[1])]


def _backward(plan, grad_out, grad_lse, q, k, v, out, stats, sink, seed, offset, bias, aux, scalars, table):
    return [torch.full_like(x, _stamp(plan, aux, scalars), dtype=torch.float64) for x in (q, k, v)]


@pytest.fixture(scope="module")
def library(native_torch_build):
    """The operator library with its Python module, and CPU kernels for its ops."""
    path = native_torch_build[0]
    operator = torch_plans.load_operator(path)
    module = torch_plans.python_module(path)
    if module is None:
        pytest.skip("this interpreter has no C headers: the library is built without its Python entry")
    kernels = torch.library.Library("fusedattn_native", "IMPL", "CPU")
    kernels.impl("forward", _forward)
    kernels.impl("backward", _backward)
    yield operator, module
    kernels._destroy()


@pytest.fixture
def warm(library, monkeypatch):
    """The warm path wired to the library: every config gets a real plan (bf16 BSHD here), counted calls."""
    operator, module = library
    for name in ("warm_call", "warm_remember", "warm_clear", "warm_size"):
        monkeypatch.setattr(torch_plans, name, getattr(module, name))
    monkeypatch.setattr(torch_plans, "entry", module.attention)
    monkeypatch.setattr(torch_plans, "tensor_key", module.tensor_key)
    warm_entries.configure(module)
    plans: dict = {}

    def plan_on(cfg, name, device):
        if cfg not in plans:
            shape = torch_plans.plan_shape(cfg, True)
            plans[cfg] = operator.fusedattn_torch_plan(0, 1 if cfg.is_training else -1,
                                                       (ctypes.c_int64 * len(shape))(*shape), len(shape), cfg.scale)
        return plans[cfg]

    python_calls = []
    original = functional._operator

    def counted(*args):
        python_calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(functional, "_native_plan_on", plan_on)
    monkeypatch.setattr(functional, "_operator", counted)
    clear_decisions()
    yield python_calls
    clear_all()
    module.warm_clear()


def _qkv(requires_grad=False, seqlen=16):
    return [torch.randn(1, seqlen, 2, 8, dtype=torch.bfloat16, requires_grad=requires_grad) for _ in range(3)]


def _runs(python_calls, call, times=3) -> list[str]:
    """Which path answered each of `times` calls: 'python' or 'c'."""
    paths = []
    for _ in range(times):
        before = len(python_calls)
        call()
        paths.append("python" if len(python_calls) > before else "c")
    return paths


def test_a_plain_repeat_call_is_answered_in_c_with_the_python_paths_output(warm):
    q, k, v = _qkv()
    outputs = []
    assert _runs(warm, lambda: outputs.append(fat.attention(q, k, v, mask="causal")), 4) == [
        "python", "python", "c", "c"]  # cold, warm in Python (hands its answer over), then C
    assert all(torch.equal(out, outputs[0]) for out in outputs) and outputs[0].shape == (1, 16, 2, 8)
    assert warm_entries.size() == 1


def test_validation_is_never_skipped_by_a_warm_entry(warm):
    q, k, v = _qkv()
    assert _runs(warm, lambda: fat.attention(q, k, v, window=(2, 0))) == ["python", "python", "c"]
    with pytest.raises(ValueError, match="window"):
        fat.attention(q, k, v, window=(2.0, 0))
    with pytest.raises(ValueError, match="scale"):
        fat.attention(q, k, v, window=(2, 0), scale=-1.0)
    assert _runs(warm, lambda: fat.attention(q, k, v, window=(2, 0)), 1) == ["c"]


def test_what_a_key_holds_sends_other_calls_to_python(warm, monkeypatch):
    q, k, v = _qkv()
    assert _runs(warm, lambda: fat.attention(q, k, v, mask="causal")) == ["python", "python", "c"]
    assert _runs(warm, lambda: fat.attention(q, k, v, mask="causal", scale=0.5), 2) == ["python", "python"]
    assert _runs(warm, lambda: fat.attention(q, k[:, :8], v[:, :8], mask="causal"), 2) == ["python", "python"]
    assert _runs(warm, lambda: fat.attention(q, k.transpose(1, 2).contiguous().transpose(1, 2), v, mask="causal"),
                 1) == ["python"]  # other strides
    q.requires_grad_(True)
    assert _runs(warm, lambda: fat.attention(q, k, v, mask="causal"), 2) == ["python", "python"]
    with torch.no_grad():
        assert _runs(warm, lambda: fat.attention(q, k, v, mask="causal"), 2) == ["python", "python"]
    monkeypatch.setenv(ENV_BACKEND, "reference")
    assert _runs(warm, lambda: fat.attention(q, k, v, mask="causal"), 1) == ["python"]
    monkeypatch.delenv(ENV_BACKEND)
    q.requires_grad_(False)
    assert _runs(warm, lambda: fat.attention(q, k, v, mask="causal"), 1) == ["c"]


def test_tensors_that_override_torch_functions_and_modes_take_the_python_path(warm):
    q, k, v = _qkv()
    for _ in range(3):
        fat.attention(q, k, v)

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():
        assert _runs(warm, lambda: fat.attention(q, k, v), 1) == ["python"]

    class Sub(torch.Tensor):
        pass

    assert _runs(warm, lambda: fat.attention(q.as_subclass(Sub), k, v), 1) == ["python"]
    assert _runs(warm, lambda: fat.attention(q, k, v), 1) == ["c"]


def test_a_closures_new_number_is_bound_again_and_an_equal_one_stays_in_c(warm):
    q, k, v = _qkv()
    cap = 20.0

    def softcap(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)

    outputs = []
    call = lambda: outputs.append(fat.attention(q, k, v, score_mod=softcap))  # noqa: E731
    assert _runs(warm, call) == ["python", "python", "c"]
    cap = 30.0
    assert _runs(warm, call) == ["python", "python", "c"]
    assert not torch.equal(outputs[0], outputs[-1])  # the new cap reached the operator: other scalars
    cap = float("30")  # a new object of the same value: the same read
    assert _runs(warm, call, 1) == ["c"]
    assert torch.equal(outputs[-1], outputs[-2])


def test_a_captured_tensor_changed_in_place_leaves_c(warm):
    q, k, v = _qkv()
    slopes = torch.rand(2)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    outputs = []
    call = lambda: outputs.append(fat.attention(q, k, v, score_mod=alibi))  # noqa: E731
    assert _runs(warm, call) == ["python", "python", "c"]
    slopes.mul_(2)  # in place: its version
    assert _runs(warm, call) == ["python", "python", "c"]
    assert not torch.equal(outputs[2], outputs[-1])  # the aux tensor made anew from the new values


def test_a_closure_over_a_dict_stays_in_python_and_sees_its_changes(warm):
    q, k, v = _qkv()
    table = {"slopes": torch.rand(2)}

    def alibi(score, b, h, q_idx, kv_idx):
        return score + table["slopes"][h] * (kv_idx - q_idx)

    outputs = []
    call = lambda: outputs.append(fat.attention(q, k, v, score_mod=alibi))  # noqa: E731
    assert _runs(warm, call) == ["python"] * 3  # its items are looked inside: Python's check
    table["slopes"] = torch.rand(2) + 1
    call()
    assert not torch.equal(outputs[2], outputs[-1])


def test_global_reads_are_guarded(warm):
    q, k, v = _qkv()
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=_global_softcap)) == ["python", "python", "c"]
    global _CAP
    before = _CAP
    try:
        _CAP = 7.0
        assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=_global_softcap), 1) == ["python"]
    finally:
        _CAP = before


_CAP = 20.0


def _global_softcap(score, b, h, q_idx, kv_idx):
    return _CAP * sm.tanh(score / _CAP)


def test_builtins_and_closures_made_once_or_each_call_run_in_c(warm):
    q, k, v = _qkv()
    once = sm.softcap(20.0)
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=once)) == ["python", "python", "c"]
    before = warm_entries.size()
    # built-ins made anew at each call key by what they are made of: the entry of the one made once
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=sm.softcap(20.0)), 3) == ["c"] * 3
    assert warm_entries.size() == before
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=sm.softcap(9.0)), 3) == ["python", "python", "c"]
    assert warm_entries.size() == before + 1
    before += 1

    def closure(cap):
        return lambda score, b, h, q_idx, kv_idx: cap * sm.tanh(score / cap)

    # a closure made anew at each call keys by its code and what it closes over: answered in C
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=closure(20.0)), 4) == ["python", "python", "c", "c"]
    assert warm_entries.size() == before + 1
    outputs = [fat.attention(q, k, v, score_mod=closure(cap)) for cap in (20.0, 9.0, 20.0)]
    assert torch.equal(outputs[0], outputs[2]) and not torch.equal(outputs[0], outputs[1])
    assert torch.equal(outputs[1], fat.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: 9.0 * sm.tanh(s / 9.0)))

    def with_default(score, b, h, q_idx, kv_idx, cap=20.0):  # defaults are not keyed: no entry
        return cap * sm.tanh(score / cap)

    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=with_default), 3) == ["python"] * 3


def test_equal_builtins_made_once_in_each_layer_all_run_in_c(warm):
    """Layers that each make an equal built-in or closure once: the later layers' calls find the first
    layer's warm entry (keyed by what they are made of) and are answered in C from their first call."""
    q, k, v = _qkv()
    slopes = torch.rand(2)

    def closure(cap):
        return lambda score, b, h, q_idx, kv_idx: cap * sm.tanh(score / cap)

    layers_alibi = lambda: sm.alibi(slopes)  # noqa: E731
    for make in (lambda: sm.softcap(20.0), layers_alibi, lambda: closure(7.0)):
        layers = [make() for _ in range(3)]
        paths = [_runs(warm, lambda mod=mod: fat.attention(q, k, v, score_mod=mod), 4) for mod in layers]
        assert paths[0] == ["python", "python", "c", "c"]
        # keyed by what they are made of: C from the first call (ALiBi's closure holds objects of its own:
        # from the second, its own binding once seen twice)
        assert paths[1][1:] == paths[2][1:] == ["c"] * 3, paths
        assert make is layers_alibi or paths[1][0] == paths[2][0] == "c", paths
        outputs = [fat.attention(q, k, v, score_mod=mod) for mod in layers]
        assert all(torch.equal(out, outputs[0]) for out in outputs)


def test_compositions_and_alibi_made_anew_at_each_call_run_in_c(warm):
    """A built-in made anew at each call with helpers of its own (ALiBi's slope function) and compose() of
    built-ins key by what they are made of, helpers and parts included: answered in C after the first
    calls, while what they are made of and read is the same; another part, another number, another
    tensor or a tensor changed in place each give the Python path's answer."""
    q, k, v = _qkv()
    slopes, other = torch.rand(2), torch.rand(2)

    def composed(cap=20.0, table=slopes):
        return sm.compose(sm.softcap(cap), sm.alibi(table), sm.causal())

    for make in (lambda: sm.alibi(slopes), composed):
        paths = _runs(warm, lambda make=make: fat.attention(q, k, v, score_mod=make()), 5)
        assert paths[2:] == ["c"] * 3, paths
        assert torch.equal(fat.attention(q, k, v, score_mod=make()), _python_answer(q, k, v, score_mod=make()))
    before = warm_entries.size()
    for changed in (lambda: composed(cap=9.0), lambda: composed(table=other),
                    lambda: sm.compose(sm.softcap(20.0), sm.alibi(slopes)),
                    lambda: sm.compose(sm.alibi(slopes), sm.softcap(20.0), sm.causal())):
        got = fat.attention(q, k, v, score_mod=changed())
        assert torch.equal(got, _python_answer(q, k, v, score_mod=changed()))
    assert warm_entries.size() > before  # each a key of its own
    slopes.add_(1.0)  # read in place: the entries' guards see the new version
    got = [fat.attention(q, k, v, score_mod=composed()) for _ in range(3)]
    assert all(torch.equal(out, _python_answer(q, k, v, score_mod=composed())) for out in got)


def test_tuples_in_closures_key_by_their_items_up_to_a_length(warm):
    """A closure over a short tuple made anew at each call keys by the tuple's items (C after the first
    calls); over a long one (past 64 items) by the tuple's identity, so each new one takes the Python path."""
    q, k, v = _qkv()

    def make(length):
        weights = tuple(float(i % 3) / 4 for i in range(length))  # a new tuple object at each call
        return lambda score, b, h, q_idx, kv_idx: score * (1.0 + weights[1])

    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=make(4)), 5)[2:] == ["c"] * 3
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=make(65)), 4) == ["python"] * 4
    for length in (4, 65):
        assert torch.equal(fat.attention(q, k, v, score_mod=make(length)),
                           _python_answer(q, k, v, score_mod=make(length)))


def test_a_function_whose_cell_holds_itself_gets_a_bounded_key(warm):
    """A closure over itself (a recursive helper) has a key that stops following it: no endless key, the
    Python path's answer."""
    q, k, v = _qkv()

    def make(cap):
        def chained(score, b, h, q_idx, kv_idx):
            return cap * sm.tanh(score / cap) if chained is not None else score
        return chained

    for _ in range(3):
        fn = make(20.0)
        assert torch.equal(fat.attention(q, k, v, score_mod=fn), _python_answer(q, k, v, score_mod=fn))


def _python_answer(q, k, v, **options):
    """The Python path's answer to the call (the warm entries off)."""
    saved = torch_plans.warm_call
    torch_plans.warm_call = None
    try:
        return fat.attention(q, k, v, **options)
    finally:
        torch_plans.warm_call = saved


def test_generated_call_sequences_answer_as_the_python_path(warm):
    """Random sequences of calls with closures and built-ins made once and made anew, over numbers and
    tensors that change in place, and a global they read that is rebound: every answer, from C or from Python, is the
    Python path's for the call as it is then."""
    import random

    global _CAP
    rng = random.Random(46)
    q, k, v = _qkv()
    tensors = [torch.rand(2), torch.rand(2)]
    kept: dict = {}

    def make(kind, cap, values):
        if kind == 0:
            return lambda score, b, h, q_idx, kv_idx: cap * sm.tanh(score / cap)
        if kind == 1:
            return lambda score, b, h, q_idx, kv_idx: score + values[h] * (kv_idx - q_idx)
        if kind == 2:
            return lambda score, b, h, q_idx, kv_idx: score + values[h] / _CAP
        if kind == 5:
            return sm.compose(sm.softcap(cap), sm.alibi(values))
        return sm.softcap(cap) if kind == 3 else sm.alibi(values)  # built-ins

    before, paths = _CAP, set()
    try:
        for step in range(150):
            draw = rng.random()
            if draw < 0.08:
                tensors[rng.randrange(2)].add_(1.0)
            elif draw < 0.12:
                _CAP = rng.choice([20.0, 7.0])
            kind, cap, which = rng.randrange(6), rng.choice([20.0, 9.0]), rng.randrange(2)
            if rng.random() < 0.5:
                fn = kept.setdefault((kind, cap, which), make(kind, cap, tensors[which]))
            else:
                fn = make(kind, cap, tensors[which])
            calls = len(warm)
            got = fat.attention(q, k, v, score_mod=fn)
            paths.add("python" if len(warm) > calls else "c")
            assert torch.equal(got, _python_answer(q, k, v, score_mod=fn)), step
    finally:
        _CAP = before
    assert paths == {"c", "python"}  # both routes answered


def test_closures_made_anew_at_each_call_follow_what_they_read(warm):
    """Closures made anew at each call share an entry only while what they are made of and what they read
    is the same: a captured tensor changed in place, a new tensor, a global read, another globals dict
    and a number of another value each give the Python path's answer for the call as it is now."""
    import types

    q, k, v = _qkv()
    slopes = torch.rand(2)

    def alibi_over(values):
        return lambda score, b, h, q_idx, kv_idx: score + values[h] * (kv_idx - q_idx) / _CAP

    def python_answer(fn):
        return _python_answer(q, k, v, score_mod=fn)

    call = lambda: fat.attention(q, k, v, score_mod=alibi_over(slopes))  # noqa: E731
    assert _runs(warm, call, 4)[2:] == ["c", "c"]
    first = call()
    slopes.mul_(2)  # in place: the entry's tensor guard
    assert _runs(warm, call, 1) == ["python"]
    assert torch.equal(call(), python_answer(alibi_over(slopes))) and not torch.equal(call(), first)
    other = torch.rand(2)
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=alibi_over(other)), 1) == ["python"]
    global _CAP
    before = _CAP
    try:
        _CAP = 3.0  # a global the code reads
        assert _runs(warm, call, 1) == ["python"]
        assert torch.equal(call(), python_answer(alibi_over(slopes)))
    finally:
        _CAP = before
    made = alibi_over(slopes)
    elsewhere = types.FunctionType(made.__code__, {**made.__globals__, "_CAP": 5.0}, None, None, made.__closure__)
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=elsewhere), 1) == ["python"]
    assert torch.equal(fat.attention(q, k, v, score_mod=elsewhere), python_answer(elsewhere))
    assert not torch.equal(python_answer(elsewhere), call())


def test_a_closure_over_an_object_stays_in_python(warm):
    q, k, v = _qkv()

    class Layer:
        cap = 20.0

    layer = Layer()

    def softcap(score, b, h, q_idx, kv_idx):
        return layer.cap * sm.tanh(score / layer.cap)

    outputs = []
    assert _runs(warm, lambda: outputs.append(fat.attention(q, k, v, score_mod=softcap))) == ["python"] * 3
    layer.cap = 5.0
    fat.attention(q, k, v, score_mod=softcap)
    assert not torch.equal(outputs[0], fat.attention(q, k, v, score_mod=softcap))


def test_clearing_the_caches_behind_drops_the_entries(warm):
    q, k, v = _qkv()
    for _ in range(3):
        fat.attention(q, k, v)
    assert warm_entries.size() == 1
    clear_decisions()
    assert warm_entries.size() == 0
    for _ in range(3):
        fat.attention(q, k, v, score_mod=_global_softcap)
    assert warm_entries.size() == 1
    clear_all()
    assert warm_entries.size() == 0


def test_the_entries_stay_within_their_bound(warm):
    q, k, v = _qkv()
    for index in range(warm_entries.CAPACITY + 40):
        for _ in range(2):
            fat.attention(q, k, v, scale=0.1 + index / 1000)
        assert warm_entries.size() <= warm_entries.CAPACITY
    assert warm_entries.size() >= 1


def test_gradients_through_a_c_answered_call(warm):
    q, k, v = _qkv(requires_grad=True)
    grads = []
    for _ in range(3):
        out = fat.attention(q, k, v, score_mod=_global_softcap)
        grads.append(torch.autograd.grad(out.float().sum(), (q, k, v)))
    assert out.grad_fn.name() == "FusedAttentionBackward"
    assert all(torch.equal(a, b) for g in grads for a, b in zip(g, grads[0]))


def test_explain_and_a_given_dropout_seed_take_the_python_path(warm):
    q, k, v = _qkv()
    for _ in range(3):
        fat.attention(q, k, v)
    assert "cudnn" in fat.explain(q, k, v) or "reference" in fat.explain(q, k, v)
    assert _runs(warm, lambda: fat.attention(q, k, v, dropout_p=0.1, dropout_seed=3), 3) == ["python"] * 3


def test_dropout_draws_its_seed_in_c_as_the_python_path_does(warm, monkeypatch):
    """A seed drawn per call from torch's default generator: the same seeds, in the same order, and the same
    generator state after, whether C or Python answers."""
    q, k, v = _qkv()

    def outputs(in_c: bool) -> tuple:
        if not in_c:
            monkeypatch.setattr(torch_plans, "warm_call", None)
        torch.manual_seed(11)
        got = [fat.attention(q, k, v, dropout_p=0.1) for _ in range(5)]
        return got, torch.randint(0, 2**31 - 1, ())

    before = len(warm)
    c_path, c_after = outputs(True)
    assert len(warm) - before < 5  # answered in C from the third call
    python_path, python_after = outputs(False)
    assert all(torch.equal(a, b) for a, b in zip(c_path, python_path)) and torch.equal(c_after, python_after)
    assert len({float(x.flatten()[0]) for x in c_path}) == 5  # a new seed each call


def test_bias_and_sink_calls_are_answered_in_c_keyed_by_their_shapes(warm):
    q, k, v = _qkv()
    bias = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    sink = torch.randn(2, dtype=torch.bfloat16)
    assert _runs(warm, lambda: fat.attention(q, k, v, bias=bias)) == ["python", "python", "c"]
    assert _runs(warm, lambda: fat.attention(q, k, v, bias=torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)),
                 1) == ["c"]  # another bias of the same shape: an operand, read at each call
    assert _runs(warm, lambda: fat.attention(q, k, v, bias=bias[:, :1]), 2) == ["python", "python"]
    bias.requires_grad_(True)
    assert _runs(warm, lambda: fat.attention(q, k, v, bias=bias), 1) == ["python"]
    assert _runs(warm, lambda: fat.attention(q, k, v, sink=sink, softmax_type="learnable")) == [
        "python", "python", "c"]
    assert _runs(warm, lambda: fat.attention(q, k, v, sink=sink.float(), softmax_type="learnable"), 1) == ["python"]


def test_a_mask_mod_beside_a_bias_is_guarded_by_what_it_reads(warm):
    q, k, v = _qkv()
    bias = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    window = 4

    def local(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

    outputs = []
    call = lambda: outputs.append(fat.attention(q, k, v, bias=bias, mask_mod=local))  # noqa: E731
    paths = _runs(warm, call)
    window = 8  # the rewrite's window changes: never the old answer
    paths += _runs(warm, call, 1)
    assert paths == ["python", "python", "c", "python"]


def test_a_mask_mod_whose_rewrite_is_kept_runs_in_c_while_it_reads_the_same(warm):
    q, k, v = _qkv()
    window = 4

    def local(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)

    def with_softcap():
        return fat.attention(q, k, v, mask_mod=local, score_mod=_global_softcap)

    assert _runs(warm, lambda: fat.attention(q, k, v, mask_mod=local)) == ["python", "python", "c"]
    assert _runs(warm, with_softcap) == ["python", "python", "c"]
    window = 8
    assert _runs(warm, lambda: fat.attention(q, k, v, mask_mod=local))[0] == "python"
    assert _runs(warm, with_softcap)[0] == "python"
    causal = sm.causal()
    assert _runs(warm, lambda: fat.attention(q, k, v, score_mod=causal)) == ["python", "python", "c"]


@pytest.mark.parametrize("mod", ["softcap", "alibi"])
def test_builtins_with_gradients_run_in_c(warm, mod):
    q, k, v = _qkv(requires_grad=True)
    made = sm.softcap(20.0) if mod == "softcap" else sm.alibi(torch.rand(2))

    def step():
        out = fat.attention(q, k, v, score_mod=made)
        torch.autograd.grad(out.float().sum(), (q, k, v))

    assert _runs(warm, step, 4) == ["python", "python", "c", "c"]


_SCALE = 0.5  # read by the graph callbacks below


def _scaled_forward(graph, score, tensors):
    return graph.mul(a=score, b=tensors["scale"])


def _scaled_bprop(graph, dscore, tensors):
    return graph.mul(a=dscore, b=tensors["scale"])


def test_a_score_mod_of_graph_callbacks_runs_in_c_while_it_reads_the_same(warm):
    """The expert path (cuDNN graph callbacks, a hand-written derivative): its callbacks' reads and its
    dicts are guarded; a changed dict entry is bound again."""
    from fusedattn.score_mods import ScoreMod

    q, k, v = _qkv()
    tensors = {"scale": 0.5}
    mod = ScoreMod(_scaled_forward, _scaled_bprop, tensors, masks=False, name="scaled",
                   eager=lambda ops, score, b, h, q_idx, kv_idx, values: score * values["scale"])
    outputs = []
    call = lambda: outputs.append(fat.attention(q, k, v, score_mod=mod))  # noqa: E731
    assert _runs(warm, call) == ["python", "python", "c"]
    tensors["scale"] = 0.25
    assert _runs(warm, call)[0] == "python"
    assert not torch.equal(outputs[0], outputs[-1])  # the new number reached the operator


def test_a_library_without_warm_entries_of_this_version_keeps_the_operator():
    """A prebuilt library of another version: no warm entries, and no error (the operator still runs)."""
    class Older:
        def warm_configure(self, settings, identity_types):  # an earlier signature
            return None

    assert warm_entries.configure(Older()) is False
    assert warm_entries.configure(object()) is False


def test_a_returned_lse_comes_back_from_c_as_an_attention_result(warm):
    q, k, v = _qkv()
    results = []
    assert _runs(warm, lambda: results.append(fat.attention(q, k, v, return_lse=True))) == ["python", "python", "c"]
    assert all(type(r) is type(results[0]) and r.max_logit is None for r in results)
    assert all(torch.equal(r.out, results[0].out) and torch.equal(r.lse, results[0].lse) for r in results)
    assert results[-1].lse.shape == (1, 2, 16)
