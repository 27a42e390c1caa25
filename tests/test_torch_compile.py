"""torch.compile(fullgraph=True) traces fusedattn.torch.attention as one custom op, forward and backward.

CPU runs use the aot_eager backend (no code generation); the GPU tests compile with inductor.
"""

from __future__ import annotations

import pytest
import torch

import fusedattn.torch as fat

CASES = {
    "gqa-causal": (dict(mask="causal"), (2, 12, 4, 8), (2, 10, 2, 8)),
    "window-bias": (dict(mask="none", window=(3, 2)), (2, 12, 4, 8), (2, 12, 4, 8)),
    "learnable-sink": (dict(mask="causal", softmax_type="learnable"), (2, 12, 4, 8), (2, 12, 4, 8)),
    "lse-and-max-logit": (dict(mask="causal_bottom_right", return_lse=True, return_max_logit=True),
                          (2, 6, 4, 8), (2, 12, 2, 8)),
}


def _inputs(q_shape, kv_shape, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(q_shape, generator=gen, requires_grad=True)
    k = torch.randn(kv_shape, generator=gen, requires_grad=True)
    v = torch.randn(kv_shape, generator=gen, requires_grad=True)
    return q, k, v


def _loss(result):
    if isinstance(result, torch.Tensor):
        return result.square().sum()
    return result.out.square().sum()


@pytest.mark.parametrize("name", list(CASES))
def test_fullgraph_compile_matches_eager(name):
    options, q_shape, kv_shape = CASES[name]
    q, k, v = _inputs(q_shape, kv_shape, seed=len(name))
    extra = {}
    leaves = [q, k, v]
    if name == "window-bias":
        extra["bias"] = torch.randn(1, 4, 12, 12, requires_grad=True)
        leaves.append(extra["bias"])
    if options.get("softmax_type") == "learnable":
        extra["sink"] = torch.randn(4, requires_grad=True)
        leaves.append(extra["sink"])

    def step(q, k, v, extra):
        return fat.attention(q, k, v, **options, **extra)

    torch._dynamo.reset()
    eager = step(q, k, v, extra)
    eager_grads = torch.autograd.grad(_loss(eager), leaves)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, extra)
    compiled_grads = torch.autograd.grad(_loss(compiled), leaves)
    if options.get("return_lse"):
        torch.testing.assert_close(compiled.lse, eager.lse)
        torch.testing.assert_close(compiled.max_logit, eager.max_logit)
    torch.testing.assert_close(_loss(compiled), _loss(eager))
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


def test_packed_qkv_and_thd_compile():
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(2, 10, 3, 4, 8, generator=gen, requires_grad=True)
    packed = lambda x: fat.attention(x, layout="bs3hd", mask="causal")  # noqa: E731
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(packed, fullgraph=True, backend="aot_eager")(qkv), packed(qkv))
    tokens = torch.randn(14, 4, 8, generator=gen, requires_grad=True)
    cu = torch.tensor([0, 5, 5, 14], dtype=torch.int32)
    thd = lambda x, cu: fat.attention(x, x, x, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,  # noqa: E731
                                      max_seqlen_q=9, max_seqlen_kv=9, mask="causal")
    compiled = torch.compile(thd, fullgraph=True, backend="aot_eager")(tokens, cu)
    torch.testing.assert_close(compiled, thd(tokens, cu))
    got = torch.autograd.grad(compiled.square().sum(), tokens)[0]
    want = torch.autograd.grad(thd(tokens, cu).square().sum(), tokens)[0]
    torch.testing.assert_close(got, want)


def test_thd_under_compile_without_max_seqlen_breaks_the_graph_quietly_with_its_reason(caplog):
    """fullgraph=True names the missing max lengths; fullgraph=False runs the call eagerly (it reads the
    offsets) behind one graph break, with no Dynamo warnings (sweep 15: Dynamo traced the eager path and
    logged its failed compile of the offsets' read-back as a backend compiler exception)."""
    import logging

    x = torch.randn(6, 2, 8, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    call = lambda x, cu: fat.attention(x, x, x, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)  # noqa: E731
    torch._dynamo.reset()
    with pytest.raises(Exception, match="without max_seqlen_q and max_seqlen_kv reads its offsets' values"):
        torch.compile(call, fullgraph=True, backend="aot_eager")(x, cu)
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING):
        got = torch.compile(call, backend="aot_eager")(x, cu)
    warned = [r.getMessage()[:200] for r in caplog.records if r.name.startswith("torch") and r.levelno >= 30]
    assert not warned, warned
    torch.testing.assert_close(got, call(x, cu), rtol=0, atol=0)


def test_dropout_with_a_seed_is_reproducible_under_compile():
    q, k, v = _inputs((2, 12, 4, 8), (2, 12, 4, 8), seed=5)
    step = lambda q, k, v: fat.attention(q, k, v, dropout_p=0.3, dropout_seed=11)  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))


def test_a_score_mod_call_runs_eagerly_inside_a_compiled_step(ran):
    """A score_mod call inside torch.compile runs eagerly (one graph break, the code around it compiled)
    and matches the uncompiled step forward and in every gradient; fullgraph=True says why it cannot."""
    from fusedattn import score_mods as sm

    q, k, v = _inputs((2, 12, 4, 8), (2, 12, 2, 8), seed=41)
    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    table = torch.randn(4, 2 * 12 - 1, generator=torch.Generator().manual_seed(4))

    def step(q, k, v, weight):
        mod = sm.compose(sm.softcap(2.0), sm.relative_position_bias(table))
        return fat.attention(q @ weight, k, v, mask="causal", score_mod=mod).square().sum()

    torch._dynamo.reset()
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v, weight)]
    loss = torch.compile(step, backend="aot_eager")(*leaves)
    loss.backward()
    want = step(q, k, v, weight)
    want.backward()
    torch.testing.assert_close(loss, want)
    for got, ref in zip(leaves, (q, k, v, weight)):
        torch.testing.assert_close(got.grad, ref.grad)
    assert any(cfg.score_mod_key is not None for _, _, cfg in ran), ran
    torch._dynamo.reset()
    with pytest.raises(Exception, match="with this score_mod runs eagerly inside a compiled model"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v, weight)


@pytest.mark.parametrize("options", [dict(mask="causal"), dict(mask="none", softmax_type="learnable")],
                         ids=["causal", "learnable-sink"])
def test_a_loss_through_the_lse_has_the_same_gradients_eager_and_compiled(options):
    # Under compile the LSE's gradient used to be dropped silently (the op marked it non-differentiable).
    q, k, v = _inputs((2, 9, 4, 8), (2, 9, 2, 8), seed=11)
    leaves, extra = [q, k, v], {}
    if options.get("softmax_type") == "learnable":
        extra["sink"] = torch.randn(4, requires_grad=True)
        leaves.append(extra["sink"])

    def loss(q, k, v, extra):
        result = fat.attention(q, k, v, return_lse=True, **options, **extra)
        return result.out.sum() + 10 * result.lse.sum()

    torch._dynamo.reset()
    eager = torch.autograd.grad(loss(q, k, v, extra), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, extra), leaves)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b)
    plain = torch.autograd.grad(fat.attention(q, k, v, **options, **extra).sum(), leaves)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(eager, plain))  # the LSE term did count


def test_a_backend_without_lse_gradient_never_drops_one_silently_under_compile(monkeypatch):
    # cuDNN has no gradient through the LSE: eager and compiled calls raise the same error when a nonzero
    # one reaches it, and give exact gradients when the LSE is returned but unused (a compiled graph
    # hands it a zero tangent) or used with weight zero.
    from fusedattn.backends import get_backend

    monkeypatch.setattr(type(get_backend("reference")), "lse_gradient", False)
    q, k, v = _inputs((2, 9, 4, 8), (2, 9, 2, 8), seed=12)

    def through_lse(q, k, v, weight=1.0):
        result = fat.attention(q, k, v, mask="causal", return_lse=True)
        return result.out.square().sum() + weight * result.lse.sum()

    def returned_unused(q, k, v):
        result = fat.attention(q, k, v, mask="causal", return_lse=True)
        return result.out.square().sum(), result.lse

    torch._dynamo.reset()
    message = "the reference backend has no gradient through the returned lse"
    with pytest.raises(NotImplementedError, match=message):
        torch.autograd.grad(through_lse(q, k, v), [q, k])
    with pytest.raises(NotImplementedError, match=message):
        torch.autograd.grad(torch.compile(through_lse, fullgraph=True, backend="aot_eager")(q, k, v), [q, k])
    want = torch.autograd.grad(fat.attention(q, k, v, mask="causal").square().sum(), [q, k])
    loss, _ = torch.compile(returned_unused, fullgraph=True, backend="aot_eager")(q, k, v)
    for got, expected in zip(torch.autograd.grad(loss, [q, k]), want):
        torch.testing.assert_close(got, expected)
    for got, expected in zip(torch.autograd.grad(through_lse(q, k, v, weight=0.0), [q, k]), want):
        torch.testing.assert_close(got, expected)


def test_touching_a_score_mods_reads_makes_a_compiled_graph_follow_a_new_number():
    """compiled_score_mods bakes a mod's numbers into the graph; `touch` reads what the mod reads in the
    traced code, so Dynamo guards on it: a new global cap, closure cell or ScoreMod number recompiles."""
    from fusedattn import score_mods as sm
    from fusedattn.torch import compiled_score_mods

    state = {"cap": 3.0}

    def flex(score, b, h, q_idx, kv_idx):
        return state["cap"] * torch.tanh(score / state["cap"])

    builtins = [sm.softcap(5.0)]  # a built-in's numbers are its own: a new number is a new built-in

    @torch._dynamo.assume_constant_result
    def baked(score_mod):  # stands in for compiled_score_mods.plan: reads the numbers once, at trace time
        return float(score_mod(torch.tensor(1e9), 0, 0, 0, 0))

    @torch._dynamo.assume_constant_result
    def baked_number(cap):  # the same for a ScoreMod's number, as plan gets it (compiled_score_mods.passed)
        return float(cap)

    def step(x, score_mod):
        compiled_score_mods.touch(score_mod, None, x)
        if isinstance(score_mod, sm.ScoreMod):
            return x * baked_number(compiled_score_mods.passed(score_mod)[2]["cap"])
        return x * baked(score_mod)

    x = torch.ones(2)
    for mod, change, want in ((lambda: flex, lambda: state.update(cap=7.0), 7.0),
                              (lambda: builtins[0], lambda: builtins.append(sm.softcap(11.0)) or builtins.pop(0),
                               11.0)):
        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="eager")
        first = compiled(x, mod())
        change()
        assert float(compiled(x, mod())[0]) == want != float(first[0])


def test_score_mods_of_other_kinds_stay_out_of_the_graph():
    from fusedattn import score_mods as sm
    from fusedattn.torch import compiled_score_mods

    assert compiled_score_mods.in_graph({"score_mod": lambda s, b, h, q, k: s})
    assert compiled_score_mods.in_graph({"mask_mod": lambda b, h, q, k: q >= k})
    assert compiled_score_mods.in_graph({"score_mod": sm.softcap(3.0)})
    assert compiled_score_mods.in_graph({"score_mod": sm.alibi([0.5, 0.25])})  # host slopes: numbers
    assert not compiled_score_mods.in_graph({"score_mod": sm.alibi(torch.rand(2))})  # a tensor: bound per call
    assert not compiled_score_mods.in_graph({"score_mod": lambda s, b, h, q, k: s, "score_mod_tensors": {}})


# ---------------------------------------------------------------- captured tensors as graph inputs

GLOBAL_SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])


def _alibi_over(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


def _global_alibi(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_SLOPES[h] * (kv_idx - q_idx)


def test_captured_tensors_are_found_in_the_callbacks_globals_and_closures():
    """A compiled call fetches each captured tensor from the global or closure cell the flex callback reads it
    from; one read through a container or held by a ScoreMod has no such place: the call breaks the graph."""
    from fusedattn.torch import compiled_score_mods as compiled

    slopes = torch.rand(4)
    alibi = _alibi_over(slopes)
    found = compiled._sources((alibi, None), {"c0": slopes})
    assert found == (("c0", (0, "cell", 0)),)
    assert compiled.fetch(alibi, None, found[0][1]) is slopes
    found = compiled._sources((None, _global_alibi), {"c0": GLOBAL_SLOPES})
    assert found == (("c0", (1, "global", "GLOBAL_SLOPES")),)
    assert compiled.fetch(None, _global_alibi, found[0][1]) is GLOBAL_SLOPES
    table = {"slopes": slopes}
    assert compiled._sources((lambda s, b, h, q, k: s + table["slopes"][h], None), {"c0": slopes}) is None
    assert compiled._sources(((None,), None), {"c0": slopes}) is None


@pytest.mark.parametrize("reach", ["argument", "closure of the compiled function", "module attribute"])
def test_a_closure_cells_tensor_is_a_graph_input_dynamo_guards(reach):
    """The traced code's fetch of a tensor from a callback's closure cell (the callback made outside the
    compiled code) is a graph input under fullgraph=True: in-place changes show in the next run, and a new
    callback over another tensor gives that tensor's values."""
    from fusedattn.torch import compiled_score_mods as compiled

    slopes = torch.rand(4)
    plain = _alibi_over(slopes)
    holder = torch.nn.Module()
    holder.alibi = plain
    source = compiled._sources((plain, None), {"c0": slopes})[0][1]

    def step(x, alibi):
        mod = {"argument": alibi, "closure of the compiled function": plain, "module attribute": holder.alibi}[reach]
        return x * compiled.fetch(mod, None, source)

    torch._dynamo.reset()
    run = torch.compile(step, backend="aot_eager", fullgraph=True)
    x = torch.ones(4)
    torch.testing.assert_close(run(x, plain), slopes)
    slopes.mul_(3)
    torch.testing.assert_close(run(x, plain), slopes)
    if reach == "argument":
        other = torch.rand(4)
        torch.testing.assert_close(run(x, _alibi_over(other)), other)


def _capped_alibi_over(slopes, cap):
    def capped_alibi(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap) + slopes[h] * (kv_idx - q_idx) * GLOBAL_SCALE
    return capped_alibi


GLOBAL_SCALE = 1.0


def _helper(score):
    return score * 2


@pytest.mark.parametrize("reach", ["closure", "global"])
def test_the_traced_part_of_a_compiled_call_touches_and_fetches_in_one_trace(reach):
    """compiled_score_mods.captured, the traced code of a compiled score_mod call, under fullgraph=True: the
    captured tensor is a graph input (in-place changes show), and a new number in the callback's closure
    cell or global recompiles. A callback over a captured cell is read, not run: Dynamo (torch 2.11) failed
    the trace that ran it and then fetched from its cell (found on an H200, where plan does not decline)."""
    global GLOBAL_SCALE
    import torch._dynamo.testing

    from fusedattn.torch import compiled_score_mods as compiled

    slopes = torch.rand(4)
    callback = _capped_alibi_over(slopes, 20.0) if reach == "closure" else _global_alibi
    tensor = slopes if reach == "closure" else GLOBAL_SLOPES
    sources = compiled._sources((callback, None), {"c0": tensor})
    reads = (compiled._reads_instead_of_call(callback, 0, sources), None)
    assert (reads[0] is None) == (reach == "global")
    sources = tuple(source for _, source in sources)

    def step(x):
        return x * compiled.captured(callback, None, x, sources, reads)[0]

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    run = torch.compile(step, backend=counter, fullgraph=True)
    x = torch.ones(4)
    torch.testing.assert_close(run(x), tensor)
    before = tensor.clone()
    tensor.mul_(3)
    try:
        torch.testing.assert_close(run(x), tensor)
        assert counter.frame_count == 1
        if reach == "closure":
            callback.__closure__[0].cell_contents = 5.0  # the cap
            run(x)
            assert counter.frame_count > 1, "a new number in the callback's cell must recompile"
            compiles = counter.frame_count
            GLOBAL_SCALE = 2.0
            run(x)
            assert counter.frame_count > compiles, "a new number in a global it reads must recompile"
    finally:
        tensor.copy_(before)
        GLOBAL_SCALE = 1.0


def test_a_callback_over_a_captured_cell_that_reads_a_helper_is_not_followed():
    """Reading a callback's cells instead of running it follows plain values only: one that also calls a
    helper, or holds a lambda of its own, is left to the eager call (plan declines it)."""
    from fusedattn.torch import compiled_score_mods as compiled

    slopes = torch.rand(4)

    def through_helper(score, b, h, q_idx, kv_idx):
        return _helper(score) + slopes[h]

    def with_lambda(score, b, h, q_idx, kv_idx):
        return (lambda s: s + slopes[h])(score)

    for callback in (through_helper, with_lambda):
        sources = compiled._sources((callback, None), {"c0": slopes})
        assert compiled._reads_instead_of_call(callback, 0, sources) is False, callback.__name__
    capped = _capped_alibi_over(slopes, 2.0)
    reads = compiled._reads_instead_of_call(capped, 0, compiled._sources((capped, None), {"c0": slopes}))
    assert set(reads) == {(0, "cell", 0), (0, "cell", 1), (0, "global", "GLOBAL_SCALE")}


def test_score_mod_aux_binds_the_tensors_of_each_run():
    """fusedattn::score_mod_aux makes the operator's aux tensors from the tensors a compiled graph passes it:
    other values give other aux tensors (never the traced ones), its outputs never alias its inputs, and its
    fake gives the shapes a run gives (torch.library.opcheck)."""
    from fusedattn.backends.cudnn.native import torch_plans
    from fusedattn.score_mods.core import as_score_mod, bind
    from fusedattn.torch import compiled_score_mods as compiled
    from fusedattn.torch import trace_time
    from fusedattn.torch.functional import _compiled_description

    traced = torch.rand(4)
    alibi = _alibi_over(traced)
    q = torch.randn(2, 16, 4, 8)
    _, options, described = _compiled_description(q, q, q, {"score_mod": alibi, "mask": "causal"})
    mod = as_score_mod(compiled.API, alibi, framework="torch", device=q.device)
    cfg, _, _, bound, _ = trace_time.configure(described, options, None, False, mod)
    aux, _ = torch_plans.operands(cfg).values(bound.values)
    key = compiled._remember_aux(mod, ("c0",), cfg, bound.key, aux)
    other = torch.rand(4) + 1
    got = torch.ops.fusedattn.score_mod_aux(key, [other])
    assert len(got) == len(aux) == 1
    torch.testing.assert_close(got[0].flatten(), other, rtol=0, atol=0)
    assert got[0].untyped_storage().data_ptr() != other.untyped_storage().data_ptr()
    eager = bind(compiled.API, mod, batch=2, heads_q=4, seqlen_q=16, seqlen_kv=16, device="cpu", training=False,
                 like=q)
    want = torch_plans.operands(cfg).values(eager.values)[0][0]  # (trace time binds shapes only)
    torch.testing.assert_close(torch.ops.fusedattn.score_mod_aux(key, [traced])[0], want, rtol=0, atol=0)
    torch.library.opcheck(torch.ops.fusedattn.score_mod_aux.default, (key, [other]))
    with pytest.raises(RuntimeError, match="no longer registered"):
        torch.ops.fusedattn.score_mod_aux("fusedattn::score_mod_aux:unknown", [other])


def test_a_built_ins_fields_are_constants_dynamo_hands_to_plan():
    """compiled_score_mods.passed gives plan a built-in's fields; its read-only tensors mapping goes as a
    dict (Dynamo: "MappingProxyVariable() is not a constant", seen on the GPU before this was mended)."""
    from fusedattn import score_mods as sm
    from fusedattn.torch import compiled_score_mods

    names = compiled_score_mods._FIELDS

    @torch._dynamo.assume_constant_result
    def plan(fields):
        return float(fields[names.index("tensors")]["cap"]) + len(fields[names.index("flex")])

    def step(x, mod):
        return x * plan(compiled_score_mods.passed(mod))

    torch._dynamo.reset()
    out = torch.compile(step, fullgraph=True, backend="eager")(torch.ones(2), sm.softcap(2.0))
    assert out.tolist() == [4.0, 4.0]


def test_a_compiled_padded_call_needs_no_max_lengths_and_a_thd_one_says_it_does():
    """A padded layout's longest sequences are its tensors' S: compiled, it no longer asks for max_seqlen_q/kv
    (it raised, wrapped in Dynamo's internal error); a THD call still must give them, and says so."""
    q = torch.randn(2, 8, 2, 8, requires_grad=True)

    def padded(q, cu):
        return fat.attention(q, q, q, mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    torch._dynamo.reset()
    compiled = torch.compile(padded, backend="aot_eager")
    for lengths in ([5, 8], [3, 6]):
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
        got, want = compiled(q, cu), padded(q, cu)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(torch.autograd.grad(got.sum(), q)[0], torch.autograd.grad(want.sum(), q)[0],
                                   rtol=1e-6, atol=1e-6)
    tokens = q.detach().reshape(16, 2, 8)
    cu = torch.tensor([0, 5, 13], dtype=torch.int32)

    def thd(t, cu):
        return fat.attention(t, t, t, layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)

    with pytest.raises(Exception, match=r"a THD call without max_seqlen_q and max_seqlen_kv"):
        torch.compile(thd, backend="aot_eager", fullgraph=True)(tokens, cu)
    # without fullgraph, the refusal is a graph break: the call runs eagerly, which reads the offsets
    torch.testing.assert_close(torch.compile(thd, backend="aot_eager")(tokens, cu), thd(tokens, cu), rtol=0, atol=0)


_FRESH_COMPILE = """
import torch, fusedattn.torch as fat
cu = torch.tensor([0, 1, 3], dtype=torch.int32)
cases = {"thd": (torch.randn(3, 2, 8), dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=2,
                                            max_seqlen_kv=2)),
         "padding": (torch.randn(2, 3, 2, 8), dict(mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu))}
q, options = cases[CASE]
compiled = torch.compile(lambda q: fat.attention(q, q, q, **options), backend="aot_eager", fullgraph=True)
out = compiled(q)
assert torch.equal(out, fat.attention(q, q, q, **options)), "compiled differs from eager"
print("ok")
"""


@pytest.mark.parametrize("case", ["thd", "padding"])
def test_the_first_call_of_a_fresh_process_compiles_with_fullgraph(case):
    """The sequence check's first call imported the ops module lazily (importlib), which Dynamo refuses:
    fullgraph=True failed until one eager call had run (sweep 9)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", f"CASE = {case!r}\n" + _FRESH_COMPILE], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


@pytest.mark.parametrize("options", [{"window": (2.0, 0)}, {"mask": "causal", "window": (2, 1)},
                                     {"bias": torch.zeros(1, 4, 5, 5, dtype=torch.float64)}],
                         ids=["window-type", "causal-right", "bias-dtype"])
@pytest.mark.parametrize("fullgraph", [False, True])
def test_an_argument_error_while_tracing_is_the_eager_error(options, fullgraph):
    """Raised inside the trace-time planner (an assume_constant_result function), it reached the user as
    InternalTorchDynamoError, no ValueError (sweep 9). Now the planner returns it and the traced code
    raises it: a ValueError, and under fullgraph=True Dynamo's error, which names it."""
    import torch._dynamo

    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    with pytest.raises(ValueError) as eager:
        fat.attention(q, k, k, **options)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k: fat.attention(q, k, k, **options), backend="eager", fullgraph=fullgraph)
    with pytest.raises(Exception) as traced:
        compiled(q, k)
    if fullgraph:
        assert str(eager.value) in str(traced.value), str(traced.value)[-800:]
    else:
        assert type(traced.value) is ValueError and str(traced.value) == str(eager.value)


def _closure_over_local_tensor(q, k, v):
    bias = torch.linspace(-0.5, 0.5, q.shape[2])  # made in the compiled code: a closure cell Dynamo cannot hand over
    return fat.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + bias[h])


def _closure_over_outer_tensor(table):
    def step(q, k, v):
        return fat.attention(q, k, v, mask="causal", score_mod=lambda s, b, h, q_idx, kv_idx: s + table[h])
    return step


def _compose_of_numbers(q, k, v):
    from fusedattn import score_mods as sm

    return fat.attention(q, k, v, score_mod=sm.compose(sm.softcap(1.5), sm.clamp(-1.0, 1.0), sm.causal()))


@pytest.mark.parametrize("make", [lambda: _closure_over_local_tensor,
                                  lambda: _closure_over_outer_tensor(torch.randn(4)),
                                  lambda: _closure_over_outer_tensor(torch.randn(4, requires_grad=True)),
                                  lambda: _compose_of_numbers],
                         ids=["local-tensor-closure", "outer-tensor-closure", "learnable-closure", "compose"])
def test_score_mods_dynamo_cannot_hand_to_plan_compile_and_match_eager(make):
    """Callbacks made in the compiled code over tensors, and compositions of built-ins, used to fail the whole
    compile (Dynamo's ClosureConversionError; "can't reconstruct arbitrary frozen dataclass instances"): they
    run (in the graph or eagerly beside it) and give the eager outputs and gradients."""
    step = make()
    q, k, v = _inputs((2, 7, 4, 8), (2, 9, 4, 8), seed=51)
    torch._dynamo.reset()
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    got = torch.compile(step, backend="aot_eager")(*leaves)
    got.square().sum().backward()
    want = step(q, k, v)
    want.square().sum().backward()
    torch.testing.assert_close(got, want)
    for leaf, ref in zip(leaves, (q, k, v)):
        torch.testing.assert_close(leaf.grad, ref.grad)


@pytest.mark.parametrize("form", ["built-in", "closure"])
def test_a_number_argument_that_changes_between_compiled_calls_is_followed(form):
    """A cap passed as an argument: its second value makes Dynamo trace it as a symbolic float, which used
    to fail inside softcap's name (an f-string format spec) or plan's arguments (a closure cell)."""
    from fusedattn import score_mods as sm

    def step(q, cap):
        mod = (sm.softcap(cap) if form == "built-in"
               else lambda s, b, h, q_idx, kv_idx: cap * torch.tanh(s / cap))
        return fat.attention(q, q, q, score_mod=mod)

    q, _, _ = _inputs((1, 5, 2, 8), (1, 5, 2, 8), seed=52)
    q = q.detach()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    for cap in (1.0, 2.0, 3.5):
        torch.testing.assert_close(compiled(q, cap), step(q, cap))


def test_alibi_over_a_list_made_in_compiled_code_reaches_plan_as_numbers(monkeypatch):
    """sm.alibi(list) inside a compiled function: its slopes are checked in plain Python (NumPy's checks
    were data-dependent branches Dynamo refused, failing fullgraph=True with its own error), so plan gets the
    numbers as constants, as for softcap's cap; a new list is a new trace. Without a GPU plan declines (no
    native operator), so fullgraph=True fails with our reason and fullgraph=False gives eager's result."""
    from fusedattn import score_mods as sm
    from fusedattn.torch import compiled_score_mods

    seen = []
    real_plan = compiled_score_mods._plan

    def spy(described, options, backend, grad_enabled, score_mod, mask_mod, device):
        seen.append(score_mod.tensors["slopes"])
        return real_plan(described, options, backend, grad_enabled, score_mod, mask_mod, device)

    monkeypatch.setattr(compiled_score_mods, "_plan", spy)
    slopes = [0.5, 0.25]

    def step(q):
        return fat.attention(q, q, q, score_mod=sm.alibi(list(slopes)))

    q, _, _ = _inputs((1, 5, 2, 8), (1, 5, 2, 8), seed=53)
    q = q.detach()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="runs eagerly inside a compiled model"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(q)
    assert seen and set(seen) == {(0.5, 0.25)}
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    torch.testing.assert_close(compiled(q), step(q))
    slopes[1] = 0.125
    torch.testing.assert_close(compiled(q), step(q))
    assert seen[-1] == (0.5, 0.125)


def _softcapped(score, b, h, q_idx, kv_idx):
    return 8.0 * torch.tanh(score / 8.0)


# (what changes between the compiled calls, the calls' (batch, seqlen, options) in order)
CHANGING = {
    "batch": [(2, 16, {}), (3, 16, {}), (5, 16, {})],
    "sequence length": [(2, 16, {}), (2, 24, {}), (2, 9, {})],
    "scale": [(2, 16, {"scale": 0.5}), (2, 16, {"scale": 0.25}), (2, 16, {"scale": 0.3})],
    "window": [(2, 16, {"window": (4, 0)}), (2, 16, {"window": (3, 0)}), (2, 16, {"window": (7, 0)})],
    "dropout_p": [(2, 16, {"dropout_p": p, "dropout_seed": 7}) for p in (0.1, 0.2, 0.3)],
    "score_mod and batch": [(b, 16, {"score_mod": _softcapped}) for b in (2, 3, 4)],
}


@pytest.mark.parametrize("dynamic", [None, True], ids=["default", "dynamic"])
@pytest.mark.parametrize("changing", list(CHANGING))
def test_compiled_calls_whose_sizes_and_numbers_change_match_eager(changing, dynamic):
    """A compiled model whose batch, lengths or number arguments change between calls (a last, smaller
    batch; a schedule) recompiles and gives eager's outputs and gradients; with dynamic=True too. Sizes
    and numbers that changed are symbolic while Dynamo traces: torch 2.11 failed every such call with
    "SymNodeVariable() is not a constant" in the trace-time planning (found by sweep 15)."""
    def step(q, k, v, options):
        return fat.attention(q, k, v, mask="causal", **options)

    run = torch.compile(step, backend="aot_eager", dynamic=dynamic)
    torch._dynamo.reset()
    for index, (batch, seqlen, options) in enumerate(CHANGING[changing]):
        q, k, v = _inputs((batch, seqlen, 2, 8), (batch, seqlen, 2, 8), seed=60 + index)
        got = run(q, k, v, options)
        got_grads = torch.autograd.grad(_loss(got), (q, k, v))
        want = step(q, k, v, options)
        want_grads = torch.autograd.grad(_loss(want), (q, k, v))
        torch.testing.assert_close(got, want, msg=f"{changing} call {index}")
        for got_grad, want_grad in zip(got_grads, want_grads):
            torch.testing.assert_close(got_grad, want_grad, msg=f"{changing} call {index}")


BAD_SETTINGS = {
    "mask": {"mask": "causl"},
    "layout": {"layout": "bshdd"},
    "softmax_type": {"softmax_type": "softer"},
    "bias_type": {"bias": torch.zeros(1, 2, 16, 16), "bias_type": "post"},
    "dropout_seed float": {"dropout_p": 0.1, "dropout_seed": 1.5},
    "dropout_seed float tensor": {"dropout_p": 0.1, "dropout_seed": torch.tensor(1.5)},
    "dropout_offset float": {"dropout_p": 0.1, "dropout_seed": 1, "dropout_offset": 0.5},
    "dropout_seed past int64": {"dropout_p": 0.1, "dropout_seed": 2**70},
    "unknown keyword": {"maks": "causal"},
    "window float": {"window": (2.5, 0)},
}


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("name", list(BAD_SETTINGS))
def test_a_compiled_call_refuses_bad_settings_with_eagers_error(name, fullgraph):
    """Bad settings raise eager's error, type and message, inside a compiled function; under fullgraph=True
    Dynamo's error carries our message. Before (sweep 15): a misspelt mask, layout or softmax_type gave
    Dynamo's internal error, a float dropout seed or offset was truncated silently, 2**70 a fake-tensor error,
    and an unknown keyword under fullgraph=True Dynamo's "Failed to trace builtin operator"."""
    settings = BAD_SETTINGS[name]
    q = torch.randn(2, 16, 2, 8)
    with pytest.raises((ValueError, TypeError)) as eager:
        fat.attention(q, q, q, **settings)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q: fat.attention(q, q, q, **settings), backend="aot_eager", fullgraph=fullgraph)
    with pytest.raises(Exception) as got:
        compiled(q)
    if fullgraph:
        assert str(eager.value) in str(got.value).replace("\\'", "'"), str(got.value)
    else:
        assert type(got.value) is type(eager.value) and str(got.value) == str(eager.value)


def test_a_score_mod_call_the_native_operator_cannot_run_says_so_under_fullgraph():
    """Without the native operator (a CPU tensor here) a compiled score_mod call breaks the graph with that
    reason, not the list of callback kinds that may not be in a graph (sweep 15: a CPU user read the
    latter); fullgraph=False gives eager's result."""
    q, k, v = (x.detach() for x in _inputs((1, 8, 2, 8), (1, 8, 2, 8), seed=71))

    def step(q, k, v):
        return fat.attention(q, k, v, score_mod=_softcapped)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="native cuDNN operator does not run this call here"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(q, k, v)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, backend="aot_eager")(q, k, v), step(q, k, v))


@pytest.mark.parametrize("offsets", ["thd", "thd padded offsets", "padding"])
def test_compiled_score_mod_calls_with_sequence_offsets_plan_the_operator_with_them(offsets, monkeypatch):
    """A compiled score_mod call with sequence offsets plans the native operator (its offsets are operands,
    read on the device as an eager call's): plan says how many it takes. Without a GPU the operator is
    missing, so the call breaks the graph for that reason and gives eager's result."""
    from fusedattn.torch import compiled_score_mods, functional

    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    if offsets == "padding":
        q = torch.randn(3, 7, 2, 16)
        given = dict(mask="padding", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    else:
        q = torch.randn(16, 2, 16)
        given = dict(layout="thd", mask="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=7,
                     max_seqlen_kv=7)
        if offsets == "thd padded offsets":
            padded = torch.tensor([0, 4, 8, 16], dtype=torch.int32)
            given.update(cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    given["score_mod"] = _softcapped
    _, options, described = functional._compiled_description(q, q, q, given)
    plan = (compiled_score_mods.plan.__wrapped__ if hasattr(compiled_score_mods.plan, "__wrapped__")
            else compiled_score_mods.plan)
    args = (described, tuple(options.items()), None, True, _softcapped, None, q.device)
    assert plan(*args)[0] == compiled_score_mods.NO_NATIVE_OPERATOR[0]  # (no native operator on a CPU)
    monkeypatch.setattr(functional, "_native_plan_on", lambda cfg, name, device: 7)
    planned = plan(*args)
    assert planned[0] == 7 and planned[-1] == (4 if offsets == "thd padded offsets" else 2)
    monkeypatch.undo()

    def step(q):
        return fat.attention(q, q, q, **given)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="native cuDNN operator does not run this call here"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(q)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, backend="aot_eager")(q), step(q), rtol=0, atol=0)
