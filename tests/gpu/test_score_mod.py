"""score_mod on the cuDNN backend: built-ins, user callbacks, masks composed after them,
THD, and graph-cache keys that never go stale. Compared with the float64 reference,
forward and every gradient."""

from __future__ import annotations

import gc

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn")

from gpu_checks import _lengths, _thd, assert_replay_matches, check_against_reference, make  # noqa: E402

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402
from fusedattn import score_mods as sm  # noqa: E402
from fusedattn.backends.cudnn.runtime import graph_cache  # noqa: E402

pytestmark = pytest.mark.gpu

H = 4


def _ids(b, s, seed):
    """Document ids (B, S): 3 contiguous documents of random lengths per row."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        cuts = sorted(torch.randint(1, s, (2,), generator=gen).tolist())
        rows.append(torch.tensor([sum(i >= c for c in cuts) for i in range(s)]))
    return torch.stack(rows).to(torch.int32).cuda()


def builtin(name):
    gen = torch.Generator(device="cuda").manual_seed(5)
    return {
        "softcap": lambda: sm.softcap(2.0),
        "clamp": lambda: sm.clamp(-1.0, 1.5),
        "causal": sm.causal,
        "sliding_window": lambda: sm.sliding_window(24, 0),
        "sliding_window_both": lambda: sm.sliding_window(9, 13),
        "alibi": lambda: sm.alibi(torch.rand(H, generator=gen, device="cuda")),
        "relative_position_bias": lambda: sm.relative_position_bias(
            torch.randn(H, 2 * 40 + 1, generator=gen, device="cuda").to(torch.bfloat16)),
        "additive_bias": lambda: sm.additive_bias(torch.randn(1, H, 128, 128, generator=gen, device="cuda")
                                                  .to(torch.bfloat16)),
        "document_mask": lambda: sm.document_mask(_ids(2, 128, 3)),
        "softcap_then_document_mask": lambda: sm.compose(sm.softcap(2.0), sm.document_mask(_ids(2, 128, 4))),
    }[name]()


BUILTINS = ["softcap", "clamp", "causal", "sliding_window", "sliding_window_both", "alibi",
            "relative_position_bias", "additive_bias", "document_mask", "softcap_then_document_mask"]


@pytest.mark.parametrize("mask", ["none", "causal"])
@pytest.mark.parametrize("name", BUILTINS)
def test_builtins(name, mask):
    q, k, v = make(2, 128, 128, H, 2, 64, 64, torch.bfloat16, seed=21)
    q = q * 3  # larger scores, so softcap and clamp bite
    check_against_reference((q, k, v), {"mask": mask, "score_mod": builtin(name)}, torch.bfloat16)


# ----------------------------------------------------------------------- user callbacks

def with_tensor(graph, score, tensors):
    """score + a (1, 1, Sq, Skv) bias + a per-head offset: two aux tensors, added terms."""
    return graph.add(a=graph.add(a=score, b=tensors["bias"]), b=tensors["factor"])


def with_scalar(graph, score, tensors):
    """score - shrink * |q_idx - kv_idx|: an added term (derivative 1), with a runtime scalar."""
    distance = graph.abs(input=graph.sub(a=sm.row_index(graph, score), b=sm.col_index(graph, score)))
    return graph.sub(a=score, b=graph.mul(a=distance, b=tensors["shrink"]))


def swish_like(graph, score, tensors):
    """score * sigmoid(score): nonlinear, so it needs its bprop."""
    tensors["input"] = score
    return graph.mul(a=score, b=graph.sigmoid(input=score))


def swish_like_bprop(graph, dscore, tensors):
    s = tensors["input"]
    sig = graph.sigmoid(input=s)
    # d/ds s*sig(s) = sig + s*sig*(1-sig)
    derivative = graph.add(a=sig, b=graph.sigmoid_backward(loss=s, input=s))
    return graph.mul(a=dscore, b=derivative)


def user_case(name):
    gen = torch.Generator(device="cuda").manual_seed(6)
    if name == "tensor":
        factor = (0.5 + torch.rand(1, H, 1, 1, generator=gen, device="cuda"))
        bias = torch.randn(1, 1, 128, 128, generator=gen, device="cuda").to(torch.bfloat16)
        return {"score_mod": with_tensor, "score_mod_tensors": {"factor": factor, "bias": bias}}
    if name == "scalar":
        return {"score_mod": with_scalar, "score_mod_tensors": {"shrink": 0.3}}
    return {"score_mod": swish_like, "score_mod_bprop": swish_like_bprop}


@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right"])
@pytest.mark.parametrize("name", ["tensor", "scalar", "bprop"])
def test_user_callbacks(name, mask):
    q, k, v = make(2, 128, 128, H, H, 64, 64, torch.bfloat16, seed=22)
    check_against_reference((q, k, v), {"mask": mask, **user_case(name)}, torch.bfloat16)


def test_a_missing_bprop_for_a_nonlinear_mod_is_declined_not_run_wrong():
    """Without its bprop, swish_like's gradients would be off (derivative 1): cuDNN declines to train it,
    naming the op, and the call runs on the reference (inference, which needs no derivative, runs)."""
    q, k, v = make(2, 128, 128, H, H, 64, 64, torch.bfloat16, seed=22)
    q.requires_grad_(True)
    text = fat.explain(q, k, v, score_mod=swish_like)
    assert "selected: reference" in text and "op 'sigmoid' of the score" in text, text
    with torch.no_grad():
        assert "selected: cudnn" in fat.explain(q, k, v, score_mod=swish_like)


# ----------------------------------------------------------------------- masks, THD, padding

@pytest.mark.parametrize("mask,window,sq,skv", [
    ("causal", (32, 0), 128, 128), ("none", (16, 16), 128, 128), ("causal_bottom_right", (-1, 0), 96, 160),
    ("causal_bottom_right", (-1, 0), 160, 96), ("none", (20, -1), 96, 160)])
def test_config_masks_compose_with_a_score_mod(mask, window, sq, skv):
    q, k, v = make(2, sq, skv, H, H, 64, 64, torch.bfloat16, seed=23)
    check_against_reference((q, k, v), {"mask": mask, "window": window, "score_mod": sm.softcap(2.0)},
                            torch.bfloat16)


@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_padding_masks_on_bshd(mask):
    q, k, v = make(3, 128, 128, H, 2, 64, 64, torch.bfloat16, seed=24)
    options = {"mask": mask, "cu_seqlens_q": _lengths([100, 37, 128]), "cu_seqlens_kv": _lengths([128, 64, 90]),
               "score_mod": sm.softcap(2.0)}
    check_against_reference((q, k, v), options, torch.bfloat16)


@pytest.mark.parametrize("mod", ["softcap", "tensor", "bprop", "alibi"])
@pytest.mark.parametrize("mask", ["padding", "padding_causal"])
def test_thd(mod, mask):
    lens_q, lens_kv = [100, 37, 128, 5], [128, 64, 90, 7]
    tensors = _thd("thd", lens_q, lens_kv, H, 2, 64, seed=25)
    options = {"layout": "thd", "mask": mask, "cu_seqlens_q": _lengths(lens_q), "cu_seqlens_kv": _lengths(lens_kv)}
    if mod == "tensor":  # per-head aux only: positions differ per sequence
        options.update(score_mod=with_tensor, score_mod_tensors={
            "factor": torch.rand(1, H, 1, 1, device="cuda") + 0.5, "bias": torch.ones(1, 1, 1, 1, device="cuda")})
    elif mod == "bprop":
        options.update(score_mod=swish_like, score_mod_bprop=swish_like_bprop)
    else:
        options["score_mod"] = builtin(mod)
    check_against_reference(tensors, options, torch.bfloat16)


def test_a_per_sequence_bottom_right_diagonal_is_declined_with_a_reason():
    lens_q, lens_kv = [100, 37], [128, 64]
    tensors = _thd("thd", lens_q, lens_kv, H, 2, 64, seed=28)
    options = {"layout": "thd", "mask": "padding_causal_bottom_right", "cu_seqlens_q": _lengths(lens_q),
               "cu_seqlens_kv": _lengths(lens_kv), "score_mod": sm.softcap(2.0)}
    with pytest.raises(fusedattn.NoBackendError, match="moves with each sequence"):
        fat.attention(*tensors, backend="cudnn", **options)
    fat.attention(*tensors, **options)  # the reference runs it


def test_thd_with_gaps_and_an_empty_sequence():
    lens = [60, 0, 128]
    tensors = _thd("thd", lens, lens, H, H, 64, seed=26, gaps=8)
    starts = torch.tensor([0, 68, 76, 212], dtype=torch.int32, device="cuda")
    options = {"layout": "thd", "mask": "padding_causal", "cu_seqlens_q": _lengths(lens),
               "cu_seqlens_kv": _lengths(lens), "cu_seqlens_q_padded": starts, "cu_seqlens_kv_padded": starts,
               "score_mod": sm.softcap(2.0)}
    check_against_reference(tensors, options, torch.bfloat16)


def hide_first_rows(graph, score, tensors):
    """Masks every key of the first `rows` queries: those rows see nothing."""
    keep = sm.compare(graph, "ge", sm.row_index(graph, score), tensors["rows"])
    return sm.keep_where(graph, score, keep, tensors["masked"])


def test_rows_a_score_mod_empties_give_zero_and_clean_gradients():
    q, k, v = make(2, 128, 128, H, H, 64, 64, torch.bfloat16, seed=27)
    options = {"score_mod": hide_first_rows, "score_mod_tensors": {"rows": 5, "masked": sm.MASKED}}
    check_against_reference((q, k, v), options, torch.bfloat16)
    result = fat.attention(q, k, v, backend="cudnn", return_lse=True, **options)
    assert (result.out[:, :5] == 0).all() and (result.lse[:, :, :5] == float("-inf")).all()


# ----------------------------------------------------------------------- cache keys

def _count_builds(fn):
    before = graph_cache().builds
    fn()
    return graph_cache().builds - before


def _matches_reference(q, k, v, **options):
    got = fat.attention(q, k, v, backend="cudnn", **options)
    want = fat.attention(q.double(), k.double(), v.double(), backend="reference", **options)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_the_same_callback_again_does_not_rebuild():
    q, k, v = make(1, 96, 96, H, H, 64, 64, torch.bfloat16, seed=30)
    fat.attention(q, k, v, backend="cudnn", score_mod=with_scalar, score_mod_tensors={"shrink": 0.1})
    assert _count_builds(lambda: fat.attention(q, k, v, backend="cudnn", score_mod=with_scalar,
                                               score_mod_tensors={"shrink": 0.1})) == 0


def test_changing_a_scalar_value_does_not_rebuild_and_is_used():
    q, k, v = make(1, 96, 96, H, H, 64, 64, torch.bfloat16, seed=31)
    _matches_reference(q, k, v, score_mod=sm.softcap(1.0))
    for cap in (0.5, 3.0, 7.0):
        assert _count_builds(lambda cap=cap: _matches_reference(q, k, v, score_mod=sm.softcap(cap))) == 0
    for shrink in (0.2, 0.7):
        _matches_reference(q, k, v, score_mod=with_scalar, score_mod_tensors={"shrink": shrink})


TANH = lambda graph, score, tensors: graph.tanh(input=score)  # noqa: E731
SIN = lambda graph, score, tensors: graph.sin(input=score)  # noqa: E731


def test_two_lambdas_get_their_own_graphs():
    q, k, v = make(1, 96, 96, H, H, 64, 64, torch.bfloat16, seed=32)
    _matches_reference(q, k, v, score_mod=TANH)
    assert _count_builds(lambda: _matches_reference(q, k, v, score_mod=SIN)) == 1  # forward only: no grad


def baked(constant):
    def mod(graph, score, tensors):  # the constant is baked into the graph
        return graph.mul(a=score, b=graph.tensor_scalar(constant, cudnn.scalar_type.RUNTIME_PARAM))

    return mod


def test_closures_over_different_constants_get_their_own_graphs():
    q, k, v = make(1, 96, 96, H, H, 64, 64, torch.bfloat16, seed=33)
    _matches_reference(q, k, v, score_mod=baked(0.5))
    assert _count_builds(lambda: _matches_reference(q, k, v, score_mod=baked(2.0))) == 1
    assert _count_builds(lambda: _matches_reference(q, k, v, score_mod=baked(0.5))) == 0


class OneOp:
    def __init__(self, op):
        self.op = op

    def __call__(self, graph, score, tensors):
        return getattr(graph, self.op)(input=score)


def test_a_new_instance_at_a_freed_address_gets_its_own_graph():
    q, k, v = make(1, 96, 96, H, H, 64, 64, torch.bfloat16, seed=34)
    for op in ("tanh", "sin", "tanh", "cos"):
        instance = OneOp(op)
        _matches_reference(q, k, v, score_mod=instance)
        del instance
        gc.collect()


def test_aux_shape_change_gets_its_own_graph():
    q, k, v = make(1, 96, 96, H, H, 64, 64, torch.bfloat16, seed=35)
    per_head = {"factor": torch.rand(1, H, 1, 1, device="cuda"), "bias": torch.zeros(1, 1, 1, 1, device="cuda")}
    full = {"factor": torch.rand(1, H, 96, 96, device="cuda"), "bias": torch.zeros(1, 1, 1, 1, device="cuda")}
    _matches_reference(q, k, v, score_mod=with_tensor, score_mod_tensors=per_head)
    assert _count_builds(lambda: _matches_reference(q, k, v, score_mod=with_tensor, score_mod_tensors=full)) == 1


# ----------------------------------------------------------------------- errors and reasons

def test_aux_tensor_requiring_grad_is_refused_by_cudnn_clearly():
    """(Auto-selection runs it on the reference, which gives the tensor its gradient, with the fallback's
    warning: tests/test_learning_score_mods.py.)"""
    q, k, v = (x.requires_grad_() for x in make(1, 64, 64, H, H, 64, 64, torch.bfloat16, seed=36))
    table = torch.rand(1, H, 1, 1, device="cuda", requires_grad=True)
    with pytest.raises(ValueError, match="score_mod tensors that require grad .* get no gradient on cudnn"):
        fat.attention(q, k, v, score_mod=with_tensor, score_mod_tensors={"factor": table, "bias": 0.0},
                      backend="cudnn")


def test_aux_tensor_on_another_device_is_rejected_clearly():
    q, k, v = make(1, 64, 64, H, H, 64, 64, torch.bfloat16, seed=37)
    with pytest.raises(ValueError, match=r"score_mod_tensors\['factor'\]: expected a tensor on cuda:0"):
        fat.attention(q, k, v, score_mod=with_tensor,
                      score_mod_tensors={"factor": torch.rand(1, H, 1, 1), "bias": 0.0})


def test_eager_only_mods_fall_back_with_a_reason():
    q, k, v = make(1, 64, 64, H, H, 64, 64, torch.bfloat16, seed=38)
    mod = sm.eager(lambda s, b, h, qi, ki: s * 0.5)
    with pytest.raises(fusedattn.NoBackendError, match="eager-only score_mod"):
        fat.attention(q, k, v, score_mod=mod, backend="cudnn")


def test_model_step_with_a_score_mod_runs_under_cuda_graph_capture():
    def setup():
        leaves = [x.detach().clone().requires_grad_() for x in make(2, 128, 128, H, H, 64, 64, torch.bfloat16,
                                                                     seed=39)]
        mod = sm.softcap(2.0)

        def step():
            out = fat.attention(*leaves, mask="causal", score_mod=mod, backend="cudnn")
            return torch.autograd.grad(out.float().square().sum(), leaves)

        return step

    assert_replay_matches(setup)


def test_a_compiled_model_step_runs_the_score_mod_on_cudnn(ran):
    """torch.compile (inductor) of a step with a projection, a score_mod call and a loss: the
    attention runs eagerly on cuDNN inside the compiled step (one graph break), and the output
    and every gradient match the uncompiled step on the float64 reference."""
    q, k, v = make(2, 128, 128, H, 2, 64, 64, torch.bfloat16, seed=31)
    weight = (torch.randn(64, 64, device="cuda") / 8).to(torch.bfloat16)
    table = torch.randn(H, 2 * 128 - 1, device="cuda").to(torch.bfloat16)

    def step(q, k, v, weight, backend):
        mod = sm.compose(sm.softcap(3.0), sm.relative_position_bias(table))
        out = fat.attention(q @ weight, k, v, mask="causal", score_mod=mod, backend=backend)
        return (out.float() * torch.linspace(-1, 1, 64, device="cuda")).square().sum()

    leaves = [x.detach().clone().requires_grad_(True) for x in (q * 3, k, v, weight)]
    torch._dynamo.reset()
    loss = torch.compile(step)(*leaves, "cudnn")
    loss.backward()
    phases = {(name, phase) for name, phase, cfg in ran if cfg.score_mod_key is not None}
    assert phases == {("cudnn", "forward"), ("cudnn", "backward")}, ran
    wide = [x.detach().double().requires_grad_(True) for x in leaves]
    want = step(*wide, "reference")
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach().double(), rtol=2e-2, atol=0)
    for name, got, ref in zip(("q", "k", "v", "weight"), leaves, wide):
        scale = ref.grad.abs().max()
        torch.testing.assert_close(got.grad.double() / scale, ref.grad / scale, atol=3e-2, rtol=0, msg=name)
