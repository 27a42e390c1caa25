"""FastLaunch (backends/fast_launch.py): Triton launches the first call of each specialization; later
calls of the same specialization go straight to the kept compiled kernel, with every argument in the
kernel's order; a new specialization (alignment, int width or divisibility, constexprs) goes to Triton."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusedattn.backends.fast_launch import FastLaunch  # noqa: E402


class FakeKernel:
    packed_metadata = "metadata"
    function = "handle"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("fast", args))


class FakeJit:
    arg_names = ["X", "n", "scale", "BLOCK", "FLAG"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.log.append(("triton", grid, args, constexprs))
            return FakeKernel(self.log)
        return launch


@pytest.fixture
def stream(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: types.SimpleNamespace(cuda_stream=7))


def test_the_same_specialization_launches_the_kept_kernel_with_every_argument(stream):
    jit = FakeJit()
    launch = FastLaunch(jit)
    x = torch.zeros(64)
    launch((3,), x, 32, 0.5, BLOCK=16, FLAG=True)
    launch((3, 2), x, 48, 0.25, FLAG=True, BLOCK=16)  # same specialization: 48 % 16 == 0, as 32
    assert [entry[0] for entry in jit.log] == ["triton", "fast"]
    assert jit.log[1][1] == (3, 2, 1, 7, "handle", "metadata", None, None, None, x, 48, 0.25, 16, True)


@pytest.mark.parametrize("change", ["unaligned", "indivisible", "one", "wide", "constexpr", "dtype"])
def test_a_new_specialization_goes_to_triton(stream, change):
    jit = FakeJit()
    launch = FastLaunch(jit)
    base = torch.zeros(64)
    launch((1,), base, 32, 0.5, BLOCK=16, FLAG=True)
    args = {"unaligned": (base[1:], 32), "indivisible": (base, 33), "one": (base, 1), "wide": (base, 2**32),
            "constexpr": (base, 32), "dtype": (base.half(), 32)}[change]
    launch((1,), *args, 0.5, BLOCK=32 if change == "constexpr" else 16, FLAG=True)
    assert [entry[0] for entry in jit.log] == ["triton", "triton"]


def test_the_interpreter_always_goes_through_triton(stream):
    calls = []

    class Interpreted(FakeJit):
        def __getitem__(self, grid):
            return lambda *args, **constexprs: calls.append(args)  # returns None, as the interpreter does

    launch = FastLaunch(Interpreted())
    for _ in range(3):
        launch((1,), torch.zeros(4), 4, 1.0, BLOCK=4, FLAG=False)
    assert len(calls) == 3


def test_a_launch_hook_sends_every_call_to_triton(stream, monkeypatch):
    from triton import knobs

    jit = FakeJit()
    launch = FastLaunch(jit)
    hook = types.SimpleNamespace(calls=[print])  # a chain with a hook in it (a profiler's)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", hook)
    for _ in range(2):
        launch((1,), torch.zeros(4), 4, 1.0, BLOCK=4, FLAG=False)
    assert [entry[0] for entry in jit.log] == ["triton", "triton"]
