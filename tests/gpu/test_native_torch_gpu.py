"""The native torch operator on a GPU: one path for eager and compiled calls.

Eager warm calls and compiled graphs (aot_eager and inductor) run torch.ops.fusedattn_native.attention
and give the same bits; a gradient reaching the LSE gets the same refusal in both; warm calls never
wait for the device (sync debug mode "error"); a model step with the operator is captured in a CUDA
graph and replays eager's bits; a plan evicted from the bounded registries is registered again.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cudnn")

import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn.native import core, torch_plans  # noqa: E402

pytestmark = pytest.mark.gpu

NATIVE_OP = "fusedattn_native.attention.default"


@pytest.fixture(autouse=True)
def _native_available():
    assert torch_plans.unavailable() is None, torch_plans.unavailable()  # a GPU machine must build it


def _inputs(b=2, s=256, hq=8, hkv=2, d=64, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h: torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype).requires_grad_()  # noqa: E731
    return make(hq), make(hkv), make(hkv)


def _ran_native(out: torch.Tensor) -> bool:
    return out.grad_fn is not None and out.grad_fn.name() == "FusedAttentionBackward"


def _loss(q, k, v, **options):
    out = fat.attention(q, k, v, mask="causal", deterministic=True, **options)
    return out.float().square().sum()


@pytest.mark.parametrize("options", [{}, {"softmax_type": "off_by_one"}, {"window": (64, 0)}],
                         ids=["plain", "off_by_one", "window"])
def test_compiled_calls_run_the_native_operator_with_eagers_bits(options):
    q, k, v = _inputs(seed=1)
    warm = fat.attention(q, k, v, mask="causal", deterministic=True, **options)
    assert _ran_native(warm), warm.grad_fn
    eager = torch.autograd.grad(_loss(q, k, v, **options), (q, k, v))
    targets: set[str] = set()

    def recording(gm, example_inputs):
        targets.update(str(node.target) for node in gm.graph.nodes)
        return gm

    torch._dynamo.reset()
    torch.compile(lambda *x: _loss(*x, **options), fullgraph=True, backend=recording)(q, k, v)
    assert NATIVE_OP in targets and "fusedattn.attention_fwd.default" not in targets, targets
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled = torch.compile(lambda *x: _loss(*x, **options), fullgraph=True, backend=backend)
        grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        for name, got, want in zip("qkv", grads, eager):
            assert torch.equal(got, want), f"{backend}: d{name} differs from eager"


def test_a_gradient_through_the_lse_gets_one_answer_eager_and_compiled():
    q, k, v = _inputs(seed=2)

    def through_lse(q, k, v, weight):
        result = fat.attention(q, k, v, mask="causal", return_lse=True)
        return result.out.float().square().sum() + weight * result.lse.sum()

    def returned_unused(q, k, v):
        result = fat.attention(q, k, v, mask="causal", return_lse=True)
        return result.out.float().square().sum(), result.lse

    message = "the cudnn backend has no gradient through the returned lse"
    torch._dynamo.reset()
    compiled = torch.compile(through_lse, fullgraph=True)
    for run in (through_lse, compiled):
        with pytest.raises(NotImplementedError, match=message):
            torch.autograd.grad(run(q, k, v, 1.0), (q, k, v))
    want = torch.autograd.grad(fat.attention(q, k, v, mask="causal").float().square().sum(), (q, k, v))
    loss, _ = torch.compile(returned_unused, fullgraph=True)(q, k, v)
    for got, expected in zip(torch.autograd.grad(loss, (q, k, v)), want):
        torch.testing.assert_close(got, expected)
    for got, expected in zip(torch.autograd.grad(through_lse(q, k, v, 0.0), (q, k, v)), want):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("options", [
    {"mask": "causal"},
    {"mask": "none", "softmax_type": "learnable"},
    {"mask": "causal", "dropout_p": 0.1, "dropout_seed": 5},
    {"mask": "causal", "layout": "bs3hd"},
], ids=["causal", "learnable-sink", "dropout", "packed"])
def test_warm_calls_never_wait_for_the_device(options):
    options = dict(options)
    if options.get("layout") == "bs3hd":
        q = torch.randn(2, 256, 3, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        args = (q,)
    else:
        args = _inputs(seed=3)
    if options.get("softmax_type") == "learnable":
        options["sink"] = torch.randn(8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    leaves = [x for x in (*args, options.get("sink")) if x is not None]
    _warm_calls_never_wait(args, options, leaves)


def _never_waiting(calls, repeats: int = 3) -> None:
    """calls() `repeats` times with every host-device synchronisation an error."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(repeats):
            calls()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _warm_calls_never_wait(args, options: dict, leaves) -> None:
    """A training call with its backward and an inference call, twice cold (validation, selection, graph
    builds and plan registration may read the host), on the operator, then warm under _never_waiting."""
    def calls():
        out = fat.attention(*args, **options)
        torch.autograd.grad(out.float().square().sum(), leaves)
        with torch.no_grad():
            fat.attention(*args, **options)
        return out

    for _ in range(2):
        out = calls()
    assert _ran_native(out), out.grad_fn
    _never_waiting(calls)


class _Block(torch.nn.Module):
    def __init__(self, width=256, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width, device="cuda", dtype=torch.bfloat16)
        self.out = torch.nn.Linear(width, width, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):
        b, s, width = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, width // self.heads).unbind(2)
        return self.out(fat.attention(q, k, v, mask="causal", deterministic=True).reshape(b, s, width))


def test_a_model_step_is_captured_in_a_cuda_graph_and_replays_eagers_bits():
    torch.manual_seed(0)
    block = _Block()
    static_x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step(x):
        loss = block(x).float().square().mean()
        return (loss, *torch.autograd.grad(loss, (x, block.qkv.weight, block.out.weight)))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_outputs = step(static_x)
    for seed in (1, 2):
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16,
                        generator=torch.Generator(device="cuda").manual_seed(seed))
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        eager = step(x.clone().requires_grad_())
        for name, got, want in zip(("loss", "dx", "dqkv_weight", "dout_weight"), static_outputs, eager):
            assert torch.equal(got, want), f"replay {seed}: {name} differs from the eager step"


def _reaches_native(out: torch.Tensor) -> bool:
    """Whether the operator's autograd node is in out's graph (a call padded by torch ops after it)."""
    seen, nodes = set(), [out.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        if node.name() == "FusedAttentionBackward":
            return True
        seen.add(id(node))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return False


@pytest.mark.parametrize("layout, softmax", [("bshd", "vanilla"), ("sbhd", "vanilla"), ("bhsd", "vanilla"),
                                             ("bshd", "learnable"), ("bshd", "off_by_one")])
def test_bottom_right_with_more_queries_than_keys_runs_on_the_operator(layout, softmax):
    """The rows that see keys run as the operator's call (rows_with_keys.py), the others are padded (output
    0, the LSE of the sink term alone): out, LSE and every gradient (a learning bias's and sink's too)
    against the float64 reference, a warm call repeating the cold call's bits and never waiting."""
    from gpu_checks import _pack, assert_close_to_exact, make, run

    q, k, v = make(2, 160, 96, 4, 2, 64, 64, torch.bfloat16, seed=21)
    tensors, _ = _pack(layout, q, k, v)
    bias = torch.randn(1, 4, 160, 96, device="cuda").to(torch.bfloat16)
    options = {"layout": layout, "mask": "causal_bottom_right", "bias": bias, "deterministic": True,
               "softmax_type": softmax}
    if softmax == "learnable":
        options["sink"] = torch.randn(4, device="cuda")
    first, first_grads = run("cudnn", tensors, options)
    assert _reaches_native(first.out), first.out.grad_fn
    again, again_grads = run("cudnn", tensors, options)
    assert torch.equal(first.out, again.out)
    repeats = len(first_grads) - (softmax == "learnable")  # (dSink is a sum cuDNN may add in any order)
    assert all(torch.equal(a, b) for a, b in zip(first_grads[:repeats], again_grads[:repeats]))
    same, same_grads = run("reference", tensors, options)
    wide = {key: value.double() if isinstance(value, torch.Tensor) else value for key, value in options.items()}
    exact, exact_grads = run("reference", [t.double() for t in tensors], wide)
    assert_close_to_exact("out", first.out, same.out, exact.out)
    finite = torch.isfinite(exact.lse)
    assert torch.isneginf(first.lse[~finite]).all()
    torch.testing.assert_close(first.lse[finite], exact.lse[finite].float(), atol=2e-2, rtol=2e-3)
    if softmax != "vanilla":  # the rows without keys: the sink term alone
        expected = options["sink"] if softmax == "learnable" else torch.zeros(4, device="cuda")
        torch.testing.assert_close(first.lse[:, :, :64], expected.view(1, -1, 1).expand(2, -1, 64))
    for i, (got, s, e) in enumerate(zip(first_grads, same_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", got, s, e, reduction=i >= 3)
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    _never_waiting(lambda: torch.autograd.grad(
        fat.attention(*leaves, backend="cudnn", **options).float().sum(), leaves))


def test_evicted_plans_are_registered_again():
    """With room for two plans in the core and the operator, four configurations in turn keep their bits."""
    q, k, v = _inputs(seed=4)
    variants = [dict(mask="causal"), dict(mask="none"), dict(window=(32, 0)), dict(mask="causal_bottom_right")]
    first = []
    for options in variants:
        out = fat.attention(q, k, v, deterministic=True, **options)
        first.append((out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v))))
    operator = torch_plans._state["library"]
    try:
        core.bounds(2)
        operator.fusedattn_torch_bounds(2)
        for _ in range(2):
            for options, expected in zip(variants, first):
                out = fat.attention(q, k, v, deterministic=True, **options)
                got = (out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v)))
                assert all(torch.equal(a, b) for a, b in zip(got, expected)), options
        assert core.bounds() <= 2 and operator.fusedattn_torch_bounds(0) <= 2
    finally:
        core.bounds(core.PLAN_CAPACITY)
        operator.fusedattn_torch_bounds(torch_plans.PLAN_CAPACITY)


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_head_slices_of_one_projection_run_in_place_and_match_float64(layout):
    """GQA q, k, v sliced by heads out of one fused projection run on the operator where they lie (the
    config keeps their strides; the forward allocates no more than with contiguous inputs), and the
    output and the projection's gradient match the float64 reference under the error rule."""
    from gpu_checks import assert_close_to_exact

    B, S, Hq, Hkv, D = 2, 320, 8, 2, 64
    axes = layout.upper()
    shape = [{"B": B, "S": S, "H": Hq + 2 * Hkv, "D": D}[a] for a in axes]
    gen = torch.Generator(device="cuda").manual_seed(11)
    base = torch.randn(shape, generator=gen, device="cuda")
    grad = torch.randn([{"B": B, "S": S, "H": Hq, "D": D}[a] for a in axes], generator=gen, device="cuda")

    def run(dtype, backend=None):
        projection = base.to(dtype).requires_grad_()
        q, k, v = projection.split([Hq, Hkv, Hkv], dim=axes.index("H"))
        out = fat.attention(q, k, v, layout=layout, mask="causal", backend=backend)
        out.to(grad.dtype).backward(grad)
        return out, projection.grad

    out, grad_projection = run(torch.bfloat16)
    assert _ran_native(out)
    same, same_grad = run(torch.bfloat16, "reference")  # the reference's own error in bf16 sets the bar
    exact, exact_grad = run(torch.float64, "reference")
    assert_close_to_exact("out", out, same, exact)
    assert_close_to_exact("grad of the projection", grad_projection, same_grad, exact_grad)

    def forward_bytes(tensors):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.no_grad():
            result = fat.attention(*tensors, layout=layout, mask="causal")
        torch.cuda.synchronize()
        del result
        return torch.cuda.max_memory_allocated() - before

    views = base.to(torch.bfloat16).split([Hq, Hkv, Hkv], dim=axes.index("H"))
    copies = [x.contiguous() for x in views]
    for tensors in (views, copies, views, copies):  # warm: plans registered, graphs built
        forward_bytes(tensors)
    assert forward_bytes(views) <= forward_bytes(copies), "the views were copied before the launch"


# ---------------------------------------------------------------- score_mods and biases on the operator

CAP = 30.0  # read by _softcap at each call: rebinding follows a new value


def _softcap(score, b, h, q_idx, kv_idx):
    from fusedattn import score_mods as sm

    return CAP * sm.tanh(score / CAP)


def _operand_options(name: str, heads: int = 8, seqlen: int = 256, batch: int = 2) -> dict:
    """Calls whose operands go beyond q, k, v: flex and built-in score_mods (aux tensors, scalars, the
    window's constants), biases of every kind, and both together."""
    from fusedattn import score_mods as sm

    gen = torch.Generator(device="cuda").manual_seed(21)
    slopes = torch.rand(heads, generator=gen, device="cuda") / 8
    bias = lambda *shape: torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    return {
        "softcap_flex": dict(score_mod=_softcap, mask="causal"),
        "softcap_builtin": dict(score_mod=sm.softcap(30.0)),
        "alibi_flex": dict(score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx), mask="causal"),
        "softcap_window": dict(score_mod=_softcap, window=(48, 0)),
        "bias": dict(bias=bias(1, heads, seqlen, seqlen), mask="causal"),
        "bias_per_key_pre_scale": dict(bias=bias(batch, 1, 1, seqlen), bias_type="pre_scale"),
        "bias_and_alibi": dict(bias=bias(heads, seqlen, seqlen), mask="causal",
                               score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx)),
        "bias_and_softcap": dict(bias=bias(heads, seqlen, seqlen), score_mod=_softcap),
    }[name]


# bias_and_softcap is not here: its bias learns in these checks, which cuDNN declines (see below)
OPERAND_CASES = ["softcap_flex", "softcap_builtin", "alibi_flex", "softcap_window", "bias", "bias_per_key_pre_scale",
                 "bias_and_alibi"]


@pytest.mark.parametrize("name", OPERAND_CASES)
def test_score_mod_and_bias_calls_run_on_the_operator_and_match_float64(name):
    """Cold and warm calls both run the operator; out, LSE and every gradient (the bias's too) agree
    with the float64 reference under the error rule, and a warm call repeats the cold call's bits."""
    from gpu_checks import assert_close_to_exact, run

    tensors = _inputs(seed=5)
    options = {**_operand_options(name), "deterministic": True}
    first, first_grads = run("cudnn", tensors, options)
    assert _ran_native(first.out), first.out.grad_fn
    again, again_grads = run("cudnn", tensors, options)
    assert _ran_native(again.out)
    assert torch.equal(first.out, again.out) and all(torch.equal(a, b) for a, b in zip(first_grads, again_grads))
    same, same_grads = run("reference", tensors, options)
    wide = {key: value.double() if isinstance(value, torch.Tensor) else value for key, value in options.items()}
    exact, exact_grads = run("reference", [t.double() for t in tensors], wide)
    assert_close_to_exact("out", first.out, same.out, exact.out)
    torch.testing.assert_close(first.lse, exact.lse.float(), atol=2e-2, rtol=2e-3)
    assert len(first_grads) == len(exact_grads) == 3 + ("bias" in options)
    for i, (got, s, e) in enumerate(zip(first_grads, same_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", got, s, e, reduction=i >= 3)


def test_warm_score_mod_calls_follow_a_new_number_and_an_in_place_change():
    """A repeat call keeps its bound operands only while the callback reads the same objects and its
    tensors keep their version: a new global number and an in-place update of a captured tensor both
    reach the kernel."""
    global CAP
    q, k, v = _inputs(seed=6)
    slopes = torch.rand(8, device="cuda")

    def alibi(score, b, h, q_idx, kv_idx):
        return _softcap(score, b, h, q_idx, kv_idx) + slopes[h] * (kv_idx - q_idx) / 64

    def both(**options):
        with torch.no_grad():
            got = fat.attention(q, k, v, score_mod=alibi, mask="causal", **options)
            want = fat.attention(q, k, v, score_mod=alibi, mask="causal", backend="reference", **options)
        return got, want

    before = CAP
    try:
        for change in (None, "cap", "slopes"):
            if change == "cap":
                CAP = 5.0
            elif change == "slopes":
                slopes.mul_(4)
            got, want = both()
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2, msg=f"after {change}")
    finally:
        CAP = before


def test_rows_a_score_mod_masks_whole_get_zero_output_and_no_gradient():
    """A mask_mod that stays in the graph (a select) leaves odd query rows without keys: the operator gives
    them output 0 and LSE -inf, and finite gradients equal to the reference's."""
    from gpu_checks import assert_close_to_exact, run

    def even_rows(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) & (kv_idx <= q_idx)

    tensors = _inputs(seed=7)
    options = dict(score_mod=_softcap, mask_mod=even_rows)
    fused, fused_grads = run("cudnn", tensors, options)
    assert _ran_native(fused.out)
    assert torch.equal(fused.out[:, 1::2], torch.zeros_like(fused.out[:, 1::2]))
    assert torch.isinf(fused.lse[:, :, 1::2]).all() and torch.isfinite(fused.lse[:, :, ::2]).all()
    same, same_grads = run("reference", tensors, options)
    exact, exact_grads = run("reference", [t.double() for t in tensors], options)
    for i, (got, s, e) in enumerate(zip(fused_grads, same_grads, exact_grads)):
        assert torch.isfinite(got).all()
        assert_close_to_exact(f"grad {i}", got, s, e)


@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_rows_without_keys_in_other_layouts_and_without_grad(layout):
    """The empty-rows kernel (backends/cudnn/empty_rows_kernel.py) writes the output through the layout's
    strides; an inference call turns cuDNN's LSE into the returned one in place."""
    from fusedattn import score_mods as sm

    def every_third_row(score, b, h, q_idx, kv_idx):
        return sm.where((q_idx % 3 != 1) & (kv_idx <= q_idx), score, -float("inf"))

    gen = torch.Generator(device="cuda").manual_seed(17)
    shape = {"bhsd": (2, 8, 200, 64), "sbhd": (200, 2, 8, 64)}[layout]
    q, k, v = (torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    empty = (slice(None), slice(None), slice(1, None, 3))  # (B, H, S) rows of the LSE
    with torch.no_grad():
        got = fat.attention(q, k, v, layout=layout, score_mod=every_third_row, return_lse=True)
        want = fat.attention(q.double(), k.double(), v.double(), layout=layout, score_mod=every_third_row,
                             return_lse=True, backend="reference")
    assert torch.isinf(got.lse[empty]).all() and (got.lse[empty] < 0).all()
    torch.testing.assert_close(got.lse, want.lse.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.out.double(), want.out, atol=2e-2, rtol=2e-2)


def test_rows_without_keys_are_cleared_by_one_kernel_not_torch_ops():
    """A masking score_mod's warm call launches the cuDNN graph and the empty-rows kernel, and none of the
    torch ops (masked_fill) the operator falls back to without the kernel."""
    from torch.profiler import ProfilerActivity, profile

    from fusedattn import score_mods as sm

    def causal_select(score, b, h, q_idx, kv_idx):  # a select in the graph (sm.causal() is mask="causal")
        return sm.where(kv_idx <= q_idx, score, -float("inf"))

    q, k, v = _inputs(seed=12)
    for _ in range(3):
        out = fat.attention(q, k, v, score_mod=causal_select)
    assert _ran_native(out)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fat.attention(q, k, v, score_mod=causal_select)
        torch.cuda.synchronize()
    names = [event.key for event in prof.key_averages()]
    assert any("clear_empty_rows" in name for name in names), names
    assert not any("masked_fill" in name for name in names), names


def test_a_learning_bias_with_a_nonlinear_score_mod_is_declined_by_cudnn_not_run_wrong():
    """cuDNN 9.19 returned dBias multiplied by the softcap's derivative (an error of 4.9 against the float64
    reference, measured): such calls go to the reference, with the reason; a bias that does not learn runs."""
    q, k, v = _inputs(seed=9)
    options = _operand_options("bias_and_softcap")
    learning = {**options, "bias": options["bias"].clone().requires_grad_(True)}
    assert "dBias multiplied by the score_mod's derivative" in fat.explain(q, k, v, **learning)
    assert "selected: reference" in fat.explain(q, k, v, **learning)
    out = fat.attention(q, k, v, **options)
    assert _ran_native(out)


@pytest.mark.parametrize("name", ["softcap_flex", "alibi_flex", "bias", "bias_and_softcap"])
def test_warm_score_mod_and_bias_calls_never_wait_for_the_device(name):
    q, k, v = _inputs(seed=8)
    options = _operand_options(name)
    if name == "bias":
        options["bias"].requires_grad_(True)
    leaves = [q, k, v, *([options["bias"]] if name == "bias" else [])]
    _warm_calls_never_wait((q, k, v), options, leaves)


# ---------------------------------------------------------------- padded and THD calls on the operator


def _sequence_call(name: str):
    """(tensors, options) of padded and THD calls with an empty sequence, a one-token one and Sq != Skv."""
    from gpu_checks import _lengths, _thd

    lens_q, lens_kv = [37, 0, 1, 130], [64, 20, 1, 100]
    gen = torch.Generator(device="cuda").manual_seed(31)
    trusted = dict(max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv))
    offsets = dict(cu_seqlens_q=_lengths(lens_q), cu_seqlens_kv=_lengths(lens_kv), **trusted)
    if name.startswith("thd"):
        tensors = _thd("thd", lens_q, lens_kv, 8, 2, 64, seed=32, gaps=4 if name == "thd_gaps" else 0)
        options = dict(layout="thd", mask="padding_causal", **offsets)
        if name == "thd_gaps":  # padded offsets: 4 unused tokens after each sequence
            options["cu_seqlens_q_padded"] = _lengths([n + 4 for n in lens_q])
            options["cu_seqlens_kv_padded"] = _lengths([n + 4 for n in lens_kv])
        return tensors, options
    make = lambda s, h: torch.randn(4, s, h, 64, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    tensors = (make(max(lens_q), 8), make(max(lens_kv), 2), make(max(lens_kv), 2))
    options = dict(mask="padding", **offsets)
    if name == "padding_bias":
        options["bias"] = torch.randn(1, 8, max(lens_q), max(lens_kv), generator=gen, device="cuda").to(torch.bfloat16)
    if name == "padding_sink":
        options.update(mask="padding_causal", softmax_type="learnable",
                       sink=torch.randn(8, generator=gen, device="cuda"))
    return tensors, options


def _late_keys(score, b, h, q_idx, kv_idx):  # the first three queries of each sequence see no key
    return torch.where(kv_idx <= q_idx - 3, score, -float("inf"))


def _scored_call(name: str):
    """A padded or THD call with a score_mod: the graph's padding is the table's penalties. `window`: a left
    bound that leaves the last queries of the sequence with 130 queries and 100 keys without keys."""
    base, mod = name.split("+")
    tensors, options = _sequence_call(base)
    options = {**options, "score_mod": _late_keys if mod == "late_keys" else _softcap}  # (CAP's)
    if mod == "window":
        options.update(mask="padding_causal", window=(8, 0))
    return tensors, options


# (THD with a learnable sink: cuDNN 9.19 declines its backward, which needs 9.26.)
SEQUENCE_CASES = ["thd", "thd_gaps", "padding", "padding_bias", "padding_sink", "thd+softcap", "thd_gaps+softcap",
                  "thd+late_keys", "padding+softcap", "padding+window", "padding_sink+late_keys"]


@pytest.mark.parametrize("name", SEQUENCE_CASES)
def test_padded_and_thd_calls_run_on_the_operator_and_match_float64(name):
    """The operator builds the sequence table and fixes the rows cuDNN leaves with the Triton kernels it
    launches itself: out, LSE (-inf or the sink's log past each sequence) and every gradient agree with
    the float64 reference, and a warm call repeats the cold call's bits."""
    _check_sequence_call(name, native=True)


@pytest.mark.parametrize("name", ["thd+late_keys", "padding+window", "thd_gaps+softcap"])
def test_scored_sequence_calls_on_the_python_path_match_float64(name, monkeypatch):
    """The same with the operator off: the Python path binds the table's penalties too."""
    from fusedattn.cache import clear_all

    monkeypatch.setenv(torch_plans.ENV_SWITCH, "0")
    clear_all()
    _check_sequence_call(name, native=False)


def _same_document(ids):
    def same(b, h, q_idx, kv_idx):
        return ids[b, q_idx] == ids[b, kv_idx]

    return same


def _document_call(seed: int, s: int, documents: int, with_softcap: bool):
    """(q, k, v of B=2, sorted random document ids, the document mask_mod over them, the reference's
    score_mod: the mask, with a softcap where asked, written as one select)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.sort(torch.randint(0, documents, (2, s), generator=gen, device="cuda"), dim=1).values
    same = _same_document(ids)

    def selected(score, b, h, q_idx, kv_idx):
        kept = _softcap(score, b, h, q_idx, kv_idx) if with_softcap else score
        return torch.where(same(b, h, q_idx, kv_idx), kept, -float("inf"))

    return _inputs(b=2, s=s, seed=seed + 1), ids, same, selected


def test_a_document_mask_with_a_softcap_runs_as_thd_and_matches_float64():
    """A document mask_mod beside a softcap runs as THD with the score_mod (the operator's penalties):
    out, LSE and every gradient against the float64 reference of the pair written as one select; a repeat
    call (the operator reading the BSHD rows as tokens, the kept binding) repeats the first's bits."""
    from gpu_checks import assert_close_to_exact, run

    tensors, _, same, selected = _document_call(seed=61, s=77, documents=5, with_softcap=True)
    options = dict(mask_mod=same, score_mod=_softcap, deterministic=True)
    assert "layout=thd" in fat.explain(*tensors, **options)
    got, got_grads = run("cudnn", tensors, options)
    again, again_grads = run("cudnn", tensors, options)  # the warm way: the binding kept for the THD call
    assert _ran_native(again.out) and torch.equal(again.out, got.out)
    assert all(torch.equal(a, b) for a, b in zip(again_grads, got_grads))
    same_dtype, same_grads = run("reference", tensors, {"score_mod": selected})
    exact, exact_grads = run("reference", [t.double() for t in tensors], {"score_mod": selected})
    assert_close_to_exact("out", got.out, same_dtype.out, exact.out)
    torch.testing.assert_close(got.lse, exact.lse.float(), atol=2e-2, rtol=2e-3)
    for i, (a, b, c) in enumerate(zip(got_grads, same_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", a, b, c)


def _check_native_against_selected(tensors, selected, got, got_grads):
    """A native call's out and every gradient against the reference of `selected` (the mask as a select),
    in the inputs' dtype and in float64."""
    from gpu_checks import assert_close_to_exact, run

    assert _ran_native(got.out)
    same_dtype, same_grads = run("reference", tensors, {"score_mod": selected})
    exact, exact_grads = run("reference", [t.double() for t in tensors], {"score_mod": selected})
    assert_close_to_exact("out", got.out, same_dtype.out, exact.out)
    for i, (a, b, c) in enumerate(zip(got_grads, same_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", a, b, c)


def _our_kernel_launches(step) -> int:
    """Kernel launches of one step made with the driver's cuLaunchKernel: the operator's Triton kernels
    (the sequence table and the fix-ups); cuDNN's graphs launch otherwise."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(event.name == "cuLaunchKernel" for event in prof.events())


@pytest.mark.parametrize("with_softcap", [False, True], ids=["documents", "documents+softcap"])
def test_document_offsets_skip_the_fix_ups_that_user_offsets_keep(with_softcap):
    """A document mask's offsets cover every token, so its calls launch no fix-up (with a softcap, the
    forward's, which writes the backward's stats), and a warm call reuses the sequence table its layout's
    first call made (no table kernel); out and every gradient still match the float64 reference. A user's
    THD call given the same offsets as its own tensor keeps the table kernel and every fix-up: nothing
    tells the operator that they cover every token."""
    from gpu_checks import run

    tensors, ids, same, selected = _document_call(seed=63, s=96, documents=4, with_softcap=with_softcap)
    gen = torch.Generator(device="cuda").manual_seed(65)
    options = dict(mask_mod=same, deterministic=True, **({"score_mod": _softcap} if with_softcap else {}))
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    grad = torch.randn(leaves[0].shape, generator=gen, device="cuda", dtype=leaves[0].dtype)

    def step():
        torch.autograd.grad(fat.attention(*leaves, backend="cudnn", **options), leaves, grad)

    step()
    step()  # warm: answered in C
    assert _our_kernel_launches(step) == (1 if with_softcap else 0)
    run("cudnn", tensors, options)
    _check_native_against_selected(tensors, selected, *run("cudnn", tensors, options))  # (the second: kept)

    starts = torch.ones(ids.numel(), dtype=torch.bool, device="cuda")
    starts[1:] = ids.reshape(-1)[1:] != ids.reshape(-1)[:-1]
    given = torch.cat([starts.nonzero().flatten(), torch.tensor([ids.numel()], device="cuda")]).int()
    longest = int(given.diff().max())
    tokens = [x.detach().reshape(-1, *x.shape[2:]).clone().requires_grad_() for x in tensors]
    user = dict(layout="thd", cu_seqlens_q=given, cu_seqlens_kv=given, max_seqlen_q=longest, max_seqlen_kv=longest,
                **({"score_mod": _softcap} if with_softcap else {}))

    def user_step():
        torch.autograd.grad(fat.attention(*tokens, backend="cudnn", **user), tokens, grad.reshape(-1, *grad.shape[2:]))

    user_step()
    user_step()
    assert _our_kernel_launches(user_step) == 4


def test_a_kept_document_table_follows_new_ids_new_streams_and_capture():
    """The table kept for a document layout is read only while its ids are unchanged, on the stream that
    wrote it, outside capture: ids changed in place (a new layout), a side stream (its own table, made
    once) and a CUDA graph captured after warm calls (its own table, which the replays read) all give out
    and gradients that match the float64 reference of their own layout."""
    from gpu_checks import run

    tensors, ids, same, selected = _document_call(seed=67, s=80, documents=3, with_softcap=False)
    options = dict(mask_mod=same, deterministic=True)

    def check(got, got_grads):
        _check_native_against_selected(tensors, selected, got, got_grads)

    for _ in range(3):
        got = run("cudnn", tensors, options)
    check(*got)
    gen = torch.Generator(device="cuda").manual_seed(69)
    ids.copy_(torch.sort(torch.randint(0, 6, ids.shape, generator=gen, device="cuda"), dim=1).values)
    for _ in range(2):
        got = run("cudnn", tensors, options)
    check(*got)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        first_on_side = _our_kernel_launches(lambda: run("cudnn", tensors, options))
        again_on_side = _our_kernel_launches(lambda: run("cudnn", tensors, options))
        got = run("cudnn", tensors, options)
    torch.cuda.current_stream().wait_stream(side)
    check(*got)
    assert (first_on_side, again_on_side) == (1, 0), "a side stream makes its own table once"

    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    grad = torch.randn(leaves[0].shape, generator=gen, device="cuda", dtype=leaves[0].dtype)

    def step():
        out = fat.attention(*leaves, backend="cudnn", **options)
        return (out, *torch.autograd.grad(out, leaves, grad))

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(3):
            expected = step()
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    # 40 more layouts: the warm stream's kept table is dropped and its memory taken by others' tables
    for seed in range(40):
        other = torch.sort(torch.randint(0, 5, ids.shape, generator=gen.manual_seed(seed), device="cuda"),
                           dim=1).values
        with torch.no_grad():
            fat.attention(*leaves, backend="cudnn", mask_mod=_same_document(other))
    for x in captured:
        x.detach().fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, expected):
        assert torch.equal(a, b)


def test_document_calls_on_strided_views_match_float64():
    """A document call reads q, k, v's rows as tokens: q a slice of longer rows (not evenly strided: copied)
    and k, v head slices of one packed tensor (read where they lie) give out and every gradient of the
    float64 reference, warm and cold."""
    from gpu_checks import assert_close_to_exact

    gen = torch.Generator(device="cuda").manual_seed(71)
    ids = torch.sort(torch.randint(0, 4, (2, 72), generator=gen, device="cuda"), dim=1).values
    same = _same_document(ids)
    longer = torch.randn(2, 90, 8, 64, generator=gen, device="cuda").bfloat16().requires_grad_()
    packed = torch.randn(2, 72, 4, 64, generator=gen, device="cuda").bfloat16().requires_grad_()
    grad = torch.randn(2, 72, 8, 64, generator=gen, device="cuda")

    def views():
        return longer[:, :72], packed[:, :, :2], packed[:, :, 2:]

    def selected(score, b, h, q_idx, kv_idx):
        return torch.where(same(b, h, q_idx, kv_idx), score, -float("inf"))

    for _ in range(3):
        out = fat.attention(*views(), backend="cudnn", mask_mod=same, deterministic=True)
        got = (out, *torch.autograd.grad(out, (longer, packed), grad))
    assert _ran_native(got[0])
    results = {}
    for dtype in (torch.bfloat16, torch.float64):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (longer, packed)]
        q, k, v = leaves[0][:, :72], leaves[1][:, :, :2], leaves[1][:, :, 2:]
        out = fat.attention(q, k, v, backend="reference", score_mod=selected)
        results[dtype] = (out, *torch.autograd.grad(out, leaves, grad.to(dtype)))
    for name, a, b, c in zip(("out", "grad longer", "grad packed"), got, results[torch.bfloat16],
                             results[torch.float64]):
        assert_close_to_exact(name, a, b, c)


def _check_sequence_call(name: str, native: bool):
    from gpu_checks import assert_close_to_exact, run

    tensors, options = _scored_call(name) if "+" in name else _sequence_call(name)
    options = {**options, "deterministic": True}
    first, first_grads = run("cudnn", tensors, options)
    assert _ran_native(first.out) == native, first.out.grad_fn
    again, again_grads = run("cudnn", tensors, options)
    assert torch.equal(first.out, again.out) and all(torch.equal(a, b) for a, b in zip(first_grads[:3], again_grads))
    for a, b in zip(first_grads[3:], again_grads[3:]):  # dSink and dBias: cuDNN sums them in any order
        torch.testing.assert_close(a, b)
    same, same_grads = run("reference", tensors, options)
    wide = {key: value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value
            for key, value in options.items()}
    exact, exact_grads = run("reference", [t.double() for t in tensors], wide)
    assert_close_to_exact("out", first.out, same.out, exact.out)
    finite = torch.isfinite(exact.lse)
    assert torch.equal(torch.isfinite(first.lse), finite), "LSE: -inf where the reference has it, nowhere else"
    torch.testing.assert_close(first.lse[finite], exact.lse[finite].float(), atol=2e-2, rtol=2e-3)
    assert len(first_grads) == len(exact_grads)
    for i, (got, s, e) in enumerate(zip(first_grads, same_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", got, s, e, reduction=i >= 3)


@pytest.mark.parametrize("name", ["thd", "padding_sink"])
def test_broken_offsets_give_nan_on_the_operator(name):
    """Offsets whose values break the rules (read on the device, never on the host) give NaN in every
    output and gradient, the sink's too, as on the Python path."""
    tensors, options = _sequence_call(name)
    broken = options["cu_seqlens_q"].clone()
    broken[2] = broken[1] - 1  # a negative length
    options = {**options, "cu_seqlens_q": broken}
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    extra = {n: options[n].detach().clone().requires_grad_() for n in ("sink",) if n in options}
    out = fat.attention(*leaves, **{**options, **extra})
    assert _ran_native(out)
    out.float().sum().backward()
    assert torch.isnan(out).all()
    for x in (*leaves, *extra.values()):
        assert torch.isnan(x.grad).all()


@pytest.mark.parametrize("name", ["thd", "padding", "thd+softcap", "padding+window"])
def test_warm_padded_and_thd_calls_never_wait_for_the_device(name):
    tensors, options = _scored_call(name) if "+" in name else _sequence_call(name)
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    _warm_calls_never_wait(leaves, options, leaves)


def test_compiled_thd_calls_run_the_operator_with_eagers_bits():
    tensors, options = _sequence_call("thd")
    options = {**options, "deterministic": True}
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def loss(*x):
        return fat.attention(*x, **options).float().square().sum()

    eager = torch.autograd.grad(loss(*leaves), leaves)
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    grads = torch.autograd.grad(compiled(*leaves), leaves)
    for name, got, want in zip("qkv", grads, eager):
        assert torch.equal(got, want), f"d{name} differs from eager"


@pytest.mark.parametrize("name", ["thd+softcap", "thd_gaps+softcap", "padding+softcap", "padding_sink+late_keys"])
def test_compiled_score_mod_calls_with_sequence_offsets_stay_in_the_graph(name):
    """A score_mod call with sequence offsets (THD, padded offsets, padding masks) is the native operator
    inside a fullgraph compiled graph, the offsets its operands: eager's bits forward and backward."""
    tensors, options = _scored_call(name)
    options = {**options, "deterministic": True}
    leaves = [t.detach().clone().requires_grad_() for t in tensors]

    def attend(*x):  # the loss is taken outside: inductor sums in an order of its own
        return fat.attention(*x, **options)

    def loss(out):
        return out.float().square().sum()

    assert NATIVE_OP in _compiled_targets(lambda *x: loss(attend(*x)), *leaves)
    eager_out = attend(*leaves)
    eager = torch.autograd.grad(loss(eager_out), leaves)
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        compiled_out = torch.compile(attend, fullgraph=True, backend=backend)(*leaves)
        grads = torch.autograd.grad(loss(compiled_out), leaves)
        assert torch.equal(compiled_out, eager_out), f"out ({backend}) differs from eager"
        for which, got, want in zip("qkv", grads, eager):
            assert torch.equal(got, want), f"d{which} ({backend}) differs from eager"


# ---------------------------------------------------------------- score_mods in compiled graphs


def _compiled_targets(fn, *args) -> set:
    targets: set = set()

    def recording(gm, example_inputs):
        targets.update(str(node.target) for node in gm.graph.nodes)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=recording)(*args)
    return targets


def test_flex_and_builtin_score_mods_compile_with_fullgraph_on_the_operator():
    """A flex callback reading a global number, a closure made inside the compiled function and built-in
    ScoreMods (made outside and inside it) run as the native operator inside a fullgraph compiled graph,
    with eager's bits forward and backward; a new number recompiles and gives the new result."""
    from fusedattn import score_mods as sm

    global CAP
    q, k, v = _inputs(seed=51)
    builtin = sm.softcap(20.0)

    def closure_loss(q, k, v, cap):
        def capped(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return fat.attention(q, k, v, mask="causal", deterministic=True, score_mod=capped).float().square().sum()

    cases = {
        "global": lambda q, k, v: _loss(q, k, v, score_mod=_softcap),
        "builtin": lambda q, k, v: _loss(q, k, v, score_mod=builtin),
        "closure": lambda q, k, v: closure_loss(q, k, v, 25.0),
        "builtin_made_inside": lambda q, k, v: _loss(q, k, v, score_mod=sm.softcap(15.0)),
    }
    for name, loss in cases.items():
        assert NATIVE_OP in _compiled_targets(loss, q, k, v), name
        eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
        for backend in ("aot_eager", "inductor"):
            torch._dynamo.reset()
            compiled = torch.compile(loss, fullgraph=True, backend=backend)
            grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
            assert all(torch.equal(a, b) for a, b in zip(grads, eager)), f"{name} ({backend}) differs from eager"
    torch._dynamo.reset()
    compiled = torch.compile(cases["global"], fullgraph=True, backend="aot_eager")
    before = compiled(q, k, v)
    CAP, old = 5.0, CAP
    try:
        after, eager_after = compiled(q, k, v), cases["global"](q, k, v)
    finally:
        CAP = old
    assert torch.equal(after, eager_after) and not torch.equal(before, after)


def _row_offset(graph, score, tensors):
    """A cuDNN-native callback: score + q_idx / 64 (derivative 1)."""
    from fusedattn import score_mods as sm

    return graph.add(a=score, b=graph.div(a=sm.row_index(graph, score), b=tensors["width"]))


GLOBAL_SLOPES = None  # set by the test below: a tensor a flex callback reads as a global


def _global_alibi(score, b, h, q_idx, kv_idx):
    return score + GLOBAL_SLOPES[h] * (kv_idx - q_idx)


def _closure_alibi(slopes):
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)
    return alibi


@pytest.mark.parametrize("reach", ["global", "closure"])
def test_flex_score_mods_reading_captured_tensors_compile_with_fullgraph(reach):
    """A flex ALiBi over an (H,) tensor it reads as a global, or from the closure of a callback made outside
    the compiled function, runs in a fullgraph compiled graph: the tensor is a graph input bound by
    fusedattn::score_mod_aux on every run, so the graph gives eager's bits forward and backward, and new
    values in the tensor show in the next run."""
    global GLOBAL_SLOPES
    q, k, v = _inputs(seed=53)
    GLOBAL_SLOPES = torch.rand(8, device="cuda") / 4
    slopes = GLOBAL_SLOPES
    alibi = _global_alibi if reach == "global" else _closure_alibi(slopes)

    def loss(q, k, v):
        return _loss(q, k, v, score_mod=alibi)

    targets = _compiled_targets(loss, q, k, v)
    assert NATIVE_OP in targets and "fusedattn.score_mod_aux.default" in targets, targets
    for backend in ("aot_eager", "inductor"):
        eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
        torch._dynamo.reset()
        compiled = torch.compile(loss, fullgraph=True, backend=backend)
        grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(grads, eager)), f"{backend} differs from eager"
        before = compiled(q, k, v)
        slopes.mul_(3)
        after, eager_after = compiled(q, k, v), loss(q, k, v)
        # (the loss's own sum: inductor may add in another order, 148189.5 against 148189.5156 on an H100)
        torch.testing.assert_close(after, eager_after, rtol=1e-6, atol=0, msg=backend)
        assert not torch.equal(before, after), backend
        attend = torch.compile(lambda q, k, v: fat.attention(q, k, v, mask="causal", score_mod=alibi),
                               fullgraph=True, backend=backend)
        slopes.mul_(0.5)  # the attention itself, new values and all, gives eager's bits
        assert torch.equal(attend(q, k, v), fat.attention(q, k, v, mask="causal", score_mod=alibi)), backend


@pytest.mark.parametrize("name", ["alibi_closure_made_inside", "alibi_builtin", "native_callback"])
def test_score_mods_bound_per_call_still_break_the_graph_with_a_reason(name):
    """Tensors captured by a callback made inside the compiled function (ALiBi's slopes), ScoreMods holding
    tensors (the built-in ALiBi over a tensor) and cuDNN-native callbacks run eagerly inside a compiled
    function: fullgraph=True raises (naming where), fullgraph=False gives eager's result."""
    from fusedattn import score_mods as sm

    q, k, v = _inputs(seed=52)
    slopes = torch.rand(8, device="cuda") / 4
    options = {"alibi_closure_made_inside": None,
               "alibi_builtin": dict(score_mod=sm.alibi(slopes)),
               "native_callback": dict(score_mod=_row_offset, score_mod_tensors={"width": 64.0})}[name]

    def loss(q, k, v):
        if options is None:  # the callback made here, in the traced code
            return _loss(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx))
        return _loss(q, k, v, **options)

    torch._dynamo.reset()
    reason = "made_in_compiled_code" if options is None else "runs eagerly inside a compiled model"
    with pytest.raises(Exception, match=reason):
        torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v)
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager")
    assert torch.equal(compiled(q, k, v), loss(q, k, v))


# ---------------------------------------------------------------- max_logit on the operator


@pytest.mark.parametrize("mask", ["causal", "none"])
def test_max_logit_calls_run_on_the_operator_and_match_float64(mask):
    """The operator makes the LSE from cuDNN's row maxima and sums and the largest logit per head in C++:
    both match the float64 reference, the backward (which reads that LSE) too; compiled calls give
    eager's bits; warm calls never wait for the device."""
    from gpu_checks import assert_close_to_exact, run

    tensors = _inputs(seed=61)
    options = {"mask": mask, "deterministic": True}
    got, got_grads = run("cudnn", tensors, options, max_logit=True)
    assert _ran_native(got.out), got.out.grad_fn
    same, same_grads = run("reference", tensors, options, max_logit=True)
    exact, exact_grads = run("reference", [t.double() for t in tensors], options, max_logit=True)
    assert_close_to_exact("out", got.out, same.out, exact.out)
    torch.testing.assert_close(got.lse, exact.lse.float(), atol=2e-2, rtol=2e-3)
    torch.testing.assert_close(got.max_logit, exact.max_logit.float(), atol=5e-2, rtol=1e-2)
    for i, (g, s, e) in enumerate(zip(got_grads, same_grads, exact_grads)):
        assert_close_to_exact(f"grad {i}", g, s, e)

    q, k, v = (t.detach().requires_grad_() for t in tensors)

    def step(q, k, v):
        result = fat.attention(q, k, v, return_max_logit=True, **options)
        return result.out.float().square().sum(), result.max_logit

    eager_loss, eager_max = step(q, k, v)
    eager = torch.autograd.grad(eager_loss, (q, k, v))
    torch._dynamo.reset()
    loss, max_logit = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(max_logit, eager_max)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(loss, (q, k, v)), eager))
    _never_waiting(lambda: torch.autograd.grad(step(q, k, v)[0], (q, k, v)), repeats=2)


def test_calls_answered_in_c_give_the_python_paths_bits_and_follow_changes(monkeypatch):
    """Warm entries (torch/warm_entries.py): from the third call on, a plain call, score_mod calls, a kept
    mask_mod rewrite, a document mask run as THD and a bias call are answered in C, with the bits of the
    Python path (forward and gradients); a new captured number and an in-place change of a captured
    tensor (slopes, document ids) still reach the kernel."""
    from fusedattn.torch import functional, warm_entries

    assert torch_plans.warm_call is not None, "the library was built without its Python entry"
    global CAP
    q, k, v = _inputs(seed=9)
    slopes = torch.rand(8, device="cuda")
    grad = torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16)

    from fusedattn import score_mods as sm

    def alibi(score, b, h, q_idx, kv_idx):  # (a helper function read would be looked inside: Python's check)
        return CAP * sm.tanh(score / CAP) + slopes[h] * (kv_idx - q_idx) / 64

    builtin = sm.softcap(20.0)
    python_calls = []
    original = functional._operator
    monkeypatch.setattr(functional, "_operator", lambda *args: python_calls.append(1) or original(*args))

    def step(**options):
        out = fat.attention(q, k, v, mask="causal", **options)
        return (out, *torch.autograd.grad(out, (q, k, v), grad))

    def python_path(**options):
        with monkeypatch.context() as patch:
            patch.setattr(torch_plans, "warm_call", None)
            return step(**options)

    def local(b, h, q_idx, kv_idx):  # a window mask_mod: rewritten into cuDNN's window, kept
        return (q_idx - kv_idx < 64) & (q_idx >= kv_idx)

    ids = torch.repeat_interleave(torch.arange(4, device="cuda"), 64)  # four documents of 64 tokens

    def document(b, h, q_idx, kv_idx):  # run as THD, its offsets read once per version of ids
        return ids[q_idx] == ids[kv_idx]

    bias = torch.randn(1, 8, 256, 256, device="cuda", dtype=torch.bfloat16)
    before = CAP
    try:
        for options in ({}, {"score_mod": alibi}, {"score_mod": builtin}, {"mask_mod": local},
                        {"mask_mod": document}, {"mask_mod": document, "score_mod": builtin}, {"bias": bias}):
            for change in (None, "cap", "slopes"):
                CAP = 5.0 if change == "cap" else CAP
                if change == "slopes":
                    slopes.mul_(2)
                    ids[96:128] = 2  # other documents, sorted still
                want = python_path(**options)
                for _ in range(3):
                    got = step(**options)
                python_calls.clear()
                got = step(**options)
                assert not python_calls, f"{options}, after {change}: not answered in C"
                for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                    assert torch.equal(a, b), f"{options}, after {change}: {name} differs from the Python path's"
        assert warm_entries.size() > 0
    finally:
        CAP = before
