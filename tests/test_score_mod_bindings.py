"""Warm score_mod calls (torch/score_mod_bindings.py) without a GPU: a repeat call reuses its bound
operands while the callbacks read the same objects and their tensors keep their versions, and binds
again otherwise; the empty-row fix is asked for exactly when a row can lose every key.

The operator itself is replaced by a recorder: what reaches it is what these tests check.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import fusedattn.score_mods as sm
import fusedattn.torch as fat
from fusedattn.config import AttentionConfig
from fusedattn.score_mods.core import as_score_mod, bind
from fusedattn.torch import functional
from fusedattn.torch.score_mod_bindings import may_empty_rows

CAP = 30.0


def _softcap(score, b, h, q_idx, kv_idx):
    return CAP * sm.tanh(score / CAP)


@pytest.fixture
def operator(monkeypatch):
    """Every call has native plan 7 here; the recorder keeps what reaches the operator."""
    seen = []
    monkeypatch.setattr(functional, "_native_plan_on", lambda cfg, name, device: 7)

    def record(plan, q, k, v, sink, seed, offset, *extra):
        seen.append(extra)
        return q.clone(), q[..., 0].float()

    monkeypatch.setattr(functional, "_operator", record)
    return seen


def _call(q, **options):
    return fat.attention(q, q, q, mask="causal", **options)


def test_a_repeat_call_reuses_its_operands_and_follows_a_new_number(operator):
    global CAP
    q = torch.randn(1, 16, 2, 8)
    _call(q, score_mod=_softcap)
    _call(q, score_mod=_softcap)
    assert operator[0][1] == [] and 30.0 in operator[0][2] and operator[0][3] is False  # softcap cannot mask
    assert operator[1][2] is operator[0][2]  # the kept binding itself
    before = CAP
    try:
        CAP = 5.0
        _call(q, score_mod=_softcap)
    finally:
        CAP = before
    assert 5.0 in operator[2][2] and 30.0 not in operator[2][2]


def test_an_in_place_change_of_a_captured_tensor_binds_again(operator):
    q = torch.randn(1, 16, 2, 8)
    table = torch.zeros(16, 16)

    def bias(score, b, h, q_idx, kv_idx):
        return score + table[q_idx, kv_idx]

    _call(q, score_mod=bias)
    _call(q, score_mod=bias)
    assert operator[1][1][0] is operator[0][1][0]
    table.add_(1.0)
    _call(q, score_mod=bias)
    aux = operator[2][1][0]
    assert aux is not operator[0][1][0] and float(aux.min()) == 1.0  # a gather over (q, kv): materialized anew


def test_a_score_mod_object_with_a_new_value_in_its_dict_binds_again(operator):
    q = torch.randn(1, 16, 2, 8)

    def capped(graph, score, tensors):
        return graph.mul(a=graph.tanh(input=graph.div(a=score, b=tensors["cap"])), b=tensors["cap"])

    def capped_bprop(graph, dscore, tensors):
        return dscore  # (the values bound are what this test reads)

    mod = sm.ScoreMod(capped, capped_bprop, {"cap": 30.0})
    _call(q, score_mod=mod)
    mod.tensors["cap"] = 7.0
    _call(q, score_mod=mod)
    assert 30.0 in operator[0][2] and 7.0 in operator[1][2]
    with pytest.raises(TypeError):  # a built-in's numbers are its function's: a new one is a new built-in
        sm.softcap(30.0).tensors["cap"] = 7.0


def test_a_callable_object_binds_every_call(operator):
    q = torch.randn(1, 16, 2, 8)

    class Softcap:
        def __call__(self, score, b, h, q_idx, kv_idx):
            return 30.0 * sm.tanh(score / 30.0)

    mod = Softcap()
    _call(q, score_mod=mod)
    _call(q, score_mod=mod)
    assert operator[1][2] is not operator[0][2] and operator[1][2] == operator[0][2]


_SLOPES = torch.rand(4)
_INFINITE = torch.tensor([0.0, -float("inf"), 1.0, 2.0])


@pytest.mark.parametrize("mod, empty", [
    (_softcap, False),
    (lambda s, b, h, q_idx, kv_idx: s + _SLOPES[h] * (kv_idx - q_idx), False),
    (lambda s, b, h, q_idx, kv_idx: s + _INFINITE[h], True),  # a captured -inf: an additive mask
    (lambda s, b, h, q_idx, kv_idx: sm.where(q_idx >= kv_idx, s, -float("inf")), True),
    (lambda s, b, h, q_idx, kv_idx: s - 1e9 * (kv_idx > q_idx), True),  # a mask by a large number
    (sm.softcap(20.0), False), (sm.alibi([0.5, 0.25, 0.125, 0.0625]), False), (sm.causal(), True),
    (sm.compose(sm.softcap(20.0), sm.causal()), True), (sm.clamp(-1e9, 0.0), True),
], ids=["softcap", "alibi", "infinite-bias", "where", "large-number", "builtin-softcap", "builtin-alibi",
        "builtin-causal", "composed-causal", "clamp-to-mask"])
def test_the_empty_row_fix_is_asked_for_exactly_when_a_row_can_lose_every_key(mod, empty):
    cfg = AttentionConfig(dtype="bfloat16", layout="bshd", batch=2, seqlen_q=40, seqlen_kv=48, heads_q=4,
                          heads_kv=4, head_dim_qk=64, head_dim_v=64, mask="none", device="cuda")
    mod = as_score_mod("test", mod, framework="torch", device=torch.device("cpu"))  # (a built-in: traced)
    bound = bind("test", mod, batch=2, heads_q=4, seqlen_q=40, seqlen_kv=48, device="cpu", training=False,
                 like=torch.empty(1))
    assert may_empty_rows(cfg, bound) is empty
    if not empty:  # a window can leave queries past the last key when Sq > Skv
        longer = cfg.replace(seqlen_q=64, mask="causal")
        assert may_empty_rows(longer, bound) is True
        # and a sequence may have more queries than keys at any Sq, Skv: a left bound can leave its last rows
        assert may_empty_rows(cfg.replace(mask="padding", window=(3, -1)), bound) is True
        assert may_empty_rows(cfg.replace(mask="padding"), bound) is False  # every row keeps key 0
        assert may_empty_rows(cfg.replace(mask="padding_causal"), bound) is False


# ------------------------------------------------------------ callbacks made anew at each call


def _closure(cap):
    def softcap(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)
    return softcap


def _shifted(shift):
    return lambda score, b, h, q_idx, kv_idx: score + shift


def test_a_closure_made_anew_at_each_call_reuses_its_binding(operator):
    q = torch.randn(1, 16, 2, 8)
    for _ in range(3):
        _call(q, score_mod=_closure(20.0))
    assert operator[2][2] is operator[0][2] and 20.0 in operator[0][2]
    _call(q, score_mod=_closure(7.0))
    assert 7.0 in operator[3][2] and 20.0 not in operator[3][2]
    _call(q, score_mod=_closure(float("20")))  # the same value computed anew: the kept binding
    assert operator[4][2] is operator[0][2]


def test_numbers_are_read_by_exact_value(operator):
    q = torch.randn(1, 16, 2, 8)
    _call(q, score_mod=_shifted(0.0))
    _call(q, score_mod=_shifted(-0.0))
    _call(q, score_mod=_shifted(0.0))
    signs = [math.copysign(1.0, scalars[0]) for _, _, scalars, _ in operator]
    assert signs == [1.0, -1.0, 1.0]
    assert operator[2][2] is operator[0][2]


def test_closures_of_one_code_over_other_tensors_each_keep_their_binding(operator):
    """One closure per layer, called in turn: each finds its own binding, none binds again."""
    q = torch.randn(1, 16, 2, 8)
    tables = [torch.randn(2) for _ in range(3)]

    def layer(slopes):
        return lambda score, b, h, q_idx, kv_idx: score + slopes[h] * (kv_idx - q_idx)

    for _ in range(2):
        for table in tables:
            _call(q, score_mod=layer(table))
    first, second = operator[:3], operator[3:]
    for a, b, table in zip(first, second, tables):
        assert b[1][0] is a[1][0]
        assert torch.equal(a[1][0].reshape(-1), table)
    fresh = torch.randn(2)
    _call(q, score_mod=layer(fresh))  # a tensor made anew: bound anew, its own values
    assert torch.equal(operator[-1][1][0].reshape(-1), fresh)


def test_a_built_in_made_anew_at_each_call_reuses_its_binding(operator):
    q = torch.randn(1, 16, 2, 8)
    _call(q, score_mod=sm.softcap(20.0))
    _call(q, score_mod=sm.softcap(20.0))
    _call(q, score_mod=sm.softcap(9.0))
    assert operator[1][2] is operator[0][2] and 9.0 in operator[2][2] and 20.0 not in operator[2][2]
    slopes = torch.rand(2)
    _call(q, score_mod=sm.alibi(slopes))
    _call(q, score_mod=sm.alibi(slopes))
    assert operator[4][1][0] is operator[3][1][0]
    slopes.mul_(2.0)  # an in-place change: bound anew
    _call(q, score_mod=sm.alibi(slopes))
    assert operator[5][1][0] is not operator[3][1][0]
    torch.testing.assert_close(operator[5][1][0].reshape(-1), slopes)


def test_an_equal_built_in_seen_twice_gets_its_own_binding_and_one_made_each_call_never_does(operator):
    """A second layer's equal built-in first uses the first layer's binding, then (seen again: it lives on)
    a binding of its own with the same operands; built-ins made anew at each call add no binding."""
    from fusedattn.cache import registry
    from fusedattn.torch import score_mod_bindings

    q = torch.randn(1, 16, 2, 8)
    first, second = sm.softcap(20.0), sm.softcap(20.0)
    _call(q, score_mod=first)
    _call(q, score_mod=first)
    kept = len(registry["torch.score_mod.bindings"].keys())
    _call(q, score_mod=second)
    assert len(registry["torch.score_mod.bindings"].keys()) == kept
    _call(q, score_mod=second)
    _call(q, score_mod=second)
    assert len(registry["torch.score_mod.bindings"].keys()) == kept + 1
    assert operator[4][2] is operator[0][2] and operator[3][2] is operator[0][2]  # the same operands
    for _ in range(20):
        _call(q, score_mod=sm.softcap(20.0))
    assert len(registry["torch.score_mod.bindings"].keys()) == kept + 1
    assert len(score_mod_bindings._SEEN_ONCE) <= 20


def test_a_composition_made_anew_at_each_call_reuses_its_binding(operator):
    """compose(...) written in a model's forward: a new composition of new mods each call, the same mod."""
    q = torch.randn(1, 16, 2, 8)
    slopes = torch.rand(2)
    for cap in (20.0, 20.0, 9.0):
        _call(q, score_mod=sm.compose(sm.alibi(slopes), sm.softcap(cap)))
    assert operator[1][2] is operator[0][2] and operator[1][1][0] is operator[0][1][0]
    assert 9.0 in operator[2][2] and 20.0 not in operator[2][2]
    slopes.mul_(2.0)  # an in-place change of a part's tensor: bound anew
    _call(q, score_mod=sm.compose(sm.alibi(slopes), sm.softcap(9.0)))
    torch.testing.assert_close(operator[3][1][0].reshape(-1), slopes)
    _call(q, score_mod=sm.compose(sm.softcap(9.0), sm.alibi(slopes)))  # another order: another mod
    assert operator[4][2] is not operator[3][2]
    from fusedattn.torch.score_mod_bindings import signature_part

    assert (signature_part(sm.compose(sm.alibi(slopes), sm.softcap(1.0)))
            != signature_part(sm.compose(sm.softcap(1.0), sm.alibi(slopes))))


def test_a_bound_method_follows_its_object(operator):
    q = torch.randn(1, 16, 2, 8)

    class Capped:
        def __init__(self, cap):
            self.cap = cap

        def softcap(self, score, b, h, q_idx, kv_idx):
            return self.cap * sm.tanh(score / self.cap)

    layer = Capped(20.0)
    _call(q, score_mod=layer.softcap)
    _call(q, score_mod=layer.softcap)
    assert operator[1][2] is operator[0][2]
    layer.cap = 3.0
    _call(q, score_mod=layer.softcap)
    assert 3.0 in operator[2][2] and 20.0 not in operator[2][2]


def test_a_relative_position_table_made_anew_at_each_call_reuses_its_expansion(operator):
    q = torch.randn(1, 16, 2, 8)
    table = torch.randn(2, 9)
    _call(q, score_mod=sm.relative_position_bias(table))
    _call(q, score_mod=sm.relative_position_bias(table))
    assert operator[1][1][0] is operator[0][1][0]
    table.add_(1.0)
    _call(q, score_mod=sm.relative_position_bias(table))
    expanded = operator[2][1][0]
    assert expanded is not operator[0][1][0]
    distance = (torch.arange(16)[None, :] - torch.arange(16)[:, None]).clamp(-4, 4) + 4
    torch.testing.assert_close(expanded.reshape(2, 16, 16), table[:, distance])


def test_generated_call_sequences_pass_what_a_fresh_bind_passes(operator):
    """Random calls of callbacks made anew or reused, over numbers that are equal but not the same (0.0 and
    -0.0, 1 and 1.0, 2.5 computed twice) and tensors changed in place: every warm call reaches the operator
    with the aux values and numbers that the same call bound with every cache empty gives."""
    from fusedattn.cache import clear_all

    rng = random.Random(8)
    q = torch.randn(1, 16, 2, 8)
    numbers = [0.0, -0.0, 1, 1.0, 2.5, float("2.5"), 7]
    tables = [torch.randn(2) for _ in range(3)]

    def scaled(number):
        return lambda score, b, h, q_idx, kv_idx: score * number

    def tilted(number, table):
        return lambda score, b, h, q_idx, kv_idx: score + table[h] * number

    def passed() -> tuple:  # what the last call gave the operator, copied (aux may be views of the tables)
        _, aux, scalars, _ = operator[-1]
        return [x.clone() for x in aux], list(scalars)

    steps, made = [], []
    for _ in range(150):
        if made and rng.random() < 0.3:
            mod = rng.choice(made)  # the same function object again
        elif rng.random() < 0.5:
            mod = scaled(rng.choice(numbers))
        else:
            mod = tilted(rng.choice(numbers), rng.choice(tables))
        made.append(mod)
        if rng.random() < 0.1:
            rng.choice(tables).add_(0.5)  # in place: calls reading it must see the new values
        _call(q, score_mod=mod)
        steps.append((mod, [x.clone() for x in tables], passed()))
    assert len(operator) == 150
    for mod, state, (aux, scalars) in steps:
        for table, values in zip(tables, state):
            table.copy_(values)
        clear_all()
        _call(q, score_mod=mod)
        fresh_aux, fresh_scalars = passed()
        assert [type(x) for x in scalars] == [type(x) for x in fresh_scalars]
        assert [(x, math.copysign(1.0, x)) for x in scalars] == [(x, math.copysign(1.0, x)) for x in fresh_scalars]
        assert len(aux) == len(fresh_aux) and all(torch.equal(a, b) for a, b in zip(aux, fresh_aux))


CAPS = {"cap": 30.0}


def test_a_repeat_call_follows_a_rebound_cell_a_global_and_a_dict_it_reads(operator):
    """A repeat call compares what its function reads in place (its cells, its globals) where nothing read
    is looked inside; a dict it reads is looked inside, so a new value there binds again too."""
    global CAP
    q = torch.randn(1, 16, 2, 8)
    cap = 10.0

    def rebound(score, b, h, q_idx, kv_idx):
        return cap * sm.tanh(score / cap)

    def from_dict(score, b, h, q_idx, kv_idx):
        return CAPS["cap"] * sm.tanh(score / CAPS["cap"])

    for fn in (rebound, _softcap, from_dict):
        _call(q, score_mod=fn)
        _call(q, score_mod=fn)
        assert operator[-1][2] is operator[-2][2]  # the kept binding
    cap = 4.0
    _call(q, score_mod=rebound)
    assert 4.0 in operator[-1][2] and 10.0 not in operator[-1][2]
    before = CAP
    try:
        CAP = 6.0
        _call(q, score_mod=_softcap)
        assert 6.0 in operator[-1][2]
    finally:
        CAP = before
    CAPS["cap"] = 7.0
    try:
        _call(q, score_mod=from_dict)
        assert 7.0 in operator[-1][2]
    finally:
        CAPS["cap"] = 30.0


def test_a_copy_of_a_score_mod_leaves_the_kept_signature_part_behind(operator):
    """What the bindings keep on a ScoreMod names this process's objects by id: a copy or a pickle (here
    its state) carries the fields only, and the copy still finds the binding by its callbacks and dicts."""
    import copy

    q = torch.randn(1, 16, 2, 8)
    mod = sm.additive_bias(torch.randn(1, 2, 16, 16))  # (a flex-form built-in is called as its functions)
    _call(q, score_mod=mod)
    assert any(name.startswith("_binding") for name in vars(mod))
    assert not any(name.startswith("_binding") for name in mod.__getstate__())
    twin = copy.copy(mod)
    assert not any(name.startswith("_binding") for name in vars(twin))
    _call(q, score_mod=twin)
    assert operator[1][2] is operator[0][2]


# ---------------------------------------------------------------- added terms that learn (run as a bias)

@pytest.fixture
def biased_operator(monkeypatch):
    """As `operator`, but the output depends on the bias it is given (out = q + sum of the bias), so a
    backward reaches the tensors the bias was summed from."""
    seen = []
    monkeypatch.setattr(functional, "_native_plan_on", lambda cfg, name, device: 7)

    def record(plan, q, k, v, sink, seed, offset, *extra):
        seen.append(extra)
        bias = extra[0] if extra else None
        out = q.clone() if bias is None else q + bias.float().sum()
        return out, q[..., 0].float()

    monkeypatch.setattr(functional, "_operator", record)
    return seen


def _learners(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(2, generator=gen).requires_grad_(), torch.randn(2, 31, generator=gen).requires_grad_()


def _learning_mods(slopes, table):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def relpos(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + 15]

    def both(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx) + 0.5 * table[h, kv_idx - q_idx + 15]

    def every_other(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx) % 2 == 0

    return {"alibi": (alibi, None), "relpos": (relpos, None), "both": (both, None),
            "relpos beside a mask_mod": (relpos, every_other), "alibi beside a mask_mod": (alibi, every_other)}


@pytest.mark.parametrize("name", list(_learning_mods(*_learners(0))))
def test_a_repeat_call_sums_a_learning_term_anew_as_its_bias(biased_operator, name):
    """Every call of a training loop (the tensors updated in place between steps) passes the bias and gets
    the gradients that the same call with every cache empty gives; beside a mask_mod the repeat calls
    passed no bias at all before (the kept binding was the mask's)."""
    from fusedattn.cache import clear_all

    slopes, table = _learners(1)
    score_mod, mask_mod = _learning_mods(slopes, table)[name]
    q = torch.randn(1, 16, 2, 8)
    given = torch.randn(1, 2, 16, 16)
    for step in range(4):
        options = {"score_mod": score_mod, "mask_mod": mask_mod, **({"bias": given} if step % 2 else {})}
        fat.attention(q, q, q, **options)  # (the first call of these options after the caches were emptied)
        fat.attention(q, q, q, **options).sum().backward()
        warm_bias, warm_grads = biased_operator[-1][0].clone(), (slopes.grad, table.grad)
        slopes.grad = table.grad = None
        clear_all()
        fat.attention(q, q, q, **options).sum().backward()
        assert torch.equal(warm_bias, biased_operator[-1][0]), (step, name)
        for warm, fresh in zip(warm_grads, (slopes.grad, table.grad)):
            assert (warm is None) == (fresh is None) and (warm is None or torch.equal(warm, fresh)), (step, name)
        assert any(grad is not None for grad in warm_grads)
        slopes.grad = table.grad = None
        with torch.no_grad():  # the optimizer's step
            slopes.mul_(0.9).add_(0.05)
            table.add_(0.25)
    assert len(biased_operator) == 12


def test_a_learning_term_whose_tensors_stop_learning_binds_as_a_score_mod_again(biased_operator):
    slopes, table = _learners(2)
    relpos = _learning_mods(slopes, table)["relpos"][0]
    q = torch.randn(1, 16, 2, 8)
    for _ in range(2):
        fat.attention(q, q, q, score_mod=relpos)
    assert [len(extra[1]) for extra in biased_operator] == [0, 0]  # the term as the bias, no aux
    table.requires_grad_(False)
    fat.attention(q, q, q, score_mod=relpos)
    assert biased_operator[-1][0] is None and len(biased_operator[-1][1]) == 1  # the gather, bound as aux


def test_learning_tensors_bind_once_without_grad_and_again_after_an_in_place_step(operator):
    slopes, table = _learners(3)
    relpos = _learning_mods(slopes, table)["relpos"][0]
    q = torch.randn(1, 16, 2, 8)
    with torch.no_grad():
        _call(q, score_mod=relpos)
        _call(q, score_mod=relpos)
        assert operator[1][1][0] is operator[0][1][0]  # inference: the aux of the first call
        table.add_(1.0)
        _call(q, score_mod=relpos)
    assert operator[2][1][0] is not operator[0][1][0]
    assert torch.equal(operator[2][1][0], operator[0][1][0] + 1.0)
