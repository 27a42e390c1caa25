"""The launch core's CUDA graph replays (backends/cudnn/native/replay.h) on a GPU.

A launch whose pointers and pass-by-value scalars came before replays a graph captured from it. The
checks: a replay reads what its buffers hold now (inputs, gradients and sequence offsets changed in
place), a new score_mod number is a new launch and never a stale replay, each call's bits equal those
of the same call executed by cuDNN on buffers no earlier launch used, and FUSEDATTN_NATIVE_REPLAY=0
turns replays off. The ground truth keeps every one of its tensors alive, so the allocator never
hands it an address twice: its launches are all first sightings, which cuDNN executes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cudnn")

import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn.native import core, torch_plans  # noqa: E402

pytestmark = pytest.mark.gpu

CAP = 30.0  # read by _softcap on each call


@pytest.fixture(autouse=True)
def _native_available():
    assert torch_plans.unavailable() is None, torch_plans.unavailable()  # a GPU machine must build it


def _softcap(score, b, h, q_idx, kv_idx):
    from fusedattn import score_mods as sm

    return CAP * sm.tanh(score / CAP)


def _random(x: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(x.shape, generator=gen, device="cuda").to(x.dtype)


def _step(tensors, grad, options):
    """Out and the gradients of the leaves, from one call and one backward."""
    for x in tensors:
        x.grad = None
    out = fat.attention(*tensors, **options)
    out.backward(grad)
    return out.detach(), *(x.grad for x in tensors)


def _steps_in_place(tensors, grad, options, values, before_step=None):
    """One step per entry of `values` on the same buffers: the entry's tensors are copied into
    (*tensors, grad, *the options' tensors) first, and the results into buffers made before the loop,
    so every step allocates the same blocks and repeats its launches' pointers. A result list per step."""
    targets = [*tensors, grad, *(x for x in options.values() if isinstance(x, torch.Tensor))]
    held = [[torch.empty_like(r) for r in _step(tensors, grad, options)] for _ in values]
    for i, (entry, results) in enumerate(zip(values, held)):
        with torch.no_grad():
            for target, value in zip(targets, entry):
                target.copy_(value)
        if before_step is not None:
            before_step(i)
        for result, got in zip(results, _step(tensors, grad, options)):
            result.copy_(got)
    return held


def _fresh_steps(tensors, grad, options, values, before_step=None):
    """The same steps on new buffers each, all kept alive: launches no earlier one shared a pointer
    with, which cuDNN executes."""
    alive, results = [], []
    for i, entry in enumerate(values):
        copies = [value.clone() for value in entry]
        leaves = [x.requires_grad_() for x in copies[:len(tensors)]]
        fresh_grad = copies[len(tensors)]
        rest = iter(copies[len(tensors) + 1:])
        fresh_options = {key: next(rest) if isinstance(value, torch.Tensor) else value
                         for key, value in options.items()}
        if before_step is not None:
            before_step(i)
        results.append(_step(leaves, fresh_grad, fresh_options))
        alive += [copies, results[-1]]
    return results


def _values(tensors, grad, options, steps: int, name: str = ""):
    """Per step, new values for the tensors, the gradient and the options' tensors (THD: new lengths)."""
    values = []
    for step in range(steps):
        entry = [_random(x, 10 * step + i) for i, x in enumerate((*tensors, grad))]
        for key, value in options.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key == "cu_seqlens_q":  # move tokens between the first two sequences: same total
                value = value.clone()
                value[1] = 37 - 5 * step
                entry.append(value)
            elif key.startswith("cu_seqlens"):
                entry.append(value.clone())
            else:
                entry.append(_random(value, 10 * step + 9))
        values.append(entry)
    return values


def _thd_call():
    from gpu_checks import _lengths, _thd

    lens_q, lens_kv = [37, 0, 1, 130], [64, 20, 1, 100]
    tensors = _thd("thd", lens_q, lens_kv, 8, 2, 64, seed=32, gaps=0)
    options = dict(layout="thd", mask="padding_causal", cu_seqlens_q=_lengths(lens_q),
                   cu_seqlens_kv=_lengths(lens_kv), max_seqlen_q=max(lens_q), max_seqlen_kv=max(lens_kv))
    return tensors, options


def _call(name: str):
    """(leaf tensors, options) of the calls the replay tests repeat."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    make = lambda h: torch.randn(2, 192, h, 64, generator=gen, device="cuda").to(torch.bfloat16)  # noqa: E731
    tensors, options = (make(8), make(2), make(2)), dict(mask="causal")
    if name == "softcap":
        options = dict(mask="causal", score_mod=_softcap)
    elif name == "bias":
        options = dict(mask="causal", bias=torch.randn(1, 8, 192, 192, generator=gen, device="cuda").to(torch.bfloat16))
    elif name == "alibi":  # a captured (H,) tensor: an aux device buffer of the graph
        slopes = torch.rand(8, generator=gen, device="cuda") / 8
        options = dict(mask="causal", score_mod=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx))
    elif name == "thd":
        tensors, options = _thd_call()
    leaves = tuple(x.detach().clone().requires_grad_() for x in tensors)
    return leaves, {**options, "deterministic": True}


def _equal(name, got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name}: result {i} differs from cuDNN's execute on fresh buffers"


@pytest.mark.parametrize("name", ["plain", "softcap", "alibi", "bias", "thd"])
def test_replays_read_what_their_buffers_hold_now(name):
    """Six steps on the same buffers, their values changed in place each time (inputs, the output's
    gradient, the bias, the THD offsets' lengths): every step's out and gradients equal the same step's
    on fresh buffers, and the later steps were replays."""
    tensors, options = _call(name)
    grad = torch.empty_like(fat.attention(*tensors, **options)).detach()
    values = _values(tensors, grad, options, 6)
    before = core.replay_counts()
    got = _steps_in_place(tensors, grad, options, values)
    after = core.replay_counts()
    want = _fresh_steps(tensors, grad, options, values)
    for step, (g, w) in enumerate(zip(got, want)):
        _equal(f"{name} step {step}", g, w)
    assert after["failed"] == before["failed"], after
    assert after["replayed"] - before["replayed"] >= 4, (before, after)  # forward and backward, later steps


def test_a_new_score_mod_number_is_never_a_stale_replay():
    """The cap is a pass-by-value scalar: part of a launch's key. Three calls with one cap make its
    graph; then each new cap gives the result of that cap, not a replay of the old one."""
    global CAP
    tensors, options = _call("softcap")
    grad = torch.empty_like(fat.attention(*tensors, **options)).detach()
    caps = (30.0, 30.0, 30.0, 30.0, 5.0, 2.0, 30.0, 5.0)
    values = _values(tensors, grad, options, 1) * len(caps)

    def set_cap(step):
        global CAP
        CAP = caps[step]

    before_cap = CAP
    try:
        before = core.replay_counts()
        got = _steps_in_place(tensors, grad, options, values, set_cap)
        after = core.replay_counts()
        want = _fresh_steps(tensors, grad, options, values, set_cap)
    finally:
        CAP = before_cap
    for step, (g, w) in enumerate(zip(got, want)):
        _equal(f"cap {caps[step]}", g, w)
    assert not torch.equal(got[3][0], got[4][0]), "a new cap changed nothing"
    assert after["replayed"] - before["replayed"] >= 2, (before, after)


def test_forward_only_calls_replay_and_match_fresh_buffers():
    tensors, options = _call("plain")
    sources = [[_random(x, 10 * step + i) for i, x in enumerate(tensors)] for step in range(6)]
    before = core.replay_counts()
    with torch.no_grad():
        held = [torch.empty_like(fat.attention(*tensors, **options)) for _ in sources]
        for entry, result in zip(sources, held):
            for x, value in zip(tensors, entry):
                x.copy_(value)
            result.copy_(fat.attention(*tensors, **options))
        after = core.replay_counts()
        fresh = [(entry, fat.attention(*[x.clone() for x in entry], **options)) for entry in sources]
    for step, (got, (_, want)) in enumerate(zip(held, fresh)):
        assert torch.equal(got, want), f"step {step}"
    assert after["replayed"] - before["replayed"] >= 2, (before, after)


def test_the_switch_turns_replays_off():
    script = (
        "import torch, fusedattn.torch as fat\n"
        "from fusedattn.backends.cudnn.native import core\n"
        "q = torch.randn(1, 128, 4, 64, device='cuda', dtype=torch.bfloat16)\n"
        "for _ in range(5):\n"
        "    out = fat.attention(q, q, q, mask='causal')\n"
        "torch.cuda.synchronize()\n"
        "counts = core.replay_counts()\n"
        "assert counts['captured'] == counts['replayed'] == 0 and counts['executed'] >= 5, counts\n"
        "print('ok', counts)\n"
    )
    env = {**os.environ, core.REPLAY_SWITCH: "0"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
