"""Flex-style score_mod / mask_mod callbacks on the CPU, in torch and JAX.

The lowered cuDNN callbacks (run eagerly by run_eager) against the user's own functions and
their autodiff; whole calls on the reference backend against a naive float64 attention;
structural keys (hypothesis-generated callbacks); reasons for what has no graph form; the
trace cache; argument errors; the portable math helpers.
"""

from __future__ import annotations

import functools
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flex_corpus import CORPUS, DENSE, jax_array, torch_array
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from needs_torch import HAS_TORCH, requires_torch

import fusedattn.jax as fj
from fusedattn import score_mods as sm
from fusedattn.backends import get_backend
from fusedattn.score_mods import flex
from fusedattn.score_mods.core import MASKED, MASKED_BELOW, RuntimeScalar, as_score_mod, bind
from fusedattn.score_mods.eager_graph import run_eager
from fusedattn.xp import namespace

if HAS_TORCH:
    import torch

    import fusedattn.torch as fat

torch_side = requires_torch("the torch side: torch callbacks, the torch frontend or torch's autograd")
FRAMEWORKS = (pytest.param("torch", marks=torch_side), "jax")
B, H, D = 2, 3, 8
S_TABLES = 9  # corpus tables are sized for the longest sequence below
SHAPES = ((7, 7), (5, 9))  # (Sq, Skv)
F32_EPS = 2.0**-24  # aux tensors are float32 by design (cuDNN reads float32)


# ------------------------------------------------------------------ helpers

@functools.cache
def corpus_entry(framework: str, name: str):
    """(score_mod, mask_mod) of one corpus entry, made once per framework (later calls hit the trace cache)."""
    return CORPUS[name](torch_array if framework == "torch" else jax_array, B, H, S_TABLES)


def index_arrays(framework: str, shape: tuple):
    """b, h, q_idx, kv_idx as integer arrays broadcasting to `shape` = (B, H, Sq, Skv)."""
    arange = torch.arange if framework == "torch" else jnp.arange
    return tuple(arange(n).reshape([n if axis == a else 1 for a in range(4)]) for axis, n in enumerate(shape))


def like_of(framework: str):
    return torch.zeros(1) if framework == "torch" else jnp.zeros(1)


def bind_flex(framework: str, score_mod, mask_mod, sq: int, skv: int):
    """(ScoreMod, BoundScoreMod) of flex callbacks for a (B, H, sq, skv) call."""
    mod = as_score_mod("test", score_mod, mask_mod=mask_mod, framework=framework)
    bound = bind("test", mod, batch=B, heads_q=H, seqlen_q=sq, seqlen_kv=skv,
                 device="cpu" if framework == "torch" else None, training=True, like=like_of(framework))
    return mod, bound


def graph_values(bound) -> dict:
    """The bound tensors dict as the graph callbacks read it: runtime scalars by value."""
    return {n: v.value if isinstance(v, RuntimeScalar) else v for n, v in bound.values.items()}


def user_scores(framework: str, score_mod, mask_mod, score, index):
    """The user's functions run eagerly on the whole score matrix, masked keys at -inf."""
    where = torch.where if framework == "torch" else jnp.where
    value = score if score_mod is None else score_mod(score, *index)
    if mask_mod is not None:
        value = where(mask_mod(*index), value, -math.inf)
    return value


def per_element(framework: str, fn):
    """fn applied to one score at a time (FlexAttention's meaning), for callbacks that are not elementwise."""
    vmap = torch.vmap if framework == "torch" else jax.vmap

    def run(*args):
        shape = np.broadcast_shapes(*(tuple(x.shape) for x in args))
        args = [x.expand(shape) if framework == "torch" else jnp.broadcast_to(x, shape) for x in args]
        mapped = fn
        for _ in shape:
            mapped = vmap(mapped)
        return mapped(*args)

    return run


def normal(framework: str, seed: int, shape: tuple, scale: float = 1.0):
    """Float64 standard normal values (times scale) in the framework's arrays."""
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return torch.tensor(values) if framework == "torch" else jnp.asarray(values)


def as_numpy(x) -> np.ndarray:
    return x.detach().numpy() if hasattr(x, "detach") else np.asarray(x)  # torch tensors have .detach


def masked_as_graph(x: np.ndarray) -> np.ndarray:
    """Scores at or below MASKED_BELOW written as the graph writes them (MASKED)."""
    return np.where(x <= MASKED_BELOW, MASKED, x)


# ------------------------------------------------------------------ 1. lowering against the user's functions

@pytest.mark.parametrize("sq,skv", SHAPES)
@pytest.mark.parametrize("name", list(CORPUS))
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_lowered_forward_and_derivative_match_the_user_functions(framework, name, sq, skv, x64):
    got, score = lowered_matches_user(framework, *corpus_entry(framework, name), sq, skv)
    assert not np.allclose(got, as_numpy(score)), "the callback must change the scores"


def lowered_matches_user(framework: str, score_mod, mask_mod, sq: int, skv: int, slack: float = 1.0) -> tuple:
    """The lowered forward and derivative (cuDNN's graph ops run eagerly, in float64, the derivative
    reading the forward's values as on cuDNN) against the user's functions and their autodiff, within
    float32 roundings (numbers and aux tensors are float32 by design) times `slack`.
    Returns (the lowered scores, the scores given)."""
    mod, bound = bind_flex(framework, score_mod, mask_mod, sq, skv)
    assert mod.forward is not None, mod.issue
    shape = (B, H, sq, skv)
    index = index_arrays(framework, shape)
    score = normal(framework, 10, shape, scale=4.0)
    dout = normal(framework, 11, shape)
    if framework == "torch":
        leaf = score.clone().requires_grad_()
        want = user_scores(framework, score_mod, mask_mod, leaf, index)
        (want_grad,) = torch.autograd.grad(want, leaf, dout)
    else:
        want, pullback = jax.vjp(lambda s: user_scores(framework, score_mod, mask_mod, s, index), score)
        (want_grad,) = pullback(dout)
    ops = namespace(framework)
    tensors = graph_values(bound)  # shared by forward and bprop, as on cuDNN
    got = run_eager(ops, mod.forward, score, tensors, "float64")
    got_grad = dout if mod.bprop is None else run_eager(ops, mod.bprop, dout, tensors, "float64")

    got, want = np.broadcast_to(as_numpy(got), shape), masked_as_graph(as_numpy(want))
    np.testing.assert_array_equal(got <= MASKED_BELOW, want <= MASKED_BELOW)
    np.testing.assert_allclose(got, want, rtol=4 * F32_EPS * slack, atol=4 * F32_EPS * slack)
    np.testing.assert_allclose(np.broadcast_to(as_numpy(got_grad), shape), as_numpy(want_grad),
                               rtol=4 * F32_EPS * slack, atol=F32_EPS * slack)
    return got, score


@torch_side
@pytest.mark.parametrize("name", sorted(DENSE))
def test_gathers_over_both_positions_become_dense_aux_tensors(name):
    _, bound = bind_flex("torch", *corpus_entry("torch", name), 5, 9)
    shapes = [tuple(v.shape) for v in bound.values.values() if not isinstance(v, RuntimeScalar)]
    assert (1, H, 5, 9) in shapes, shapes


@torch_side
@pytest.mark.parametrize("name", sorted(DENSE))
def test_explain_names_a_dense_gather_and_its_memory(name):
    q = torch.randn(2, 9, H, 8)
    score_mod, mask_mod = corpus_entry("torch", name)
    text = fat.explain(q, q, q, score_mod=score_mod, **({"mask_mod": mask_mod} if mask_mod else {}))
    expected = 2 * H * 9 * 9 * 4 / 2**20  # float32 bytes of one (., Hq, Sq, Skv) tensor, B=2 or broadcast 1
    line = next(line for line in text.splitlines() if "over every (q_idx, kv_idx) pair" in line)
    assert f"{expected:.3g} MiB" in line or f"{expected / 2:.3g} MiB" in line, line


# ------------------------------------------------------------------ 2. whole calls on the reference

def naive_torch(q, k, v, score_mod, mask_mod):
    """Float64 attention in bshd: softmax(score_mod(q k^T * scale)) with -inf where mask_mod is False."""
    score = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    score = user_scores("torch", score_mod, mask_mod, score, index_arrays("torch", tuple(score.shape)))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(score, dim=-1), v)


def naive_jax(q, k, v, score_mod, mask_mod):
    """naive_torch in jax.numpy."""
    score = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    score = user_scores("jax", score_mod, mask_mod, score, index_arrays("jax", tuple(score.shape)))
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(score, axis=-1), v)


def qkv(framework: str, sq: int, skv: int, seed: int = 0):
    """q, k, v in bshd (B, S, H, D), float64."""
    return [normal(framework, seed + i, (B, n, H, D)) for i, n in enumerate((sq, skv, skv))]


def torch_out_and_grads(attend, leaves, cotangent):
    out = attend(*leaves)
    return (out, *torch.autograd.grad((out * cotangent).sum(), leaves))


def jax_out_and_grads(attend, arrays, cotangent):
    out, pullback = jax.vjp(attend, *arrays)
    return (out, *pullback(cotangent))


def assert_all_close(got, want):
    for label, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(as_numpy(g), as_numpy(w), rtol=1e-10, atol=1e-12, err_msg=label)


@torch_side
@pytest.mark.parametrize("sq,skv", SHAPES)
@pytest.mark.parametrize("name", list(CORPUS))
def test_torch_reference_matches_naive(name, sq, skv, ran):
    score_mod, mask_mod = corpus_entry("torch", name)
    leaves = [x.requires_grad_() for x in qkv("torch", sq, skv)]
    cotangent = normal("torch", 7, (B, sq, H, D))
    got = torch_out_and_grads(lambda q, k, v: fat.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                            backend="reference"), leaves, cotangent)
    want = torch_out_and_grads(lambda q, k, v: naive_torch(q, k, v, score_mod, mask_mod), leaves, cotangent)
    assert got[0].shape == (B, sq, H, D)  # bshd in, bshd out
    assert_all_close(got, want)
    assert [(n, phase) for n, phase, _ in ran] == [("reference", "forward"), ("reference", "backward")]


EDGE_SHAPES = [(1, 1), (1, 9), (9, 1), (0, 5)]  # one query, one key, a single row each way, no queries
EDGE_ENTRIES = ("softcap", "alibi", "causal", "relative_table", "query_bias", "head_scale", "block_position")


@torch_side
@pytest.mark.parametrize("sq,skv", EDGE_SHAPES)
@pytest.mark.parametrize("name", EDGE_ENTRIES)
def test_one_token_and_empty_sequences(name, sq, skv, ran):
    """The lowering and the reference at the smallest shapes: one token, and no queries at all."""
    score_mod, mask_mod = corpus_entry("torch", name)
    mod, bound = bind_flex("torch", score_mod, mask_mod, sq, skv)
    score = normal("torch", 3, (B, H, sq, skv), scale=4.0)
    want = user_scores("torch", score_mod, mask_mod, score, index_arrays("torch", (B, H, sq, skv)))
    got = run_eager(namespace("torch"), mod.forward, score, graph_values(bound), "float64")
    np.testing.assert_allclose(as_numpy(got), masked_as_graph(as_numpy(want)), rtol=0, atol=1e-6)
    leaves = [x.requires_grad_() for x in qkv("torch", sq, skv)]
    cotangent = normal("torch", 7, (B, sq, H, D))
    got = torch_out_and_grads(lambda q, k, v: fat.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                            backend="reference"), leaves, cotangent)
    want = torch_out_and_grads(lambda q, k, v: naive_torch(q, k, v, score_mod, mask_mod), leaves, cotangent)
    assert got[0].shape == (B, sq, H, D)
    assert_all_close(got, want)


JAX_END_TO_END = ("softcap", "causal", "relative_table", "document_causal", "head_scale", "alibi_causal",
                  "window_document_softcap")


@pytest.mark.parametrize("name", JAX_END_TO_END)
def test_jax_reference_matches_naive(name, x64, ran):
    sq, skv = SHAPES[1]
    score_mod, mask_mod = corpus_entry("jax", name)
    arrays = qkv("jax", sq, skv, seed=20)
    cotangent = normal("jax", 27, (B, sq, H, D))
    got = jax_out_and_grads(lambda q, k, v: fj.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                         backend="reference"), arrays, cotangent)
    want = jax_out_and_grads(lambda q, k, v: naive_jax(q, k, v, score_mod, mask_mod), arrays, cotangent)
    assert got[0].shape == (B, sq, H, D) and got[0].dtype == jnp.float64
    assert_all_close(got, want)
    assert {n for n, _, _ in ran} == {"reference"}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_jax_numbers_in_a_float64_callback_keep_float64_precision(jit, x64, ran):
    """Numbers a callback writes (s * 0.37, s + 0.1) are float64 in a float64 call, under jit too, beside a
    mask_mod that stays a select: they were traced on float32 stand-ins, which rounded them (1e-8 errors)."""
    def score_mod(s, b, h, q_idx, kv_idx):
        return s * 0.37 + 0.1

    def mask_mod(b, h, q_idx, kv_idx):  # depends on the head: a select in the graph, not a native mask
        return (h % 2 == 0) | (q_idx >= kv_idx)

    arrays = qkv("jax", *SHAPES[1], seed=21)
    cotangent = normal("jax", 28, (B, SHAPES[1][0], H, D))

    def attend(q, k, v):
        return fj.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="reference")

    got = jax_out_and_grads(jax.jit(attend) if jit else attend, arrays, cotangent)
    want = jax_out_and_grads(lambda q, k, v: naive_jax(q, k, v, score_mod, mask_mod), arrays, cotangent)
    assert_all_close(got, want)
    assert {n for n, _, _ in ran} == {"reference"}


@torch_side
@pytest.mark.parametrize("name", ["query_bias", "alibi_causal", "document_causal"])
def test_indices_follow_the_layout(name):
    """b, h, q_idx and kv_idx name the same positions whatever the layout of q, k, v."""
    score_mod, mask_mod = corpus_entry("torch", name)
    q, k, v = qkv("torch", 5, 9, seed=30)
    bshd = fat.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    bhsd = fat.attention(*(x.transpose(1, 2) for x in (q, k, v)), layout="bhsd", score_mod=score_mod,
                         mask_mod=mask_mod)
    torch.testing.assert_close(bhsd.transpose(1, 2), bshd, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bshd, naive_torch(q, k, v, score_mod, mask_mod), rtol=1e-10, atol=1e-12)


@torch_side
def test_explain_runs_with_flex_callbacks(ran):
    score_mod, mask_mod = corpus_entry("torch", "window_document_softcap")
    q, k, v = qkv("torch", 5, 9)
    text = fat.explain(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert text.startswith("config: layout=bshd dtype=float64 B=2 Sq=5 Skv=9 Hq=3 Hkv=3 D=8")
    assert " score_mod " in text.splitlines()[0] and "selected: reference" in text
    assert ran == []


# ------------------------------------------------------------------ 3. structural keys

# Steps of a generated score_mod: name -> (number of constants, step(x, constants, b, h, q_idx, kv_idx)).
# Python operators and the portable helpers only, so one callback runs in torch and JAX.
STEPS = {
    "add_position": (1, lambda x, c, b, h, q, kv: x + c[0] * (q - kv)),
    "add_head": (1, lambda x, c, b, h, q, kv: x + c[0] * h),
    "scale": (1, lambda x, c, b, h, q, kv: x * c[0]),
    "shift": (1, lambda x, c, b, h, q, kv: x - c[0]),
    "cap_above": (1, lambda x, c, b, h, q, kv: sm.minimum(x, c[0])),
    "cap_below": (1, lambda x, c, b, h, q, kv: sm.maximum(x, c[0])),
    "softcap": (2, lambda x, c, b, h, q, kv: c[0] * sm.tanh(x / c[1])),
    "leaky": (2, lambda x, c, b, h, q, kv: sm.where(x > c[0], x, c[1] * x)),
    "divide": (1, lambda x, c, b, h, q, kv: x / c[0]),
    "temper": (1, lambda x, c, b, h, q, kv: x / (c[0] + h)),
    "gate": (1, lambda x, c, b, h, q, kv: x * sm.sigmoid(x / c[0])),
}
SAME_ARITY = {name: [other for other, (n, _) in STEPS.items() if n == count and other != name]
              for name, (count, _) in STEPS.items()}

# A tree: ("score",), ("step", name, child) or ("sum", left, right); the root is always a step.
trees = st.recursive(
    st.just(("score",)),
    lambda child: st.one_of(st.tuples(st.just("step"), st.sampled_from(sorted(STEPS)), child),
                            st.tuples(st.just("sum"), child, child)),
    max_leaves=4,
).flatmap(lambda tree: st.tuples(st.just("step"), st.sampled_from(sorted(STEPS)), st.just(tree)))


def steps_of(tree) -> list:
    """The step names of a tree, in evaluation order (the order constants are consumed)."""
    if tree[0] == "score":
        return []
    if tree[0] == "sum":
        return steps_of(tree[1]) + steps_of(tree[2])
    return steps_of(tree[2]) + [tree[1]]


def constant_count(tree) -> int:
    return sum(STEPS[name][0] for name in steps_of(tree))


def with_step(tree, position: int, name: str):
    """The tree with its step number `position` (evaluation order) replaced by `name`."""
    counter = iter(range(10**6))

    def walk(node):
        if node[0] == "score":
            return node
        if node[0] == "sum":
            return ("sum", walk(node[1]), walk(node[2]))
        child = walk(node[2])
        return ("step", name if next(counter) == position else node[1], child)

    return walk(tree)


def render(tree, constants: list):
    """A flex score_mod computing the tree, reading `constants` in evaluation order."""

    def score_mod(score, b, h, q_idx, kv_idx):
        remaining = iter(constants)

        def walk(node):
            if node[0] == "score":
                return score
            if node[0] == "sum":
                left = walk(node[1])
                return left + walk(node[2])
            x = walk(node[2])
            count, step = STEPS[node[1]]
            return step(x, [next(remaining) for _ in range(count)], b, h, q_idx, kv_idx)

        return walk(tree)

    return score_mod


def keys(framework: str, score_mod) -> tuple:
    """(forward Expr key, bound config key) of a flex score_mod."""
    _, bound = bind_flex(framework, score_mod, None, 4, 6)
    return flex.trace(framework, score_mod, None).forward.key, bound.key


constants = st.floats(min_value=0.25, max_value=8.0, allow_nan=False, allow_infinity=False)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), tree=trees)
def test_keys_depend_on_structure_not_on_constants(framework, data, tree):
    count = constant_count(tree)
    first = data.draw(st.lists(constants, min_size=count, max_size=count), label="first")
    second = data.draw(st.lists(constants, min_size=count, max_size=count).filter(lambda c: c != first),
                       label="second")
    key = keys(framework, render(tree, first))
    assert keys(framework, render(tree, second)) == key

    position = data.draw(st.integers(0, len(steps_of(tree)) - 1), label="position")
    other = data.draw(st.sampled_from(SAME_ARITY[steps_of(tree)[position]]), label="other step")
    mutated_forward, mutated_bound = keys(framework, render(with_step(tree, position, other), first))
    assert mutated_forward != key[0] and mutated_bound != key[1]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # x64: a setting only
@given(data=st.data(), tree=trees)
def test_generated_callbacks_lower_to_their_values_and_derivatives(framework, data, tree, x64):
    """Generated compositions (products, quotients by numbers and by head-dependent values, tanh chains,
    sums of branches) through the joint trace, the simplification and the lowering."""
    constants = data.draw(st.lists(st.floats(min_value=0.25, max_value=8.0), min_size=constant_count(tree),
                                   max_size=constant_count(tree)), label="constants")
    # slack: terms up to about 100 (scores of 4 sigma, numbers up to 8, positions up to 6) may cancel
    lowered_matches_user(framework, render(tree, constants), None, 5, 7, slack=128.0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_abs_of_the_score_has_its_derivative(framework, x64):
    """torch differentiates abs through sgn, JAX through a select: both trace."""
    lowered_matches_user(framework, lambda s, b, h, q_idx, kv_idx: s - 0.2 * abs(s), None, 5, 7)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("function, values", [
    (lambda s, b, h, q_idx, kv_idx: (q_idx - kv_idx) * 0.1, lambda q_idx, kv_idx: (q_idx - kv_idx) * 0.1),
    (lambda s, b, h, q_idx, kv_idx: s * 0.0 + 2.5, lambda q_idx, kv_idx: 2.5)])
def test_a_score_mod_free_of_the_score_keeps_the_scores_shape(framework, function, values, x64):
    """Its forward and its derivative (0) are whole (B, H, Sq, Skv) tensors, not a number or an index row
    (also with JAX's float64, where its result is float64 and the score's stand-in float32)."""
    mod, bound = bind_flex(framework, function, None, 5, 7)
    assert mod.forward is not None, mod.issue
    shape = (B, H, 5, 7)
    tensors = graph_values(bound)
    got = run_eager(namespace(framework), mod.forward, normal(framework, 1, shape), tensors, "float64")
    want = values(*index_arrays(framework, shape)[2:])
    np.testing.assert_allclose(as_numpy(got), np.broadcast_to(as_numpy(want), shape), rtol=1e-6)
    assert mod.bprop is not None
    derivative = run_eager(namespace(framework), mod.bprop, normal(framework, 2, shape), tensors, "float64")
    assert np.shape(as_numpy(derivative)) == shape and not np.any(as_numpy(derivative))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_softcap_caps_share_a_key_and_differ_in_values(framework):
    (wide, _), (tight, _) = corpus_entry(framework, "softcap"), corpus_entry(framework, "softcap_tight")
    assert flex.trace(framework, wide, None).forward.key == flex.trace(framework, tight, None).forward.key
    # score / cap runs as score * (1 / cap): the reciprocal is a runtime scalar too
    assert flex.trace(framework, wide, None).forward.scalars == (1 / 20.0, 20.0)
    assert flex.trace(framework, tight, None).forward.scalars == (1 / 2.0, 2.0)
    (_, bound_wide), (_, bound_tight) = bind_flex(framework, wide, None, 4, 6), bind_flex(framework, tight, None, 4, 6)
    assert bound_wide.key == bound_tight.key
    scalars = lambda bound: sorted(v.value for v in bound.values.values() if isinstance(v, RuntimeScalar))  # noqa: E731
    assert 20.0 in scalars(bound_wide) and 20.0 not in scalars(bound_tight) and 2.0 in scalars(bound_tight)


@torch_side
@pytest.mark.parametrize("name", list(CORPUS))
def test_every_corpus_entry_traces_in_torch_and_jax(name):
    for framework in ("torch", "jax"):
        traced = flex.trace(framework, *corpus_entry(framework, name))
        assert traced.forward.key and traced.forward_plan is not None


# ------------------------------------------------------------------ 4. what cannot be expressed

SQUARE_VALUES = np.random.default_rng(4).standard_normal((7, 7))
JAX_SQUARE = jnp.asarray(SQUARE_VALUES)
if HAS_TORCH:
    TABLE = torch.randn(H, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    SQUARE = torch.tensor(SQUARE_VALUES)

# name -> (score_mod, what the issue names, whether it means anything applied to one score at a time)
TORCH_UNTRACEABLE = {
    "round": (lambda s, b, h, q, kv: torch.round(s), "'round'", True),
    "reduction": (lambda s, b, h, q, kv: s - s.sum(), "'sum'", True),
    "sort": (lambda s, b, h, q, kv: torch.sort(s, dim=-1)[0], "'sort'", True),
    "control_flow": (lambda s, b, h, q, kv: s if s > 0 else -s, "Python control flow", False),
    "float_index": (lambda s, b, h, q, kv: s + TABLE[h, q * 0.5], "indices", False),
    "score_index": (lambda s, b, h, q, kv: s + TABLE[h, s.long().clamp(0, 6)], "indexed by an expression of the score",
                    True),
    "whole_tensor": (lambda s, b, h, q, kv: s + SQUARE, "used whole", False),
}
JAX_UNTRACEABLE = {
    "round": (lambda s, b, h, q, kv: jnp.round(s), "'round'"),
    "reduction": (lambda s, b, h, q, kv: s - s.sum(), "'reduce_sum'"),
    "control_flow": (lambda s, b, h, q, kv: s if s > 0 else -s, "JAX could not trace"),
    "score_index": (lambda s, b, h, q, kv: s + JAX_SQUARE[q, jnp.clip(s.astype(jnp.int32), 0, 6)],
                    "indexed by an expression of the score"),
    "whole_tensor": (lambda s, b, h, q, kv: s + JAX_SQUARE, "used whole"),
}


@torch_side
@pytest.mark.parametrize("name", list(TORCH_UNTRACEABLE))
def test_torch_callback_without_a_graph_form_says_why(name):
    score_mod, needle, _ = TORCH_UNTRACEABLE[name]
    mod = as_score_mod("test", score_mod, framework="torch")
    assert mod.forward is None and mod.bprop is None
    assert needle in mod.issue, mod.issue


@torch_side
@pytest.mark.parametrize("name", [n for n, (_, _, eager) in TORCH_UNTRACEABLE.items() if eager])
def test_torch_reference_runs_what_cuDNN_cannot(name, ran):
    score_mod = TORCH_UNTRACEABLE[name][0]
    leaves = [x.requires_grad_() for x in qkv("torch", 7, 7, seed=40)]
    cotangent = normal("torch", 47, (B, 7, H, D))
    got = torch_out_and_grads(lambda q, k, v: fat.attention(q, k, v, score_mod=score_mod), leaves, cotangent)
    want = torch_out_and_grads(lambda q, k, v: naive_torch(q, k, v, per_element("torch", score_mod), None), leaves,
                               cotangent)
    assert_all_close(got, want)
    assert {n for n, _, _ in ran} == {"reference"}


@torch_side
def test_a_callback_giving_more_than_one_value_per_score_is_refused():
    """s + SQUARE adds a (7, 7) matrix to each score: no meaning one score at a time (FlexAttention fails on it)."""
    q, k, v = qkv("torch", 7, 7)
    with pytest.raises(ValueError, match=r"score_mod: expected one value per score .* shape \(7, 7\)"):
        fat.attention(q, k, v, score_mod=TORCH_UNTRACEABLE["whole_tensor"][0])
    qj, kj, vj = qkv("jax", 7, 7)
    with pytest.raises(ValueError, match=r"score_mod: expected one value per score .* shape \(7, 7\)"):
        fj.attention(qj, kj, vj, score_mod=JAX_UNTRACEABLE["whole_tensor"][0])


@pytest.fixture
def cudnn_cheap_rules_pass(monkeypatch, fresh_selection):
    """The cudnn backend's package, device and dtype rules pass on this CPU, so its own reasons show."""
    cudnn = type(get_backend("cudnn"))
    monkeypatch.setattr(cudnn, "packages", ())
    monkeypatch.setattr(cudnn, "devices", ("cpu", "cuda"))
    monkeypatch.setattr(cudnn, "dtypes", (*cudnn.dtypes, "float64"))


def backend_block(text: str, name: str) -> str:
    """The lines of explain's table for one backend."""
    lines = text.splitlines()
    start = lines.index(next(line for line in lines if line.startswith(f"  {name}:")))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("    ")), len(lines))
    return "\n".join(lines[start:end])


@torch_side
@pytest.mark.parametrize("name", ["round", "sort", "whole_tensor"])
def test_explain_gives_the_untraceable_op_as_a_cudnn_reason(name, cudnn_cheap_rules_pass):
    score_mod, needle, _ = TORCH_UNTRACEABLE[name]
    q, k, v = qkv("torch", 7, 7)
    text = fat.explain(q, k, v, score_mod=score_mod)
    cudnn = backend_block(text, "cudnn")
    assert cudnn.startswith("  cudnn: rejected") and needle in cudnn, text
    assert "selected: reference" in text


@pytest.mark.parametrize("name", list(JAX_UNTRACEABLE))
def test_jax_callback_without_a_graph_form_says_why_and_runs_on_the_reference(name, x64):
    score_mod, needle = JAX_UNTRACEABLE[name]
    mod = as_score_mod("test", score_mod, framework="jax")
    assert mod.forward is None and needle in mod.issue, mod.issue
    if name in ("control_flow", "whole_tensor"):
        return  # Python control flow on a traced score fails eagerly too; a whole matrix per score is refused
    arrays = qkv("jax", 7, 7, seed=50)
    cotangent = normal("jax", 57, (B, 7, H, D))
    got = jax_out_and_grads(lambda q, k, v: fj.attention(q, k, v, score_mod=score_mod), arrays, cotangent)
    want = jax_out_and_grads(lambda q, k, v: naive_jax(q, k, v, per_element("jax", score_mod), None), arrays,
                             cotangent)
    assert_all_close(got, want)


@torch_side
def test_torch_control_flow_issue_gives_the_fix():
    mod = as_score_mod("test", TORCH_UNTRACEABLE["control_flow"][0], framework="torch")
    assert "write conditions with torch.where" in mod.issue, mod.issue


def test_jax_control_flow_issue_gives_the_fix():
    mod = as_score_mod("test", JAX_UNTRACEABLE["control_flow"][0], framework="jax")
    assert "write conditions with jnp.where" in mod.issue, mod.issue


# ------------------------------------------------------------------ 5. the trace cache

GLOBAL_CAP = 3.0


def global_softcap(score, b, h, q_idx, kv_idx):
    return GLOBAL_CAP * sm.tanh(score / GLOBAL_CAP)


def closure_softcap(cap: float):
    return lambda score, b, h, q_idx, kv_idx: cap * sm.tanh(score / cap)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_one_function_is_traced_once(framework):
    score_mod, mask_mod = corpus_entry(framework, "window_document_softcap")
    assert flex.trace(framework, score_mod, mask_mod) is flex.trace(framework, score_mod, mask_mod)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_new_closure_traces_again_with_the_same_key(framework):
    first, second = flex.trace(framework, closure_softcap(4.0), None), flex.trace(framework, closure_softcap(9.0), None)
    assert first is not second
    assert first.forward.key == second.forward.key
    assert first.forward.scalars == (1 / 4.0, 4.0) and second.forward.scalars == (1 / 9.0, 9.0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_changed_global_traces_again(framework, monkeypatch):
    before = flex.trace(framework, global_softcap, None)
    monkeypatch.setattr(sys.modules[__name__], "GLOBAL_CAP", 6.5)
    after = flex.trace(framework, global_softcap, None)
    assert after is not before and after.forward.key == before.forward.key
    assert before.forward.scalars == (1 / 3.0, 3.0) and after.forward.scalars == (1 / 6.5, 6.5)


# Library bug: globals read by a helper the score_mod calls are not part of the cache snapshot.
HELPER_SCALE = 2.0


def scaled(score):
    return score * HELPER_SCALE


def via_helper(score, b, h, q_idx, kv_idx):
    return scaled(score)


def lowered_minus_user(score_mod) -> float:
    """Largest difference between the lowered forward (what cuDNN runs) and the user's function now: a
    rounding (score / cap runs as score * (1 / cap)), or a stale trace's whole error."""
    mod, bound = bind_flex("torch", score_mod, None, 4, 6)
    score = normal("torch", 60, (B, H, 4, 6))
    got = run_eager(namespace("torch"), mod.forward, score, graph_values(bound), "float64")
    want = user_scores("torch", score_mod, None, score, index_arrays("torch", (B, H, 4, 6)))
    return float((got - want).abs().max())


@torch_side
def test_a_global_read_by_a_helper_traces_again(monkeypatch):
    assert lowered_minus_user(via_helper) < 1e-12
    monkeypatch.setattr(sys.modules[__name__], "HELPER_SCALE", 5.0)
    assert lowered_minus_user(via_helper) < 1e-12


@torch_side
def test_a_number_changed_inside_a_captured_dict_traces_again():
    params = {"cap": 20.0}

    def capped(score, b, h, q_idx, kv_idx):
        return params["cap"] * sm.tanh(score / params["cap"])

    assert lowered_minus_user(capped) < 1e-12
    params["cap"] = 1.0
    assert lowered_minus_user(capped) < 1e-12


@torch_side
def test_a_bound_method_is_traced_once():
    class Softcapped(torch.nn.Module):
        cap = 5.0

        def score_mod(self, score, b, h, q_idx, kv_idx):
            return self.cap * sm.tanh(score / self.cap)

    module = Softcapped()
    assert flex.trace("torch", module.score_mod, None) is flex.trace("torch", module.score_mod, None)


def _capped(cap):
    """A closure of one code over a number, as a model's forward or a factory per layer writes it."""
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)
    return softcap


@torch_side
def test_closures_of_one_code_share_a_trace_only_when_they_read_the_same_objects(monkeypatch):
    """A closure made anew at each call over the same objects is traced once (before, each call traced:
    14.8 ms a call); closures of the same code over other objects (one per layer) each keep their own
    trace, so alternating between them never traces again; every call gives its own cap's result."""
    traced = []
    original = flex._trace_now
    monkeypatch.setattr(flex, "_trace_now", lambda *a: traced.append(1) or original(*a))
    cap = 3.0
    first = flex.trace("torch", _capped(cap), None)
    assert flex.trace("torch", _capped(cap), None) is first and len(traced) == 1
    layers = [_capped(c) for c in (0.5, 2.0, 9.0)]
    for _ in range(3):
        for layer in layers:
            flex.trace("torch", layer, None)
    assert len(traced) == 1 + len(layers)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 12, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    for layer, c in [*zip(layers, (0.5, 2.0, 9.0)), (_capped(2.0), 2.0)]:
        got = fat.attention(q, k, v, mask="causal", score_mod=layer)
        want = fat.attention(q, k, v, mask="causal", score_mod=sm.eager(
            lambda s, b, h, qi, ki, c=c: c * torch.tanh(s / c)))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------ 6. errors

@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_mask_mod_that_is_not_callable_raises(framework):
    attention, array = (fat.attention, torch.zeros) if framework == "torch" else (fj.attention, jnp.zeros)
    q = array((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"mask_mod: expected a callable mask_mod\(b, h, q_idx, kv_idx\), got 3"):
        attention(q, q, q, mask_mod=3)


@torch_side
@pytest.mark.parametrize("kwargs,match", [
    (dict(score_mod=lambda score, b: score), r"score_mod: .*takes 2 positional arguments"),
    (dict(score_mod=lambda score, b, h, q_idx: score), r"score_mod: .*missing 1 required positional argument"),
    (dict(mask_mod=lambda score, b, h, q_idx, kv_idx: q_idx >= kv_idx),
     r"mask_mod: expected a callable mask_mod\(b, h, q_idx, kv_idx\)"),
    (dict(score_mod=lambda score, b, h, q_idx, kv_idx: score, score_mod_tensors={"x": 1.0}),
     "score_mod_tensors: expected None with a flex-style score_mod"),
])
def test_callbacks_of_the_wrong_arity_raise(kwargs, match):
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match=match):
        fat.attention(q, q, q, **kwargs)


# ------------------------------------------------------------------ 7. portable helpers

SIGNED = [-2.5, -0.5, 0.25, 1.75]
POSITIVE = [0.25, 0.5, 1.75, 3.0]
PORTABLE = {  # name -> (helper applied to one number or array, the values it is tried on, math reference)
    "tanh": (sm.tanh, SIGNED, math.tanh),
    "exp": (sm.exp, SIGNED, math.exp),
    "log": (sm.log, POSITIVE, math.log),
    "sqrt": (sm.sqrt, POSITIVE, math.sqrt),
    "abs": (sm.abs, SIGNED, lambda x: -x if x < 0 else x),
    "sigmoid": (sm.sigmoid, SIGNED, lambda x: 1.0 / (1.0 + math.exp(-x))),
    "floor": (sm.floor, SIGNED, math.floor),
    "ceil": (sm.ceil, SIGNED, math.ceil),
    "minimum": (lambda x: sm.minimum(x, 0.5), SIGNED, lambda x: min(x, 0.5)),
    "minimum_number_first": (lambda x: sm.minimum(0.5, x), SIGNED, lambda x: min(x, 0.5)),
    "maximum": (lambda x: sm.maximum(x, -1.0), SIGNED, lambda x: max(x, -1.0)),
    "maximum_number_first": (lambda x: sm.maximum(-1.0, x), SIGNED, lambda x: max(x, -1.0)),
    "clip": (lambda x: sm.clip(x, -1.0, 1.0), SIGNED, lambda x: min(max(x, -1.0), 1.0)),
    "where": (lambda x: sm.where(x > 0, x, 0.1 * x), SIGNED, lambda x: x if x > 0 else 0.1 * x),
}


@torch_side
@pytest.mark.parametrize("name", list(PORTABLE))
def test_portable_helpers_agree_on_numbers_torch_and_jax(name, x64):
    helper, values, reference = PORTABLE[name]
    want = np.array([reference(x) for x in values])
    numbers = [helper(x) for x in values]
    assert all(isinstance(x, (int, float)) for x in numbers)
    on_torch = helper(torch.tensor(values, dtype=torch.float64))
    on_jax = helper(jnp.asarray(values, dtype=jnp.float64))
    assert isinstance(on_torch, torch.Tensor) and isinstance(on_jax, jax.Array)
    for got in (np.array(numbers, dtype=np.float64), on_torch.numpy(), np.asarray(on_jax)):
        np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)


@torch_side
def test_portable_helpers_on_two_arrays():
    x, y = [-2.0, 0.5, 3.0], [1.0, -1.0, 3.5]
    for array in (torch.tensor, jnp.asarray):
        np.testing.assert_array_equal(as_numpy(sm.minimum(array(x), array(y))), np.minimum(x, y))
        np.testing.assert_array_equal(as_numpy(sm.maximum(array(x), array(y))), np.maximum(x, y))
        np.testing.assert_array_equal(as_numpy(sm.where(array(x) > array(y), array(x), array(y))), np.maximum(x, y))
    assert sm.where(True, 2.0, 3.0) == 2.0 and sm.where(False, 2.0, 3.0) == 3.0


@torch_side
def test_a_torch_softcap_derivative_is_one_tanh_backward():
    """torch's tanh_backward stays one node (cuDNN's tanh_backward), not 1 - y * y expanded."""
    traced = flex.trace("torch", lambda s, b, h, qi, ki: 20.0 * torch.tanh(s / 20.0), None, torch.device("cpu"))
    ops = [node.op for node in traced.derivative.nodes]
    assert ops.count("tanh_grad") == 1 and "tanh" not in ops, ops


_SHIFT = 0.5


def _doubled(x):
    return 2 * x


def _read_forms():
    """Callbacks whose reads take each form: numbers, a module, an array, a helper function, a dict, a
    list, defaults, a closure cell holding a tuple, a library function's closure."""
    table = np.arange(4.0)
    weights = {"w": 2.0}
    pair = (1.0, 2.0)

    def over_numbers(score, b, h, q_idx, kv_idx):
        return score * _SHIFT + math.pi

    def over_array(score, b, h, q_idx, kv_idx):
        return score + table[h] * sm.tanh(score)

    def through_helper(score, b, h, q_idx, kv_idx):
        return _doubled(score)

    def over_dict_and_pair(score, b, h, q_idx, kv_idx):
        return score * weights["w"] + pair[0]

    def with_default(score, b, h, q_idx, kv_idx, cap=30.0):
        return cap * sm.tanh(score / cap)

    return [over_numbers, over_array, through_helper, over_dict_and_pair, with_default,
            sm.softcap(3.0).flex[0], sm.sliding_window(4, 0).flex[1],
            sm.compose(sm.softcap(3.0), sm.alibi([0.5, 0.25]), sm.causal()).flex[0]]


@pytest.mark.parametrize("index", range(8))
def test_flat_reads_is_the_flattened_snapshot(index):
    """flat_reads' shortcut for callbacks that read only leaves gives what flattening the snapshot gives,
    so keys made either way agree (torch/score_mod_bindings.py)."""
    from fusedattn.score_mods.flex import _flatten, flat_reads, snapshot

    fn = _read_forms()[index]
    found: list = []
    _flatten(snapshot(fn), found)
    assert flat_reads(fn) == tuple(found)


@pytest.mark.parametrize("shape", [()])
def test_a_learnable_jax_scalar_used_whole_learns_under_grad_and_jit(shape):
    """score + c * (kv_idx - q_idx) with c a 0-d array being differentiated: it was
    refused under grad and grad inside jit ("indexed by numbers alone") while grad of jit ran it; every
    nesting now gives the float64 gradient written here."""
    rng = np.random.default_rng(12)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 3, 8)), jnp.float32) for _ in range(3))
    c0 = jnp.full(shape, 0.3, jnp.float32)

    def loss(c):
        return fj.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + c * (ki - qi)).sum()

    def exact(c):
        qd, kd, vd = (np.asarray(x, np.float64) for x in (q, k, v))
        i = np.arange(5)
        scores = np.einsum("bqhd,bkhd->bhqk", qd, kd) / np.sqrt(8) + c * (i[None, :] - i[:, None])
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        return np.einsum("bhqk,bkhd->bqhd", weights, vd).sum()

    step = 1e-6
    want = (exact(0.3 + step) - exact(0.3 - step)) / (2 * step)
    for name, fn in (("grad", jax.grad(loss)), ("jit(grad)", jax.jit(jax.grad(loss))),
                     ("grad(jit)", jax.grad(jax.jit(loss)))):
        got = fn(c0)
        assert got.shape == shape and abs(float(got.sum()) - want) <= 1e-3 * max(1.0, abs(want)), (name, got, want)
