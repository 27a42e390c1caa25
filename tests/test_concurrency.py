"""Concurrency and memory on the CPU: threads get the serial results, one build per cached key,
every module-level cache bounded and registered, clear_all empties them all.

The GPU half (cuDNN graphs from 8 threads, device memory flat over 10,000 calls) is
tests/gpu/test_concurrency_gpu.py.
"""

from __future__ import annotations

import ast
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import fusedattn  # noqa: E402
import fusedattn.jax.native  # noqa: E402,F401  (registers its cache)
import fusedattn.selection as selection  # noqa: E402
import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn import pointer_run  # noqa: E402
from fusedattn.backends.cudnn.native import torch_plans  # noqa: E402,F401  (registers its cache)
from fusedattn.cache import LRUCache, clear_all, registry, sizes  # noqa: E402
from fusedattn.config import AttentionConfig  # noqa: E402
from fusedattn.torch import ops  # noqa: E402

try:  # the cuDNN runtime's caches register only where its Python package is installed
    from fusedattn.backends.cudnn import runtime, torch_run  # noqa: F401
    HAS_CUDNN = True
except ImportError:
    HAS_CUDNN = False

THREADS, CALLS = 8, 500
JOIN_TIMEOUT = 30.0  # seconds for all threads together; a deadlock fails instead of hanging CI
SMALL = 4  # every cache's capacity in the contention tests: constant eviction

EXPECTED_CACHES = {"selection.decisions", "selection.calls", "torch.ops.configs", "cudnn.pointer_run.eligible",
                   "cudnn.pointer_run.workspaces", "jax.native.plans", "cudnn.native.torch_plans",
                   "score_mods.flex.traces", "torch.documents.boundaries"}
CUDNN_CACHES = {"cudnn.graphs", "cudnn.torch_run.plans"}


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("FUSEDATTN_BACKEND", raising=False)
    clear_all()
    yield
    clear_all()


@pytest.fixture
def small_caches(monkeypatch):
    """Every registered cache shrunk to SMALL entries for the test (restored after)."""
    for cache in registry.values():
        monkeypatch.setattr(cache, "maxsize", SMALL)


def _run_threads(work, threads: int = THREADS) -> None:
    """Run work(index) on `threads` threads started together; re-raise the first error; fail on a hang."""
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def body(index):
        try:
            barrier.wait(timeout=JOIN_TIMEOUT)
            work(index)
        except BaseException as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    started = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(threads)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: races show up in fewer calls
    try:
        for thread in started:
            thread.start()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for thread in started:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        sys.setswitchinterval(switch)
    alive = [thread.name for thread in started if thread.is_alive()]
    assert not alive, f"threads {alive} still running after {JOIN_TIMEOUT} s: a deadlock or a hang"
    if errors:
        raise errors[0]


# --------------------------------------------------------------------------- the registry

def test_every_module_level_lru_cache_is_registered():
    """A source scan: each module-level LRUCache in fusedattn/ goes through fusedattn.cache.register."""
    package = Path(fusedattn.__file__).parent
    unregistered = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        registered = {node.value.args[1].id for node in tree.body
                      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                      and getattr(node.value.func, "id", None) == "register" and len(node.value.args) == 2
                      and isinstance(node.value.args[1], ast.Name)}
        for node in tree.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            calls = [n for n in ast.walk(node.value) if isinstance(n, ast.Call)]
            if not any(getattr(call.func, "id", None) == "LRUCache" for call in calls):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            wrapped = getattr(node.value.func, "id", None) == "register" if isinstance(node.value, ast.Call) else False
            if not wrapped and not set(names) & registered:
                unregistered.append(f"{path.relative_to(package.parent)}:{node.lineno} {names}")
    assert not unregistered, "module-level LRUCaches not in fusedattn.cache.registry: " + ", ".join(unregistered)


def test_the_registry_holds_every_cache_imported_here_each_bounded():
    expected = EXPECTED_CACHES | (CUDNN_CACHES if HAS_CUDNN else set())
    assert expected <= set(registry)
    for name, (entries, maxsize) in sizes().items():
        assert isinstance(registry[name], LRUCache), name
        assert 1 <= maxsize and entries <= maxsize, (name, entries, maxsize)


def test_clear_all_empties_every_registered_cache():
    q = torch.randn(1, 5, 2, 8)
    fat.attention(q, q, q, mask="causal")
    cfg = AttentionConfig("float32", "bshd", 1, 5, 5, 2, 2, 8, 8)
    ops.register_config(cfg, "reference")
    pointer_run.runs_from_addresses(cfg)
    for name, cache in registry.items():  # the GPU-only caches too
        cache.put(("test entry", name), object())
    assert all(entries >= 1 for entries, _ in sizes().values()), sizes()
    clear_all()
    assert {name: entries for name, (entries, _) in sizes().items() if entries} == {}
    out = fat.attention(q, q, q, mask="causal")  # everything rebuilds on the next call
    assert torch.equal(out, fat.attention(q, q, q, mask="causal", backend="reference"))


# --------------------------------------------------------------------------- threads

def _tensors(seed, q_shape, kv_shape, dtype, grad, extra_shapes):
    gen = torch.Generator().manual_seed(seed)
    make = lambda shape: torch.randn(shape, generator=gen).to(dtype).requires_grad_(grad)  # noqa: E731
    return make(q_shape), make(kv_shape), make(kv_shape), {name: make(s) for name, s in extra_shapes.items()}


# (q shape, kv shape, dtype, options, extra tensors' shapes, with gradients): shapes, masks, dtypes,
# layouts and options mixed; backend=None goes through selection, "reference" forces it.
CASES = [
    ((1, 7, 2, 8), (1, 7, 2, 8), torch.float32, {}, {}, False),
    ((2, 5, 4, 8), (2, 9, 2, 8), torch.float32, dict(mask="causal"), {}, True),
    ((1, 6, 2, 16), (1, 6, 2, 16), torch.float64, dict(mask="causal_bottom_right", return_lse=True), {}, False),
    ((1, 8, 2, 8), (1, 8, 2, 8), torch.bfloat16, dict(window=(2, 1)), {}, False),
    ((1, 4, 2, 8), (1, 12, 1, 8), torch.float32, dict(backend="reference", mask="causal", scale=0.3), {}, True),
    ((1, 6, 2, 8), (1, 6, 2, 8), torch.float32, dict(bias_type="post_scale"), {"bias": (1, 2, 6, 6)}, True),
    ((1, 2, 5, 8), (1, 2, 5, 8), torch.float16, dict(layout="bhsd", mask="causal"), {}, False),
    ((5, 1, 2, 8), (5, 1, 2, 8), torch.float32, dict(layout="sbhd", softmax_type="off_by_one"), {}, False),
    ((1, 6, 2, 8), (1, 6, 2, 8), torch.float32, dict(softmax_type="learnable"), {"sink": (2,)}, True),
    ((1, 3, 2, 8), (1, 10, 2, 8), torch.float64, dict(backend="reference", window=(4, 0), return_lse=True), {},
     False),
]


def _call(case_index, inputs):
    """One call of a case: its outputs, then the gradients of its inputs when it has them."""
    q_shape, kv_shape, dtype, options, extra_shapes, grad = CASES[case_index]
    q, k, v, extra = inputs[case_index]
    result = fat.attention(q, k, v, **options, **extra)
    outs = tuple(result) if isinstance(result, tuple) else (result,)
    outs = tuple(x for x in outs if x is not None)
    if not grad:
        return tuple(x.detach() for x in outs)
    leaves = [q, k, v, *extra.values()]
    grads = torch.autograd.grad(outs[0].float().square().sum(), leaves)
    return tuple(x.detach() for x in outs) + grads


def _schedule(thread: int) -> list[int]:
    """The case of each of a thread's calls: every thread mixes every case, in its own order."""
    order = random.Random(thread).choices(range(len(CASES)), k=CALLS)
    return order


def test_threads_with_small_caches_match_serial_calls_bitwise(small_caches):
    inputs = [_tensors(i, *case[:2], case[2], case[5], case[4]) for i, case in enumerate(CASES)]
    schedules = [_schedule(t) for t in range(THREADS)]
    expected = [[_call(case, inputs) for case in schedule] for schedule in schedules]  # the same calls, serially
    clear_all()
    mismatches: list[str] = []

    def work(thread):
        for call, case in enumerate(schedules[thread]):
            got = _call(case, inputs)
            want = expected[thread][call]
            if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
                mismatches.append(f"thread {thread} call {call} (case {case})")

    _run_threads(work)
    assert not mismatches, f"{len(mismatches)} threaded calls differ from the serial ones: {mismatches[:5]}"
    for name, (entries, maxsize) in sizes().items():
        assert entries <= maxsize == SMALL, (name, entries, maxsize)


def test_concurrent_calls_of_one_config_make_one_decision(monkeypatch):
    """Through the public call: 8 threads start together on the same new configs; each config is
    decided (its backends probed) once, however many threads wait for it."""
    decided: Counter = Counter()
    lock = threading.Lock()
    original = selection._decide

    def slow_decide(cfg, forced, forced_by, call_lines):
        with lock:
            decided[(cfg.seqlen_q, forced)] += 1
        time.sleep(0.05)  # a probe that takes a while: the other threads arrive meanwhile
        return original(cfg, forced, forced_by, call_lines)

    monkeypatch.setattr(selection, "_decide", slow_decide)
    tensors = {s: torch.randn(1, s, 2, 8) for s in (3, 4, 5)}
    results = [[] for _ in range(THREADS)]

    def work(thread):
        for s, x in tensors.items():
            results[thread].append(fat.attention(x, x, x, backend="reference" if s == 5 else None))

    _run_threads(work)
    assert decided == {(3, None): 1, (4, None): 1, (5, "reference"): 1}
    assert all(all(torch.equal(a, b) for a, b in zip(r, results[0])) for r in results)


def test_lru_cache_builds_a_key_once_while_it_stays_cached():
    """A builder that sleeps and counts, 8 threads x 500 lookups over 6 keys in 4 slots: a key is built
    only when it is not cached, never twice at once, and every caller gets that key's value."""
    cache = LRUCache(SMALL)
    lock = threading.Lock()
    in_flight: set = set()
    violations: list[str] = []
    built: Counter = Counter()

    def builder(key):
        def build():
            with lock:
                if key in in_flight:
                    violations.append(f"{key}: two builds at once")
                in_flight.add(key)
            if key in cache:
                violations.append(f"{key}: built while cached")
            time.sleep(0.0005)
            with lock:
                in_flight.discard(key)
                built[key] += 1
            return ("value", key)
        return build

    def work(thread):
        rng = random.Random(thread)
        for _ in range(CALLS):
            key = rng.randrange(6)
            value = cache.get_or_build(key, builder(key))
            if value != ("value", key):
                violations.append(f"{key}: got {value!r}")

    _run_threads(work)
    assert not violations, violations[:5]
    assert sum(built.values()) == cache.builds == cache.misses
    assert len(cache) <= SMALL


def test_concurrent_callers_of_one_missing_key_share_one_build():
    cache = LRUCache(SMALL)
    builds = []

    def build():
        builds.append(1)
        time.sleep(0.05)
        return object()

    values = [None] * THREADS

    def work(thread):
        values[thread] = cache.get_or_build("key", build)

    _run_threads(work)
    assert len(builds) == 1
    assert all(value is values[0] for value in values)


# --------------------------------------------------------------------------- bounds

# 10,000 public calls take about 5 s here (2 cores): each one is a new configuration (Sq, Skv, mask),
# so every per-config cache meets its real bound (4096) more than twice over.
MANY = 10_000


def test_ten_thousand_calls_keep_every_cache_within_its_bound():
    base_q, base_kv = torch.randn(1, 200, 1, 8), torch.randn(1, 200, 1, 8)
    masks = ("none", "causal", "causal_bottom_right")
    peak: Counter = Counter()
    for i in range(MANY):
        sq, skv = 1 + i % 200, 1 + (i // 200 + i) % 200  # (Sq, Skv, mask) never repeats
        mask = masks[i % 3]
        fat.attention(base_q[:, :sq], base_kv[:, :skv], base_kv[:, :skv], mask=mask)
        # What a compiled model and the JAX bridge would register for the same call.
        cfg = AttentionConfig("float32", "bshd", 1, sq, skv, 1, 1, 8, 8, mask=mask)
        ops.register_config(cfg, "reference")
        pointer_run.runs_from_addresses(cfg)
        if i % 250 == 0 or i == MANY - 1:
            for name, (entries, maxsize) in sizes().items():
                assert entries <= maxsize, f"call {i}: cache {name} holds {entries} > {maxsize}"
                peak[name] = max(peak[name], entries)
    for name in ("selection.decisions", "selection.calls", "torch.ops.configs", "cudnn.pointer_run.eligible"):
        assert peak[name] == registry[name].maxsize, (name, peak[name])  # the bound was reached, and held


# --------------------------------------------------------------------------- compiled graphs and eviction

def test_a_compiled_graph_outlives_its_config_in_the_bounded_cache(monkeypatch):
    """The compiled graph keeps its config key after the cache drops it (evicted by another shape,
    then cleared between forward and backward): the key is rebuilt from its own text."""
    monkeypatch.setattr(ops._CONFIGS, "maxsize", 1)

    def step(q, k, v):
        return fat.attention(q, k, v, mask="causal")

    def inputs(s):
        gen = torch.Generator().manual_seed(s)
        return [torch.randn(1, s, 2, 8, generator=gen, requires_grad=True) for _ in range(3)]

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)
    a, b = inputs(6), inputs(9)
    compiled(*a)
    compiled(*b)  # a second graph: its config evicts the first one's
    assert len(ops._CONFIGS) == 1
    out = compiled(*a)
    clear_all()
    grads = torch.autograd.grad(out.square().sum(), a)
    eager = step(*a)
    assert torch.equal(out, eager)
    for got, want in zip(grads, torch.autograd.grad(eager.square().sum(), a)):
        assert torch.equal(got, want)
    torch._dynamo.reset()


def test_register_config_keys_spell_out_the_config():
    cfg = AttentionConfig("bfloat16", "sbhd", 2, 5, 7, 4, 2, 16, 8, mask="causal_bottom_right", window=(3, 0),
                          bias="post_scale", bias_shape=(1, 4, 5, 7), scale=0.123456789, is_training=True,
                          unaligned=("q",))
    key = ops.register_config(cfg, "reference")
    assert key.startswith("reference:") and "causal_bottom_right" in key
    ops._CONFIGS.clear()
    assert ops.config_of(key) == cfg


@pytest.mark.parametrize("score_mod", [dict(score_mod_key=("callback", object())),
                                       dict(score_mod_key=("softcap", 30.0), score_mod_recipe=object())],
                         ids=["key-not-literals", "recipe"])
def test_an_evicted_key_that_cannot_be_rebuilt_says_what_to_do(score_mod):
    """Configs that are more than literals (a score_mod's structural key, or its recipe of callbacks,
    which equality ignores) are named by digest: once dropped, the error says how to register again."""
    cfg = AttentionConfig("float32", "bshd", 1, 4, 4, 1, 1, 8, 8, **score_mod)
    key = ops.register_config(cfg, "reference")
    assert ":#" in key
    assert ops.config_of(key) == cfg
    ops._CONFIGS.clear()
    with pytest.raises(RuntimeError, match=r"no longer registered .*register_config.*torch._dynamo.reset\(\)"):
        ops.config_of(key)
