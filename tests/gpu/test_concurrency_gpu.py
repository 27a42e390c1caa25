"""Concurrency and memory with real cuDNN graphs (the CPU half is tests/test_concurrency.py).

1. 10,000 calls over varying shapes: after warm-up, device memory stays flat, no graph is rebuilt,
   and every registered cache stays within its bound; with a tiny graph cache (evicting and
   rebuilding all the time) memory stays flat too.
2. 8 threads (half of them on their own streams) x mixed cuDNN configs give the serial results bit
   for bit, never deadlock, and build each graph once.
3. pointer_run keeps one workspace per (device, stream) and a bounded number of streams.
"""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cudnn")

import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn import pointer_run  # noqa: E402
from fusedattn.backends.cudnn.native import torch_plans  # noqa: E402
from fusedattn.backends.cudnn.runtime import graph_cache  # noqa: E402
from fusedattn.cache import clear_all, registry, sizes  # noqa: E402

pytestmark = pytest.mark.gpu

MIB = 1 << 20
JOIN_TIMEOUT = 300.0  # seconds for all threads together (graph builds included); a deadlock fails the test


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("FUSEDATTN_BACKEND", raising=False)
    clear_all()
    torch.cuda.synchronize()
    yield
    torch.cuda.synchronize()
    clear_all()


def _inputs(sq, skv, seed, dtype=torch.bfloat16, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda s, h: torch.randn(2, s, h, 64, generator=gen, device="cuda").to(dtype).requires_grad_(grad)  # noqa: E731
    return make(sq, 4), make(skv, 2), make(skv, 2)


def _settled_memory() -> tuple[int, int]:
    """(allocated, reserved) bytes once the device is idle, unreachable objects are collected (an evicted
    graph's frontend objects may sit in reference cycles until then) and freed blocks are back in the pool."""
    gc.collect()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda")  # lets the allocator process events of blocks freed with record_stream
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _assert_within_bounds(when: str) -> None:
    for name, (entries, maxsize) in sizes().items():
        assert entries <= maxsize, f"{when}: cache {name} holds {entries} > {maxsize}"
    core, plans = torch_plans.registry_sizes()
    assert core <= torch_plans.PLAN_CAPACITY and plans <= torch_plans.PLAN_CAPACITY, (core, plans)


# --------------------------------------------------------------------------- 1: memory over many calls

SHAPES = [(sq, skv) for sq in (64, 96, 128, 200) for skv in (64, 128, 256)]  # 12 shapes
MASKS = ("none", "causal")
MANY = 10_000


def _step(i, tensors, train):
    sq, skv = SHAPES[i % len(SHAPES)]
    mask = MASKS[(i // len(SHAPES)) % len(MASKS)]
    q, k, v = tensors[(sq, skv)]
    if not train:
        with torch.no_grad():
            return fat.attention(q, k, v, mask=mask)
    out = fat.attention(q, k, v, mask=mask)
    return torch.autograd.grad(out.float().square().sum(), (q, k, v))


def test_ten_thousand_calls_keep_memory_flat_after_warm_up():
    tensors = {shape: _inputs(*shape, seed=shape[0] * 1000 + shape[1], grad=True) for shape in SHAPES}
    combos = len(SHAPES) * len(MASKS)
    for i in range(combos):  # warm-up: every (shape, mask) once, forward and backward
        _step(i, tensors, train=True)
        _step(i, tensors, train=False)
    builds = graph_cache().builds
    allocated, reserved = _settled_memory()
    checkpoints = []
    for i in range(MANY):
        _step(i, tensors, train=i % 10 == 0)
        if i % 1000 == 999:
            now_allocated, now_reserved = _settled_memory()
            assert now_allocated <= allocated, f"call {i}: {now_allocated - allocated} bytes more allocated"
            assert now_reserved <= reserved + 16 * MIB, f"call {i}: {(now_reserved - reserved) / MIB:.1f} MiB more"
            _assert_within_bounds(f"call {i}")
            checkpoints.append(now_allocated)
    # flat: the same bytes at every checkpoint after the first thousand calls
    assert len(set(checkpoints[1:])) == 1, [c - checkpoints[1] for c in checkpoints]
    assert graph_cache().builds == builds, "a warm configuration rebuilt its graph"


def test_a_tiny_graph_cache_evicts_and_rebuilds_without_growing_memory(monkeypatch):
    monkeypatch.setattr(graph_cache(), "maxsize", 2)
    monkeypatch.setenv(torch_plans.ENV_SWITCH, "0")  # the Python path, which looks graphs up on every call
    tensors = {shape: _inputs(*shape, seed=7) for shape in SHAPES[:6]}
    rounds = []
    for _ in range(3):
        for q, k, v in tensors.values():
            with torch.no_grad():
                fat.attention(q, k, v, backend="cudnn")
        rounds.append((*_settled_memory(), torch.cuda.mem_get_info()[0]))
        assert len(graph_cache()) <= 2
    assert graph_cache().builds >= 12, "the graphs were not evicted"
    assert rounds[2][0] == rounds[1][0], "evicted graphs left device memory allocated"
    assert rounds[2][1] <= rounds[1][1] + 16 * MIB
    # Memory cuDNN takes itself (plans, handles) is outside torch's counts: the driver's free memory.
    assert rounds[2][2] >= rounds[1][2] - 64 * MIB, f"{(rounds[1][2] - rounds[2][2]) / MIB:.0f} MiB less free"


# --------------------------------------------------------------------------- 2: threads with cuDNN graphs

CASES = [  # (Sq, Skv, options, with gradients)
    (128, 128, dict(mask="causal"), False),
    (96, 160, dict(mask="causal_bottom_right"), False),
    (64, 64, dict(window=(16, 0)), False),
    (200, 200, dict(), False),
    (128, 128, dict(mask="causal", deterministic=True), True),
    (80, 144, dict(deterministic=True), True),
]
THREADS, CALLS = 8, 500


def _call(case, inputs):
    sq, skv, options, grad = CASES[case]
    q, k, v = inputs[case]
    if not grad:
        with torch.no_grad():
            return (fat.attention(q, k, v, backend="cudnn", **options),)
    out = fat.attention(q, k, v, backend="cudnn", **options)
    return (out.detach(), *torch.autograd.grad(out.float().square().sum(), (q, k, v)))


def test_eight_threads_with_cudnn_graphs_match_serial_calls_bitwise():
    inputs = [_inputs(sq, skv, seed=i, grad=grad) for i, (sq, skv, _, grad) in enumerate(CASES)]
    schedules = [random.Random(t).choices(range(len(CASES)), k=CALLS) for t in range(THREADS)]
    expected = [_call(case, inputs) for case in range(len(CASES))]
    torch.cuda.synchronize()
    clear_all()  # every graph is built again, now by the threads
    builds = graph_cache().builds
    results: list[list] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)

    def work(thread):
        try:
            stream = torch.cuda.Stream() if thread % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.default_stream())  # the inputs were made there
            barrier.wait(timeout=JOIN_TIMEOUT)
            with torch.cuda.stream(stream):
                for case in schedules[thread]:
                    results[thread].append((case, _call(case, inputs)))
            stream.synchronize()
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_TIMEOUT
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    alive = [thread.name for thread in threads if thread.is_alive()]
    assert not alive, f"threads {alive} still running after {JOIN_TIMEOUT} s: a deadlock or a hang"
    if errors:
        raise errors[0]
    torch.cuda.synchronize()
    mismatches = [f"thread {t} call {i} (case {case})" for t, calls in enumerate(results)
                  for i, (case, got) in enumerate(calls)
                  if not all(torch.equal(a, b) for a, b in zip(got, expected[case], strict=True))]
    assert not mismatches, f"{len(mismatches)} threaded calls differ from the serial ones: {mismatches[:5]}"
    # Each graph was built once: nothing was evicted (the cache is large), so builds == graphs held.
    assert graph_cache().builds - builds == len(graph_cache())
    _assert_within_bounds("after the threads")


# --------------------------------------------------------------------------- 3: pointer_run workspaces

def test_pointer_run_keeps_one_workspace_per_stream_and_frees_outgrown_ones():
    stream = torch.cuda.Stream()
    device = torch.cuda.current_device()
    allocated, _ = _settled_memory()
    largest = 0
    for size in (1 * MIB, 3 * MIB, 8 * MIB, 32 * MIB, 64 * MIB, 16 * MIB):
        held = pointer_run._workspace(device, stream.cuda_stream, size)
        assert held.numel() >= size and held.device.index == device
        largest = max(largest, held.numel())
        del held
    assert pointer_run._workspaces.get((device, stream.cuda_stream)).numel() == largest
    now, _ = _settled_memory()
    assert now - allocated <= largest + MIB, f"outgrown workspaces kept: {(now - allocated) / MIB:.1f} MiB"


def test_pointer_run_keeps_workspaces_of_a_bounded_number_of_streams(monkeypatch):
    # torch hands out streams from a pool of 32 per priority: 8 consecutive ones are distinct.
    monkeypatch.setattr(registry["cudnn.pointer_run.workspaces"], "maxsize", 4)
    device = torch.cuda.current_device()
    allocated, _ = _settled_memory()
    streams = [torch.cuda.Stream() for _ in range(8)]
    assert len({s.cuda_stream for s in streams}) == 8
    for stream in streams:
        pointer_run._workspace(device, stream.cuda_stream, 2 * MIB)
    assert len(pointer_run._workspaces) == 4
    now, _ = _settled_memory()
    assert now - allocated <= 4 * 2 * MIB + MIB, "evicted workspaces stayed allocated"
    clear_all()
    now, _ = _settled_memory()
    assert now <= allocated + MIB, "cleared workspaces stayed allocated"
