"""score_mods on the CPU: built-ins against their eager twins, derivatives against autodiff,
graph callbacks on the reference, bind errors, config keys, and the graph cache with a fake build."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.spec import graph_key, unsupported
from fusedattn.cache import LRUCache
from fusedattn.config import AttentionConfig
from fusedattn.score_mods.core import EAGER_ONLY_KEY, MASKED_BELOW, RuntimeScalar, apply_eager, as_score_mod, bind
from fusedattn.score_mods.eager_graph import run_eager
from fusedattn.score_mods.key import aux_used
from fusedattn.xp import namespace

B, H, SQ, SKV = 2, 3, 6, 8
OPS = namespace("torch")


def scores(seed=0, scale=3.0):
    return torch.randn(B, H, SQ, SKV, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale


def indices():
    shape = lambda axis, n: [n if a == axis else 1 for a in range(4)]  # noqa: E731
    return tuple(torch.arange(n).reshape(shape(axis, n)) for axis, n in enumerate((B, H, SQ, SKV)))


def bound(mod, training=False):
    mod = as_score_mod("test", mod, framework="torch", device="cpu")  # a flex-form built-in: traced
    return bind("test", mod, batch=B, heads_q=H, seqlen_q=SQ, seqlen_kv=SKV, device="cpu", training=training,
                like=scores())


def builtins():
    gen = torch.Generator().manual_seed(1)
    ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]])
    return {
        "softcap": sm.softcap(2.5),
        "clamp": sm.clamp(-1.0, 2.0),
        "causal": sm.causal(),
        "sliding_window": sm.sliding_window(2, 1),
        "sliding_window_left": sm.sliding_window(3, -1),
        "alibi": sm.alibi(torch.rand(H, generator=gen)),
        "alibi_per_batch": sm.alibi(torch.rand(B, H, generator=gen)),
        "relative_position_bias": sm.relative_position_bias(torch.randn(H, 7, generator=gen)),
        "additive_bias": sm.additive_bias(torch.randn(1, H, SQ, SKV, generator=gen)),
        "document_mask": sm.document_mask(ids[:, :SQ], ids),
        "compose": sm.compose(sm.softcap(2.0), sm.sliding_window(2, 0), sm.alibi(torch.rand(H, generator=gen))),
    }


def graph_values(bound_mod):
    return {n: (v.value if isinstance(v, RuntimeScalar) else v.to(torch.float64) if v.is_floating_point() else v)
            for n, v in bound_mod.values.items()}


@pytest.mark.parametrize("name", list(builtins()))
def test_graph_callbacks_match_the_eager_twin(name):
    mod = bound(builtins()[name])
    s = scores()
    twin = apply_eager(OPS, mod, s, *indices(), "float64")
    graph_only = bound(sm.ScoreMod(mod.mod.forward, mod.mod.bprop, mod.mod.tensors, prepare=mod.mod.prepare,
                                   structure=mod.mod.structure))
    via_graph = apply_eager(OPS, graph_only, s, *indices(), "float64")
    # Aux tensors are float32 (cuDNN reads them so): a product of float32 slopes and distances is rounded.
    torch.testing.assert_close(via_graph, twin, rtol=0, atol=1e-6 if name.startswith("alibi") else 1e-12)
    assert not torch.equal(twin, s), "the modification must change something"


@pytest.mark.parametrize("name", ["softcap", "clamp", "compose"])
def test_bprop_matches_autodiff_of_the_forward(name):
    mod = bound(builtins()[name])
    s = scores(2).requires_grad_()
    values = graph_values(mod)
    shared = dict(values)
    out = run_eager(OPS, mod.mod.forward, s, shared, "float64")
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (autodiff,) = torch.autograd.grad(out, s, upstream)
    by_bprop = run_eager(OPS, mod.mod.bprop, upstream, shared, "float64")
    # Masked scores get no probability, so their derivative never matters (masks have none).
    visible = out.detach() > MASKED_BELOW
    torch.testing.assert_close(by_bprop[visible], autodiff[visible], rtol=1e-10, atol=1e-12)


def _native_softcap(cap):
    """examples/native_softcap.py: the expert path's softcap, graph ops and derivative by hand."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from native_softcap import native_softcap

    return native_softcap(cap)


def test_the_hand_written_example_agrees_with_the_flex_form_and_its_own_autodiff():
    mod = bound(_native_softcap(2.5))
    s = scores(2).requires_grad_()
    shared = graph_values(mod)
    out = run_eager(OPS, mod.mod.forward, s, shared, "float64")
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    (autodiff,) = torch.autograd.grad(out, s, upstream)
    torch.testing.assert_close(run_eager(OPS, mod.mod.bprop, upstream, shared, "float64"), autodiff)
    leaves = _qkv(6)
    got = fat.attention(*leaves, score_mod=_native_softcap(2.5))
    want = fat.attention(*leaves, score_mod=sm.softcap(2.5))
    torch.testing.assert_close(got, want)
    for g, w in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(g, w)


def test_a_user_bprop_can_be_checked_the_same_way_and_a_wrong_one_fails():
    def square(graph, score, tensors):
        tensors["x"] = score
        return graph.mul(a=score, b=score)

    def right(graph, dscore, tensors):
        return graph.mul(a=dscore, b=graph.add(a=tensors["x"], b=tensors["x"]))

    def wrong(graph, dscore, tensors):
        return graph.mul(a=dscore, b=tensors["x"])

    s = scores(4).requires_grad_()
    shared = {}
    out = run_eager(OPS, square, s, shared, "float64")
    (autodiff,) = torch.autograd.grad(out.sum(), s)
    ones = torch.ones_like(out)
    torch.testing.assert_close(run_eager(OPS, right, ones, shared, "float64"), autodiff)
    assert not torch.allclose(run_eager(OPS, wrong, ones, shared, "float64"), autodiff)


# ------------------------------------------------------------------ the reference runs graph callbacks

def _qkv(seed=5, requires_grad=True):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, SQ if i == 0 else SKV, H, 4, generator=gen, dtype=torch.float64, requires_grad=requires_grad)
            for i in range(3)]


def _grads(out, leaves):
    return torch.autograd.grad((out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum(),
                               leaves)


def test_user_callbacks_with_a_tensor_and_a_scalar_match_their_eager_form():
    table = torch.randn(1, H, 1, 1, dtype=torch.float64)

    def graph_form(graph, score, tensors):
        distance = graph.abs(input=graph.sub(a=sm.row_index(graph, score), b=sm.col_index(graph, score)))
        return graph.add(a=graph.sub(a=score, b=graph.mul(a=distance, b=tensors["shrink"])), b=tensors["table"])

    def eager_form(s, b, h, qi, ki):
        return s - 0.25 * (qi - ki).abs() + table.reshape(-1)[h]

    leaves = _qkv()
    got = fat.attention(*leaves, mask="causal", score_mod=graph_form,
                        score_mod_tensors={"shrink": 0.25, "table": table})
    want = fat.attention(*leaves, mask="causal", score_mod=sm.eager(eager_form))
    torch.testing.assert_close(got, want)
    for g, w in zip(_grads(got, leaves), _grads(want, leaves)):
        torch.testing.assert_close(g, w)


def test_masked_scores_empty_a_row_like_a_mask_does():
    def hide_first_rows(graph, score, tensors):
        keep = sm.compare(graph, "ge", sm.row_index(graph, score), tensors["rows"])
        return sm.keep_where(graph, score, keep, tensors["masked"])

    leaves = _qkv(6)
    result = fat.attention(*leaves, score_mod=hide_first_rows, score_mod_tensors={"rows": 2, "masked": sm.MASKED},
                           return_lse=True)
    assert (result.out[:, :2] == 0).all() and (result.lse[:, :, :2] == float("-inf")).all()
    assert torch.isfinite(result.out).all()
    assert all(torch.isfinite(g).all() for g in _grads(result.out, leaves))


def test_score_mod_runs_before_a_post_scale_bias_as_on_cudnn():
    leaves = _qkv(7, requires_grad=False)
    bias = torch.randn(1, H, SQ, SKV, dtype=torch.float64)
    got = fat.attention(*leaves, bias=bias, score_mod=sm.softcap(1.0))
    want = fat.attention(*leaves, score_mod=sm.compose(sm.softcap(1.0), sm.additive_bias(bias)))
    torch.testing.assert_close(got, want)


def test_jax_reference_runs_the_same_callbacks():
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    leaves = _qkv(8, requires_grad=False)
    mod = sm.compose(sm.softcap(2.0), sm.sliding_window(3, 0))
    want = fat.attention(*leaves, score_mod=mod).numpy()
    got = fj.attention(*(jax.numpy.asarray(x.numpy()) for x in leaves), score_mod=mod)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ bad input

def _call(**kwargs):
    return fat.attention(*_qkv(9, requires_grad=False), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(score_mod=3), "score_mod: expected a callable score_mod\\(score, b, h, q_idx, kv_idx\\), a cuDNN-native"),
    (dict(score_mod=lambda s, b, h, qi, ki: s, score_mod_tensors={"x": 1.0}),
     "score_mod_tensors: expected None with a flex-style score_mod"),
    (dict(mask_mod=3), "mask_mod: expected a callable mask_mod\\(b, h, q_idx, kv_idx\\)"),
    (dict(mask_mod=lambda b, h: b), "mask_mod: expected a callable mask_mod\\(b, h, q_idx, kv_idx\\)"),
    (dict(score_mod=sm.additive_bias(torch.zeros(1, 1, 1, 1)), mask_mod=lambda b, h, qi, ki: qi >= ki),
     "score_mod: expected a flex-style score_mod\\(score, b, h, q_idx, kv_idx\\) with a mask_mod"),
    (dict(score_mod_tensors={"x": 1.0}), "score_mod_tensors: expected None without a score_mod"),
    (dict(score_mod=sm.softcap(2.0), score_mod_tensors={"x": 1.0}), "expected None with a ScoreMod"),
    (dict(score_mod=lambda g, s, t: s, score_mod_bprop=5), "score_mod_bprop: expected a callable"),
    (dict(score_mod=lambda g, s, t: s, score_mod_tensors=[1]), "score_mod_tensors: expected a dict"),
    (dict(score_mod=lambda g, s, t: g.add(a=s, b=t["x"]), score_mod_tensors={"x": torch.zeros(3, 2)}),
     "broadcastable to \\(B, Hq, Sq, Skv\\)"),
    (dict(score_mod=lambda g, s, t: g.add(a=s, b=t["x"]), score_mod_tensors={"x": np.zeros((2, 2))}),
     "got a NumPy array"),
    (dict(score_mod=lambda g, s, t: g.add(a=s, b=t["x"]), score_mod_tensors={"x": "text"}),
     "expected a tensor or a number"),
    (dict(score_mod=lambda g, s, t: t["missing"]), "failed while its graph was recorded"),
    (dict(score_mod=lambda g, s, t: 1.0), "return a graph tensor"),
])
def test_bad_score_mod_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_an_aux_tensor_that_requires_grad_learns_on_the_reference_and_cudnn_says_why():
    """A cuDNN-native callback's tensor that requires grad: the reference differentiates its forward (the
    gradient equals the same term's as a bias), cuDNN refuses with the reason."""
    leaves = _qkv(10)
    table = torch.rand(1, H, 1, 1, dtype=torch.float64, requires_grad=True)
    mod = dict(score_mod=lambda g, s, t: g.add(a=s, b=t["t"]), score_mod_tensors={"t": table})
    out = fat.attention(*leaves, **mod)
    (table_grad,) = torch.autograd.grad(out.square().sum(), table)
    as_bias = table.detach().clone().requires_grad_(True)
    want = fat.attention(*leaves, bias=as_bias.expand(B, H, SQ, SKV), bias_type="post_scale")
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(table_grad, torch.autograd.grad(want.square().sum(), as_bias)[0])
    with pytest.raises(ValueError, match="get no gradient on cudnn"):
        fat.attention(*leaves, backend="cudnn", **mod)
    with torch.no_grad():  # no gradient wanted: fine
        fat.attention(*leaves, **mod)


@pytest.mark.parametrize("make,match", [
    (lambda: sm.softcap(0), "cap: expected a positive number"),
    (lambda: sm.clamp(2.0, 1.0), "expected low < high"),
    (lambda: sm.sliding_window(-1, -1), "not both"),
    (lambda: sm.alibi(torch.zeros(2, 3, 4)), "slopes: expected a \\(Hq,\\) or \\(B, Hq\\)"),
    (lambda: sm.relative_position_bias(torch.zeros(3, 6)), "\\(Hq, 2M \\+ 1\\)"),
    (lambda: sm.document_mask(torch.zeros(8)), "segment_ids: expected a \\(B, S\\)"),
    (lambda: sm.compose(), "expected ScoreMod arguments"),
])
def test_builtins_check_their_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ------------------------------------------------------------------ keys, reasons and the graph cache

def cfg_with(mod, **changes):
    bound_mod = bound(mod)
    base = dict(dtype="bfloat16", layout="bshd", batch=B, seqlen_q=SQ, seqlen_kv=SKV, heads_q=H, heads_kv=H,
                head_dim_qk=8, head_dim_v=8, device="cuda")
    return AttentionConfig(**{**base, **changes}, score_mod_key=bound_mod.key, score_mod_recipe=bound_mod.recipe)


def scale_by(graph, score, tensors):
    return graph.mul(a=score, b=tensors["f"])


class OneOp:
    def __init__(self, op):
        self.op = op

    def __call__(self, graph, score, tensors):
        return getattr(graph, self.op)(input=score)


def baked(value):
    return lambda graph, score, tensors: graph.mul(a=score, b=graph.tensor_scalar(value, "RUNTIME_PARAM"))


def test_the_graph_cache_builds_once_per_structure():
    cache, built = LRUCache(16), []

    def get(mod):
        cfg = cfg_with(mod)
        return cache.get_or_build(graph_key(cfg, "forward", 0), lambda: built.append(cfg) or len(built))

    assert get(sm.ScoreMod(scale_by, tensors={"f": 2.0})) == 1
    assert get(sm.ScoreMod(scale_by, tensors={"f": 7.5})) == 1  # a new scalar value: no rebuild
    assert get(sm.softcap(1.0)) == get(sm.softcap(30.0)) == 2
    assert get(sm.ScoreMod(lambda g, s, t: g.tanh(input=s))) == 3
    assert get(sm.ScoreMod(lambda g, s, t: g.sin(input=s))) == 4  # another lambda, another graph
    assert get(sm.ScoreMod(baked(0.5))) == 5 and get(sm.ScoreMod(baked(2.0))) == 6  # baked constants differ
    assert get(sm.ScoreMod(baked(0.5))) == 5
    results = []
    for op in ("exp", "cos", "exp"):  # each instance freed before the next: addresses may repeat
        instance = OneOp(op)
        results.append(get(sm.ScoreMod(instance)))
        del instance
        gc.collect()
    assert results[0] == results[2] != results[1]
    per_head = sm.ScoreMod(scale_by, tensors={"f": torch.rand(1, H, 1, 1)})
    full = sm.ScoreMod(scale_by, tensors={"f": torch.rand(1, H, SQ, SKV)})
    assert get(per_head) != get(full)  # aux shapes are part of the key


def test_concurrent_callers_of_one_structure_share_one_build():
    cache, builds, barrier = LRUCache(4), [], threading.Barrier(8)
    cfg = cfg_with(sm.softcap(3.0))

    def build():
        builds.append(1)
        return object()

    def worker(results):
        barrier.wait()
        results.append(cache.get_or_build(graph_key(cfg, "backward", 0), build))

    results: list = []
    threads = [threading.Thread(target=worker, args=(results,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and len({id(r) for r in results}) == 1


@pytest.mark.parametrize("mod,changes,needle", [
    (sm.eager(lambda s, b, h, qi, ki: s), {}, "eager-only score_mod"),
    (sm.softcap(2.0), dict(bias="pre_scale", bias_shape=(1, H, SQ, SKV)), "pre_scale bias"),
    (sm.softcap(2.0), dict(bias="alibi", bias_shape=(H,)), "alibi_slopes"),
    (sm.softcap(2.0), dict(return_max_logit=True), "return_max_logit"),
    (sm.softcap(2.0), dict(mask="padding_causal_bottom_right"), "moves with each sequence"),
])
def test_cudnn_says_why_it_cannot_run_a_score_mod(mod, changes, needle):
    reasons = unsupported(cfg_with(mod, **changes))
    assert reasons and needle in " ".join(reasons), reasons


def test_supported_score_mods_have_no_cheap_reasons():
    assert unsupported(cfg_with(sm.softcap(2.0), mask="causal")) == []
    assert cfg_with(sm.eager(lambda s, b, h, qi, ki: s)).score_mod_key == EAGER_ONLY_KEY


def test_graphs_declare_only_the_aux_entries_their_callbacks_read():
    clamp = bound(sm.clamp(-1.0, 1.0)).mod
    names = [*clamp.tensors, "unused"]
    forward = aux_used(clamp.forward, names)
    assert forward and "unused" not in forward
    assert forward < aux_used(clamp.forward, names, clamp.bprop) <= set(clamp.tensors)


def test_the_per_call_plan_is_not_reused_when_a_callback_changes_what_it_builds(monkeypatch):
    import fusedattn.torch.functional as functional

    seen = []
    real = functional.run_attention
    monkeypatch.setattr(functional, "run_attention", lambda cfg, *rest: seen.append(cfg) or real(cfg, *rest))
    leaves = _qkv(11, requires_grad=False)
    instance = OneOp("tanh")
    first = fat.attention(*leaves, score_mod=instance)
    again = fat.attention(*leaves, score_mod=instance)  # the same object: the remembered plan
    instance.op = "sin"  # same object, another graph
    changed = fat.attention(*leaves, score_mod=instance)
    assert seen[0].score_mod_key == seen[1].score_mod_key != seen[2].score_mod_key
    torch.testing.assert_close(first, again)
    torch.testing.assert_close(changed, fat.attention(*leaves, score_mod=OneOp("sin")))
    assert not torch.allclose(first, changed)


def test_jax_aux_arrays_work_under_jit_and_grad():
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    q, k, v = (jax.numpy.asarray(x.detach().numpy()) for x in _qkv(12, requires_grad=False))
    table = jax.numpy.asarray(np.linspace(-1, 1, H, dtype=np.float64).reshape(1, H, 1, 1))

    def loss(q, table):
        out = fj.attention(q, k, v, score_mod=lambda g, s, t: g.add(a=s, b=t["table"]),
                           score_mod_tensors={"table": table})
        return (out ** 2).sum()

    eager = jax.grad(loss)(q, table)
    jitted = jax.jit(jax.grad(loss))(q, table)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-4, atol=1e-6)
    reference = sm.eager(lambda s, b, h, qi, ki: s + table.reshape(-1)[h])
    want = jax.grad(lambda q: (fj.attention(q, k, v, score_mod=reference) ** 2).sum())(q)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(want), rtol=1e-4, atol=1e-6)


def test_jax_aux_array_under_differentiation_learns_on_the_reference_and_cudnn_says_why():
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    q, k, v = (jax.numpy.asarray(x.detach().numpy()) for x in _qkv(13, requires_grad=False))
    table = jax.numpy.asarray(np.random.default_rng(4).random((1, H, 1, 1)))

    def loss(table, **options):
        return fj.attention(q, k, v, score_mod=lambda g, s, t: g.add(a=s, b=t["t"]),
                            score_mod_tensors={"t": table}, **options).sum()

    def as_bias(table):
        return fj.attention(q, k, v, bias=jax.numpy.broadcast_to(table, (B, H, SQ, SKV))).sum()

    np.testing.assert_allclose(np.asarray(jax.grad(loss)(table)), np.asarray(jax.grad(as_bias)(table)),
                               rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="get no gradient on cudnn"):
        jax.grad(lambda table: loss(table, backend="cudnn"))(table)
    stopped = jax.grad(lambda table: loss(jax.lax.stop_gradient(table)))(table)  # asked for explicitly: zero
    assert float(np.abs(np.asarray(stopped)).sum()) == 0.0


@pytest.mark.parametrize("requires_grad_qkv", [True, False])
def test_a_learnable_relative_position_table_trains_through_bias(requires_grad_qkv):
    gen = torch.Generator().manual_seed(20)
    q, k, v = (torch.randn(B, SQ if i == 0 else SKV, H, 4, generator=gen, dtype=torch.float64,
                           requires_grad=requires_grad_qkv) for i in range(3))
    table = torch.randn(H, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    out = fat.attention(q, k, v, mask="causal", score_mod=sm.relative_position_bias(table))
    weights = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    (table_grad,) = torch.autograd.grad((out * weights).sum(), table)
    # The same attention written out in float64, with the table gathered by hand.
    same_table = table.detach().clone().requires_grad_()
    distance = (torch.arange(SKV)[None, :] - torch.arange(SQ)[:, None]).clamp(-3, 3) + 3
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * 4**-0.5 + same_table[:, distance][None]
    scores = scores.masked_fill(torch.arange(SKV)[None, :] > torch.arange(SQ)[:, None], float("-inf"))
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    (want,) = torch.autograd.grad((expected * weights).sum(), same_table)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(table_grad, want)
    assert table_grad.abs().sum() > 0


def test_a_learnable_table_trains_in_jax_too():
    jax = pytest.importorskip("jax")
    import fusedattn.jax as fj

    q, k, v = (jax.numpy.asarray(x.detach().numpy()) for x in _qkv(21, requires_grad=False))
    table = jax.numpy.asarray(np.linspace(-1, 1, H * 7).reshape(H, 7))
    grad = jax.grad(lambda t: fj.attention(q, k, v, score_mod=sm.relative_position_bias(t)).sum())(table)
    assert float(np.abs(np.asarray(grad)).sum()) > 0


@pytest.mark.parametrize("shape", [(2, 1, 1, 1), (2, 3, 1, 1)])
def test_a_tensor_per_batch_is_declared_over_the_queries(shape):
    """cuDNN 9.19 reads (B, 1, 1, 1) and (B, H, 1, 1) tensors as if each batch had the first one's values; the
    same values declared (B, ., Sq, 1) with a zero query stride, or (B, ., 1, Skv) for one query, are read
    right (tests/gpu/test_fuzz_gpu.py)."""
    values = torch.randn(*shape)
    mod = sm.additive_bias(values)
    bound = bind("test", mod, batch=2, heads_q=3, seqlen_q=5, seqlen_kv=7, device="cpu", training=False)
    aux = bound.values["bias"]
    assert tuple(aux.shape) == (2, values.shape[1], 5, 1) and aux.stride()[2] == 0
    assert torch.equal(aux[:, :, 4, 0], values[:, :, 0, 0])
    one_query = bind("test", mod, batch=2, heads_q=3, seqlen_q=1, seqlen_kv=7, device="cpu", training=False)
    assert tuple(one_query.values["bias"].shape) == (2, values.shape[1], 1, 7)
