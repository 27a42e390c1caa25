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
    for _ in range(2):  # cold: validation, selection, graph builds and plan registration may read the host
        out = fat.attention(*args, **options)
        torch.autograd.grad(out.float().square().sum(), leaves)
        with torch.no_grad():
            fat.attention(*args, **options)
    assert _ran_native(out), out.grad_fn
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            out = fat.attention(*args, **options)
            torch.autograd.grad(out.float().square().sum(), leaves)
            with torch.no_grad():
                fat.attention(*args, **options)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


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
