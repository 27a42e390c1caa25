"""Flex-style score_mod and mask_mod (plain torch callbacks) fused on cuDNN, against the float64
reference: every corpus entry (tests/flex_corpus.py), forward, LSE and every gradient.

Every call here must run on cuDNN: a decline fails the test (it would hide a regression), with
cuDNN's reasons in the message. Which backend ran is checked through explain's selection.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
cudnn = pytest.importorskip("cudnn")

from flex_corpus import CORPUS, DENSE, torch_array  # noqa: E402
from gpu_checks import _lengths, assert_close_to_exact, make, run  # noqa: E402

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402
from fusedattn import score_mods as sm  # noqa: E402

pytestmark = pytest.mark.gpu

B, S, H, D = 2, 128, 4, 64


def _cuda(values):
    return torch_array(values, "cuda")


def _options(name: str, batch: int = B, heads: int = H, seqlen: int = S) -> dict:
    score_mod, mask_mod = CORPUS[name](_cuda, batch, heads, seqlen)
    return {k: v for k, v in (("score_mod", score_mod), ("mask_mod", mask_mod)) if v is not None}


def _selected(tensors, options) -> str:
    text = fat.explain(*tensors, backend=None, **options)
    return text.split("selected: ", 1)[1].split()[0]


def as_select(options: dict) -> dict:
    """The options with mask_mod folded into the score_mod as a select (-inf where it is False)."""
    mask_mod = options.get("mask_mod")
    if mask_mod is None:
        return options
    score_mod = options.get("score_mod") or (lambda s, b, h, q_idx, kv_idx: s)

    def select(score, b, h, q_idx, kv_idx):
        return torch.where(mask_mod(b, h, q_idx, kv_idx), score_mod(score, b, h, q_idx, kv_idx), -float("inf"))

    return {**{k: v for k, v in options.items() if k != "mask_mod"}, "score_mod": select}


def check_on_cudnn(tensors, options, dtype=torch.bfloat16):
    """cuDNN (required, never skipped) against the float64 reference, with the same-dtype reference's
    own error as the yardstick (STYLE 15)."""
    try:
        fused, fused_grads = run("cudnn", tensors, options)
    except fusedattn.NoBackendError as error:
        pytest.fail(f"cuDNN declined a flex callback it should run: {error}")
    assert _selected(tensors, options) == "cudnn"
    # The references see the mask as a select in the score, not the native masks cuDNN got for it.
    same, same_grads = run("reference", tensors, as_select(options))
    exact, exact_grads = run("reference", [t.double() for t in tensors], as_select(options))
    assert torch.isfinite(fused.out).all()
    assert_close_to_exact("out", fused.out, same.out, exact.out)
    finite = torch.isfinite(exact.lse)
    assert torch.equal(torch.isfinite(fused.lse), finite) or not (~finite).any()
    torch.testing.assert_close(fused.lse[finite], exact.lse[finite].float(), atol=2e-2, rtol=2e-3)
    for i, (g, s, e) in enumerate(zip(fused_grads, same_grads, exact_grads)):
        assert g is not None, f"gradient {i} missing"
        assert torch.isfinite(g).all(), f"gradient {i} has non-finite values"
        assert_close_to_exact(f"grad {i}", g, s, e)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_corpus_entry_on_cudnn(name):
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=31)
    check_on_cudnn((q * 2, k, v), _options(name))


@pytest.mark.parametrize("name", ["softcap_causal", "alibi", "document_causal", "head_scale"])
def test_corpus_entry_with_gqa_and_odd_lengths(name):
    q, k, v = make(B, 77, 77, H, 2, 64, 64, torch.bfloat16, seed=32)
    check_on_cudnn((q, k, v), _options(name, seqlen=77))


@pytest.mark.parametrize("name, heads_kv, seqlen", [("document", H, S), ("document_causal", 2, 77)])
def test_a_repeat_document_call_goes_the_short_way_and_agrees(name, heads_kv, seqlen, monkeypatch):
    """A repeat document call (its rewrite and THD call kept) goes from the dense call to the operator, which
    reads BSHD rows as tokens and answers in BSHD (functional._document_call): out, LSE and every gradient
    against the float64 reference, as the first call's."""
    from fusedattn.torch import functional

    q, k, v = make(B, seqlen, seqlen, H, heads_kv, D, D, torch.bfloat16, seed=41)
    options = _options(name, seqlen=seqlen)
    check_on_cudnn((q, k, v), options)  # the first call: the full way, which keeps the THD call
    inner, attention = [], functional.attention
    monkeypatch.setattr(functional, "attention", lambda *a, **kw: inner.append(1) or attention(*a, **kw))
    run("cudnn", (q, k, v), options)
    assert not inner, "a repeat document call went through a second attention()"
    monkeypatch.undo()
    check_on_cudnn((q, k, v), options)


@pytest.mark.parametrize("name", ["softcap", "causal", "sliding_window", "block_position"])
def test_corpus_entry_on_thd_with_positions_per_sequence(name):
    lengths = [37, 64, 5]
    gen = torch.Generator(device="cuda").manual_seed(33)
    q, k, v = (torch.randn(sum(lengths), H, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    cu = _lengths(lengths)
    options = {**_options(name, batch=len(lengths), seqlen=max(lengths)), "layout": "thd", "cu_seqlens_q": cu,
               "cu_seqlens_kv": cu,
               "max_seqlen_q": max(lengths), "max_seqlen_kv": max(lengths)}
    check_on_cudnn((q, k, v), options)


def test_portable_softcap_agrees_with_the_hand_written_graph():
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=34)
    q = q * 3
    portable = fat.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: 2.0 * sm.tanh(s / 2.0), backend="cudnn")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    from native_softcap import native_softcap  # the expert path: graph ops and derivative by hand

    written = fat.attention(q, k, v, score_mod=native_softcap(2.0), backend="cudnn")
    torch.testing.assert_close(portable, written, atol=2e-2, rtol=0)
    builtin = fat.attention(q, k, v, score_mod=sm.softcap(2.0), backend="cudnn")
    torch.testing.assert_close(builtin, portable, atol=0, rtol=0)  # the built-in is that function


def test_a_new_captured_number_reuses_the_built_graph():
    from fusedattn.backends.cudnn.runtime import graph_cache

    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=35)

    def capped(cap):
        return lambda s, b, h, qi, ki: cap * torch.tanh(s / cap)

    fat.attention(q, k, v, score_mod=capped(3.0), backend="cudnn")
    built = len(graph_cache())
    outs = [fat.attention(q, k, v, score_mod=capped(c), backend="cudnn") for c in (1.0, 5.0)]
    assert len(graph_cache()) == built
    for cap, out in zip((1.0, 5.0), outs):
        expected = fat.attention(q, k, v, score_mod=capped(cap), backend="reference")
        torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=0)


def test_dense_gathers_are_named_in_explain():
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=36)
    for name in sorted(DENSE):
        assert _selected((q, k, v), _options(name)) == "cudnn"


def test_learnable_captured_tensor_in_an_added_term_gets_its_gradient_on_cudnn():
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=37)
    slopes = torch.rand(H, device="cuda", requires_grad=True)

    def learnable_alibi(s, b, h, qi, ki):
        return s - slopes[h] * (qi - ki).abs()

    grads = {}
    for backend in ("cudnn", "reference"):
        slopes.grad = None
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        out = fat.attention(*leaves, score_mod=learnable_alibi, mask="causal", backend=backend)
        out.float().square().sum().backward()
        grads[backend] = slopes.grad.clone()
    torch.testing.assert_close(grads["cudnn"], grads["reference"], atol=0.05 * grads["reference"].abs().max().item(),
                               rtol=0)


def _added_by_key(table):
    return lambda s, b, h, qi, ki: s + table[ki]


@pytest.mark.parametrize("mask", ["dilated", "document", "empty_rows"])
def test_a_learnable_added_term_beside_a_mask_mod_gets_every_gradient_on_cudnn(mask):
    """The term runs as a bias (dBias), the mask stays in the graph with derivative 1 (cuDNN builds no dBias
    beside a derivative graph): right for a mask, also for the rows it leaves without keys (+inf stats).
    Out and the gradients of q, k, v and the table against the float64 reference."""
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=40)
    table = torch.randn(S, device="cuda")
    documents = torch.arange(S, device="cuda").div(40, rounding_mode="floor").expand(B, S)
    masks = {"dilated": lambda b, h, qi, ki: (qi - ki) % 3 != 1,
             "document": lambda b, h, qi, ki: documents[b, qi] == documents[b, ki],
             "empty_rows": lambda b, h, qi, ki: (qi % 5 != 0) & ((qi - ki) % 3 != 1)}
    results = {}
    for backend, dtype in (("cudnn", None), ("reference", None), ("reference", torch.float64)):
        leaves = [x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in (q, k, v)]
        u = table.clone().to(dtype or torch.float32).requires_grad_(True)
        out = fat.attention(*leaves, score_mod=_added_by_key(u), mask_mod=masks[mask], backend=backend)
        grad = torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(3), device="cuda")
        out.float().backward(grad)
        results[backend, dtype] = (out, *(x.grad for x in leaves), u.grad)
    fused, same, exact = results["cudnn", None], results["reference", None], results["reference", torch.float64]
    for name, *values in zip(("out", "q", "k", "v", "table"), fused, same, exact):
        assert_close_to_exact(name, *values, reduction=name == "table")


@pytest.mark.parametrize("beside", [None, "dilated"])
def test_training_steps_of_a_learning_term_follow_its_updates_on_the_warm_path(beside):
    """Three steps of a loop, the table updated in place between them as an optimizer does: the repeat calls
    take the warm path (the term gathered anew from the table, no host wait) and each step's out and
    gradients match the float64 reference at the table's current values. Beside a mask_mod, the second
    call raised "this plan needs the bias" before (the mask's kept binding went without the term)."""
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=41)
    table = (0.5 * torch.randn(H, 2 * S - 1, device="cuda")).requires_grad_(True)
    mask_mod = None if beside is None else (lambda b, h, qi, ki: (qi - ki) % 3 != 1)

    def relpos_over(t):
        return lambda s, b, h, qi, ki: s + t[h, qi - ki + S - 1]

    relpos = relpos_over(table)
    grad = torch.randn(B, S, H, D, generator=torch.Generator(device="cuda").manual_seed(4), device="cuda")
    for step in range(3):
        leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = fat.attention(*leaves, score_mod=relpos, mask_mod=mask_mod, backend="cudnn")
            out.float().backward(grad)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results = {"cudnn": (out, *(x.grad for x in leaves), table.grad)}
        table.grad = None
        for dtype in (None, torch.float64):
            refs = [x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in (q, k, v)]
            u = table.detach().clone().to(dtype or torch.float32).requires_grad_(True)
            out = fat.attention(*refs, score_mod=relpos_over(u), mask_mod=mask_mod, backend="reference")
            out.float().backward(grad)
            results[dtype] = (out, *(x.grad for x in refs), u.grad)
        for name, *values in zip(("out", "q", "k", "v", "table"), results["cudnn"], results[None],
                                 results[torch.float64]):
            assert_close_to_exact(f"step {step} {name}", *values, reduction=name == "table")
        with torch.no_grad():
            table.add_(0.3 * torch.randn_like(table))


@pytest.mark.parametrize("io", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_a_learnable_scalar_read_whole_learns_on_cudnn(io):
    """score + c * (kv_idx - q_idx) with c a 0-d parameter (one ALiBi slope for every head): it was refused
    ("indexed by numbers alone"); it runs as a bias on cuDNN, out and every gradient against float64. In
    bf16, dc (a sum over every score of dBias, which cuDNN writes in bf16, times kv_idx - q_idx) was 2.65%
    off where the same-dtype reference is 0.4% off (H100): it gets the 5% of the per-head slopes' test."""
    q, k, v = make(B, S, S, H, H, D, D, io, seed=42)
    grad = torch.randn(B, S, H, D, generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")
    results = {}
    for backend, dtype in (("cudnn", None), ("reference", None), ("reference", torch.float64)):
        leaves = [x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in (q, k, v)]
        c = torch.tensor(-0.05, device="cuda", dtype=dtype or torch.float32, requires_grad=True)
        out = fat.attention(*leaves, score_mod=lambda s, b, h, qi, ki, c=c: s + c * (ki - qi), mask="causal",
                            backend=backend)
        out.float().backward(grad)
        results[backend, dtype] = (out, *(x.grad for x in leaves), c.grad)
    for name, *values in zip(("out", "q", "k", "v", "c"), results["cudnn", None], results["reference", None],
                             results["reference", torch.float64]):
        if name == "c" and io == torch.bfloat16:
            torch.testing.assert_close(values[0].double(), values[2], rtol=0, atol=0.05 * values[2].abs().item())
        else:
            assert_close_to_exact(name, *values, reduction=name == "c")


NATIVE = {"causal": "mask=causal", "causal_shifted": "window=(-1, 2)", "sliding_window": "window=(3, 0)",
          "sliding_window_both": "window=(2, 2)", "padding": "mask=padding", "document": "layout=thd",
          "document_causal": "layout=thd"}


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_mask_mods_that_are_native_masks_run_without_a_score_mod_graph(name):
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=38)
    config = fat.explain(q, k, v, **_options(name)).splitlines()[0]
    assert NATIVE[name] in config and "score_mod" not in config, config


@pytest.mark.parametrize("name", ["causal", "sliding_window", "padding", "document_causal"])
def test_warm_native_mask_mod_calls_never_wait_for_the_device(name):
    q, k, v = make(B, S, S, H, H, D, D, torch.bfloat16, seed=39)
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    options = _options(name)
    for _ in range(2):  # the first call builds (and reads document ids once)
        fat.attention(*leaves, backend="cudnn", **options).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fat.attention(*leaves, backend="cudnn", **options).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("case", ["from create_block_mask", "from_kv_blocks, no mask_mod",
                                  "full blocks the mask_mod masks partly"])
def test_flex_attention_reads_a_block_mask_as_compiled_flex_attention_does(case):
    """The drop-in against torch.compile(flex_attention) on the GPU with the same BlockMask, both against
    a dense float64 reading of the table (the yardstick: compiled flex's own bf16 error)."""
    from test_flex_dropin import _as_compiled_flex, _block_cases
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    length = 256
    block_mask, mask_mod, _ = _block_cases(length)[case]
    block_mask = block_mask.to("cuda")
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 4, length, 64, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ours, _ = fat.flex_attention(q, k, v, block_mask=block_mask, return_lse=True)
    theirs, _ = torch.compile(torch_flex)(q, k, v, block_mask=block_mask, return_lse=True)
    exact, _ = _as_compiled_flex(*(x.double().cpu() for x in (q, k, v)), block_mask.to("cpu"), mask_mod, 64 ** -0.5)
    assert_close_to_exact("compiled flex's out", theirs, ours, exact)  # the reading of the table is theirs
    assert_close_to_exact("out", ours, theirs, exact)
