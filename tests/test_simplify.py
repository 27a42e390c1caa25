"""score_mods.simplify: the rewrites keep every value (generated expressions, float64), make
the derived softcap derivative one tanh_grad and a scale in torch and JAX alike, leave index
arithmetic alone, and keep keys independent of the numbers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from needs_torch import requires_torch

from fusedattn import score_mods as sm
from fusedattn.score_mods import flex
from fusedattn.score_mods.aux_plan import plan_aux
from fusedattn.score_mods.expr import BOOL, FLOAT, INT, Builder, ExprError, evaluate
from fusedattn.score_mods.simplify import simplified
from fusedattn.xp import namespace

FRAMEWORKS = (pytest.param("torch", marks=requires_torch("torch's tracer")), "jax")
SHAPE = (2, 3, 5, 7)  # (B, H, Sq, Skv)
HEAD_TABLE = np.random.default_rng(1).uniform(0.5, 2.0, SHAPE[1])
KEY_TABLE = np.random.default_rng(2).standard_normal((SHAPE[0], SHAPE[3]))


def _environment(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    env = {"score": jnp.asarray(rng.standard_normal(SHAPE) * 3), "dscore": jnp.asarray(rng.standard_normal(SHAPE))}
    for axis, name in enumerate(("b", "h", "q_idx", "kv_idx")):
        env[name] = jnp.arange(SHAPE[axis]).reshape([-1 if a == axis else 1 for a in range(4)])
    return env


def _random_expr(seed: int):
    """A random pointwise function of the score, dscore, positions, numbers and two captured tables,
    rich in what the rewrites touch: products and quotients by numbers, tanh_grad, sums of scaled terms."""
    rng = np.random.default_rng(seed)
    b = Builder()
    score, dscore = b.input("score", FLOAT), b.input("dscore", FLOAT)
    index = {name: b.input(name, INT) for name in ("b", "h", "q_idx", "kv_idx")}

    def number():
        return b.scalar(float(rng.choice([-1, 1]) * rng.uniform(0.25, 8.0)))

    leaves = [score, dscore, number(), b.load(jnp.asarray(HEAD_TABLE), [index["h"]], FLOAT),
              b.load(jnp.asarray(KEY_TABLE), [index["b"], index["kv_idx"]], FLOAT),
              b.op("sub", index["q_idx"], index["kv_idx"])]
    values = list(leaves)
    for _ in range(int(rng.integers(4, 12))):
        pick = lambda: values[-1] if rng.random() < 0.5 else values[int(rng.integers(len(values)))]  # noqa: E731
        kind = rng.choice(["mul_number", "div_number", "div_head", "mul", "add", "sub", "tanh", "tanh_grad",
                           "where", "scaled_sum"])
        if kind == "mul_number":
            made = b.op("mul", pick(), number()) if rng.random() < 0.5 else b.op("mul", number(), pick())
        elif kind == "div_number":
            made = b.op("div", pick(), number())
        elif kind == "div_head":
            made = b.op("div", pick(), leaves[3])
        elif kind in ("mul", "add", "sub"):
            made = b.op(str(kind), pick(), pick())
        elif kind == "tanh":
            made = b.op("tanh", b.op("mul", pick(), number()))
        elif kind == "tanh_grad":
            made = b.op("tanh_grad", b.op("mul", pick(), number()), pick())
        elif kind == "where":
            made = b.op("where", b.op("le", index["q_idx"], index["kv_idx"]), pick(), pick())
        else:  # a * k + b * k with one k, as autodiff writes a chain rule
            k = number()
            made = b.op("add", b.op("mul", pick(), k), b.op("mul", k, pick()))
        if b.kind(made) == FLOAT:
            values.append(made)
    output = b.op("add", b.op("mul", values[-1], score), dscore)  # the result depends on the score
    return b.finish(output)


def _close(got, want) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * (1 + np.nanmax(np.abs(want))), equal_nan=True)


@pytest.mark.parametrize("seed", range(150))
def test_simplified_expressions_keep_their_values(seed, x64):
    expr = _random_expr(seed)
    try:
        lean = simplified(expr)
    except ExprError as error:  # a folded number that is not finite: refused, never wrong
        assert "not finite" in str(error)
        return
    env = _environment(seed)
    ops = namespace(env["score"])
    _close(evaluate(lean, ops, env, "float64"), evaluate(expr, ops, env, "float64"))
    assert len(lean.nodes) <= len(expr.nodes) + 4


def test_the_generated_expressions_exercise_the_rewrites():
    """A generator that never triggered a rewrite would make the value test vacuous."""
    changed = sum(simplified(e).key != e.key for e in map(_random_expr, range(150)))
    divisions = sum(any(n.op == "div" for n in e.nodes) for e in map(_random_expr, range(150)))
    assert changed > 50 and divisions > 50


def _ops(expr) -> list[str]:
    return [n.op for n in expr.nodes if n.op not in ("input", "scalar")]


def _softcap(score, b, h, q_idx, kv_idx):
    return 30.0 * sm.tanh(score / 30.0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_the_derived_softcap_derivative_is_a_tanh_grad_and_a_scale(framework):
    """As the hand-written built-in: tanh_grad(dscore, x) of the forward's own x = score * (1 / 30), read,
    not recomputed (recomputing it cost the backward 6-10% on an H100), then a scale of 30 * (1 / 30)."""
    traced = flex.trace(framework, _softcap, None)
    assert _ops(traced.forward) == ["mul", "tanh", "mul"]  # no division: score * (1 / 30)
    assert _ops(traced.derivative) == ["forward", "tanh_grad", "mul"]
    (leaf,) = [n for n in traced.derivative.nodes if n.op == "forward"]
    x = traced.forward.nodes[leaf.attr[0]]
    assert x.op == "mul" and traced.forward.nodes[x.args[0]].attr == ("score",)
    assert traced.derivative.scalars == (pytest.approx(1.0),)


@requires_torch("torch's tracer")
def test_one_softcap_gives_one_graph_in_torch_and_jax():
    torch_traced, jax_traced = flex.trace("torch", _softcap, None), flex.trace("jax", _softcap, None)
    assert torch_traced.derivative.key == jax_traced.derivative.key


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("cap", [1.0, 2.0, 0.5, 1e-3])
def test_keys_do_not_depend_on_the_cap(framework, cap):
    """A cap of 1 (a folded scale of exactly 1) keys as any other: a new cap never builds a new graph."""
    def capped(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)

    reference = flex.trace(framework, _softcap, None)
    traced = flex.trace(framework, capped, None)
    assert (traced.forward.key, traced.derivative.key) == (reference.forward.key, reference.derivative.key)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_index_arithmetic_is_left_as_written(framework):
    """A mask compares exactly what the user's function compares: its divisions stay divisions."""
    def banded(score, b, h, q_idx, kv_idx):
        return sm.where(q_idx / 3 <= kv_idx / 3, score / 2.0, score)

    traced = flex.trace(framework, banded, None)
    free_of_score = [n.op for n in traced.forward.nodes if n.op == "div"]
    assert free_of_score == ["div", "div"], _ops(traced.forward)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_a_division_by_a_head_table_reads_its_reciprocal(framework):
    table = np.array([0.5, 1.0, 2.0], np.float32)
    if framework == "torch":
        import torch

        table = torch.tensor(table)
    else:
        table = jnp.asarray(table)

    def tempered(score, b, h, q_idx, kv_idx):
        return score / table[h]

    traced = flex.trace(framework, tempered, None)
    assert "div" not in _ops(traced.forward)
    aux = plan_aux(traced.forward).aux
    assert [traced.forward.nodes[a.node].op for a in aux] == ["reciprocal"] and aux[0].axes == ("h",)


def test_a_folded_number_that_is_not_finite_is_refused():
    b = Builder()
    expr = b.finish(b.op("div", b.input("score", FLOAT), b.scalar(0.0)))
    with pytest.raises(ExprError, match="not finite"):
        simplified(expr)


def test_jax_tanh_pattern_needs_exactly_one():
    """g * (c - t) + g * (c - t) * t is tanh's derivative only for c = 1."""
    for c, want in ((1.0, "tanh_grad"), (2.0, "add")):
        b = Builder()
        g, x = b.input("dscore", FLOAT), b.input("score", FLOAT)
        t = b.op("tanh", x)
        first = b.op("mul", g, b.op("sub", b.scalar(c), t))
        expr = simplified(b.finish(b.op("add", first, b.op("mul", first, t))))
        assert expr.nodes[expr.output].op == want
        with jax.enable_x64(True):
            env = _environment(3)
            ops = namespace(env["score"])
            want_value = env["dscore"] * (c - jnp.tanh(env["score"])) * (1 + jnp.tanh(env["score"]))
            _close(evaluate(expr, ops, env, "float64"), want_value)


def test_booleans_and_integers_are_not_factored():
    b = Builder()
    score = b.input("score", FLOAT)
    flag = b.op("le", b.input("q_idx", INT), b.input("kv_idx", INT))
    expr = b.finish(b.op("mul", b.op("mul", score, flag), b.scalar(3)))
    lean = simplified(expr)
    assert [n.kind for n in lean.nodes if n.op == "scalar"] == [INT] and BOOL in [n.kind for n in lean.nodes]
    assert math.isclose(len(lean.nodes), len(expr.nodes))
