"""score_mods.index_bounds: every index range holds every value the index takes (generated integer
expressions over the positions, evaluated on the grid), and a captured tensor indexed past its extent
is a clear error in torch and JAX alike, where JAX alone would clamp the index and answer wrongly."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from needs_torch import requires_torch

from fusedattn.score_mods.expr import INT, Builder
from fusedattn.score_mods.flex import trace_mask
from fusedattn.score_mods.index_bounds import check_indices, index_ranges

SHAPE = (2, 3, 5, 7)  # (B, H, Sq, Skv)
_NAMES = ("b", "h", "q_idx", "kv_idx")
_COMPARISONS = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal}
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
           "floordiv": np.floor_divide, "mod": np.mod}


def _grid() -> dict:
    return {name: np.arange(SHAPE[axis]).reshape([-1 if a == axis else 1 for a in range(4)])
            for axis, name in enumerate(_NAMES)}


def _random_index(seed: int):
    """A random integer expression of the positions (and its values on the grid, computed with NumPy)."""
    rng = np.random.default_rng(seed)
    b, grid = Builder(), _grid()
    values: dict = {}
    pool = []
    for name in _NAMES:
        node = b.input(name, INT)
        values[node] = grid[name]
        pool.append(node)
    for _ in range(int(rng.integers(2, 8))):
        kind = rng.integers(0, 5)
        x = pool[int(rng.integers(len(pool)))]
        if kind == 0:  # x op number
            op = str(rng.choice(list(_BINARY)))
            number = int(rng.integers(1, 5)) if op in ("floordiv", "mod") else int(rng.integers(-6, 7))
            node = b.op(op, x, b.scalar(number))
            values[node] = _BINARY[op](values[x], number)
        elif kind == 1:  # x op y
            y = pool[int(rng.integers(len(pool)))]
            op = str(rng.choice(["add", "sub", "mul", "max", "min"]))
            node = b.op(op, x, y)
            values[node] = _BINARY[op](values[x], values[y])
        elif kind == 2:
            op = str(rng.choice(["neg", "abs"]))
            node = b.op(op, x)
            values[node] = -values[x] if op == "neg" else np.abs(values[x])
        elif kind == 3:  # where(x cmp n, f(x), y): a branch narrowed by its condition
            op, number = str(rng.choice(list(_COMPARISONS))), int(rng.integers(-3, 6))
            condition = b.op(op, x, b.scalar(number))
            shift = int(rng.integers(-8, 9))
            shifted = b.op("add", x, b.scalar(shift))
            values[shifted] = values[x] + shift
            other = pool[int(rng.integers(len(pool)))]
            node = b.op("where", condition, shifted, other)
            values[node] = np.where(_COMPARISONS[op](values[x], number), values[shifted], values[other])
        else:  # JAX's negative-index rule
            size = int(rng.integers(1, 9))
            condition = b.op("lt", x, b.scalar(0))
            node = b.op("where", condition, b.op("add", x, b.scalar(size)), x)
            values[node] = np.where(values[x] < 0, values[x] + size, values[x])
        pool.append(node)
    output = pool[-1]
    return b.finish(output), values[output]


@pytest.mark.parametrize("seed", range(200))
def test_every_value_an_index_takes_lies_in_its_range(seed):
    expr, values = _random_index(seed)
    found = index_ranges(expr, SHAPE)[expr.output]
    assert found is not None
    low, high = found
    assert low <= values.min() and values.max() <= high, (found, values.min(), values.max())


def test_the_ranges_are_tight_where_they_can_be():
    """Not only sound: a plain position, a clipped distance and a wrapped index give their exact ranges
    (a generator that always found huge ranges would pass the test above)."""
    b = Builder()
    q, kv = b.input("q_idx", INT), b.input("kv_idx", INT)
    distance = b.op("sub", kv, q)
    clipped = b.op("add", b.op("min", b.scalar(3), b.op("max", b.scalar(-3), distance)), b.scalar(3))
    wrapped = b.op("where", b.op("lt", q, b.scalar(0)), b.op("add", q, b.scalar(9)), q)
    ranges = index_ranges(b.finish(b.op("add", clipped, wrapped)), SHAPE)
    assert (ranges[distance], ranges[clipped], ranges[wrapped]) == ((-4, 6), (0, 6), (0, 4))


def _mask(framework, size):
    if framework == "jax":
        ids = jnp.zeros((SHAPE[0], size), jnp.int32)
        return lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx]
    import torch

    ids = torch.zeros((SHAPE[0], size), dtype=torch.int32)
    return lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx]


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=requires_torch("torch's tracer")), "jax"])
def test_a_tensor_shorter_than_the_call_is_named(framework):
    expr = trace_mask(framework, _mask(framework, SHAPE[2] - 1)).expr
    with pytest.raises(ValueError, match=r"shape \(2, 4\) is indexed on its axis 1 by values from 0 to 4 .*"
                                         r"Sq=5.*\[-4, 3\]"):
        check_indices("here", expr, (SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[2]))
    check_indices("here", trace_mask(framework, _mask(framework, SHAPE[2])).expr,
                  (SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[2]))


def test_jax_would_clamp_silently_so_the_call_refuses():
    import fusedattn.jax as fj

    q = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 2, 16)), jnp.float32)
    ids = jnp.asarray([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"fusedattn.jax.attention: .*shape \(2, 6\).*clamp"):
        fj.attention(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])
    table = jnp.ones((2, 9))
    with pytest.raises(ValueError, match=r"axis 1 by values from -3 to 11"):
        fj.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[h, kv_idx - q_idx + 4])


@requires_torch("the torch frontend")
def test_torch_names_the_tensor_instead_of_an_index_error():
    import torch

    import fusedattn.torch as ft

    q = torch.randn(2, 8, 2, 16)
    ids = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"fusedattn.torch.attention: .*shape \(2, 6\) is indexed on its axis 1"):
        ft.attention(q, q, q, mask_mod=lambda b, h, q_idx, kv_idx: ids[b, q_idx] == ids[b, kv_idx])
    table = torch.randn(2, 9)
    ft.attention(q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: s + table[h, (kv_idx - q_idx).clamp(-4, 4) + 4])


@requires_torch("the torch frontend")
def test_a_learning_term_read_past_its_table_is_named_in_torch():
    """A term whose table requires grad runs as a bias gathered from the table (on a GPU a gather past it
    is a device-side assert): the same named error as a bound aux, at the first call of each shape; out of
    range at index 0 said "no gradient can reach" it before."""
    import torch

    import fusedattn.torch as ft

    table = torch.randn(2, 40, requires_grad=True)

    def relpos(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 15]

    for _ in range(2):
        q = torch.randn(1, 16, 2, 8, requires_grad=True)
        ft.attention(q, q, q, score_mod=relpos).sum().backward()
    q = torch.randn(1, 32, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match=r"shape \(2, 40\) is indexed on its axis 1 by values from -16 to 46"):
        ft.attention(q, q, q, score_mod=relpos)
    short = torch.randn(2, 10, requires_grad=True)
    with pytest.raises(ValueError, match=r"an index is out of range of an array it reads: index 15"):
        ft.attention(q, q, q, score_mod=lambda score, b, h, q_idx, kv_idx: score + short[h, q_idx - kv_idx + 15])


def test_a_learning_term_read_past_its_table_is_refused_in_jax_where_it_would_clamp():
    import jax

    import fusedattn.jax as fj

    q = jnp.asarray(np.random.default_rng(1).standard_normal((1, 32, 2, 8)), jnp.float32)

    def loss(table):
        mod = lambda s, b, h, q_idx, kv_idx: s + table[h, q_idx - kv_idx + 15]  # noqa: E731
        return fj.attention(q, q, q, score_mod=mod).sum()

    jax.jit(jax.grad(loss))(jnp.ones((2, 63)))
    with pytest.raises(ValueError, match=r"shape \(2, 40\) is indexed on its axis 1 by values from -16 to 46"):
        jax.jit(jax.grad(loss))(jnp.ones((2, 40)))
