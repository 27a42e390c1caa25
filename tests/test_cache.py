"""fusedattn.cache.LRUCache: bounded, least-recently-used eviction, built once per key, thread-safe."""

from __future__ import annotations

import threading

import pytest

from fusedattn.cache import LRUCache, kept_while_alive

TIMEOUT = 5.0  # seconds; a deadlock fails the test instead of hanging it


# --------------------------------------------------------------------------- bound and order

def test_put_beyond_maxsize_evicts_the_oldest():
    cache = LRUCache(3)
    for key in "abcd":
        cache.put(key, key.upper())
    assert cache.keys() == ["b", "c", "d"]
    assert len(cache) == 3
    assert "a" not in cache and cache.get("a") is None
    assert cache.get("a", "missing") == "missing"


def test_get_refreshes_recency():
    cache = LRUCache(3)
    for key in "abc":
        cache.put(key, key)
    assert cache.get("a") == "a"
    cache.put("d", "d")
    assert cache.keys() == ["c", "a", "d"]  # b was least recently used
    assert "b" not in cache


def test_get_or_build_hit_refreshes_recency():
    cache = LRUCache(2)
    cache.get_or_build("a", lambda: 1)
    cache.get_or_build("b", lambda: 2)
    cache.get_or_build("a", lambda: pytest.fail("rebuilt a cached key"))
    cache.get_or_build("c", lambda: 3)
    assert cache.keys() == ["a", "c"]


def test_put_existing_key_replaces_and_refreshes():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)
    cache.put("c", 3)
    assert cache.keys() == ["a", "c"]
    assert cache.get("a") == 10


def test_maxsize_one_keeps_only_the_latest():
    cache = LRUCache(1)
    for i in range(5):
        assert cache.get_or_build(i, lambda i=i: i * i) == i * i
    assert cache.keys() == [4]


def test_clear_empties_the_cache():
    cache = LRUCache(4)
    cache.put("a", 1)
    cache.clear()
    assert len(cache) == 0 and cache.keys() == []
    assert cache.get_or_build("a", lambda: 2) == 2


@pytest.mark.parametrize("maxsize", [0, -1, 1.5, "8", None])
def test_maxsize_must_be_a_positive_int(maxsize):
    with pytest.raises(ValueError, match=r"LRUCache: expected maxsize >= 1, got " + repr(maxsize).replace(".", r"\.")):
        LRUCache(maxsize)


# --------------------------------------------------------------------------- build once

def test_get_or_build_builds_once_per_key():
    cache = LRUCache(8)
    built = []

    def build(key):
        built.append(key)
        return object()

    a1 = cache.get_or_build("a", lambda: build("a"))
    a2 = cache.get_or_build("a", lambda: build("a"))
    b = cache.get_or_build("b", lambda: build("b"))
    assert a1 is a2 and a1 is not b
    assert built == ["a", "b"]
    assert cache.builds == 2 and cache.misses == 2 and cache.hits == 1


def test_a_cached_none_is_not_rebuilt():
    """A build may legitimately return None; it is cached like any value."""
    cache = LRUCache(4)
    calls = []
    for _ in range(2):
        assert cache.get_or_build("k", lambda: calls.append(1)) is None
    assert calls == [1]


def test_evicted_key_is_rebuilt():
    cache = LRUCache(1)
    calls = []
    cache.get_or_build("a", lambda: calls.append("a"))
    cache.get_or_build("b", lambda: calls.append("b"))
    cache.get_or_build("a", lambda: calls.append("a"))
    assert calls == ["a", "b", "a"]


def test_nested_build_of_another_key_does_not_deadlock():
    """No lock is held while building: a build may itself use the cache."""
    cache = LRUCache(4)
    outcome = []

    def run():
        outcome.append(cache.get_or_build("outer", lambda: cache.get_or_build("inner", lambda: 1) + 1))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), "nested get_or_build deadlocked"
    assert outcome == [2] and cache.get("inner") == 1


# --------------------------------------------------------------------------- threads

class SlowBuilder:
    """A builder that signals when it starts and finishes only when released."""

    def __init__(self, value):
        self.value = value
        self.started = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self):
        with self.lock:
            self.calls += 1
        self.started.set()
        if not self.release.wait(TIMEOUT):
            raise TimeoutError("builder never released")
        if isinstance(self.value, BaseException):
            raise self.value
        return self.value


def run_threads(n, target):
    """Start n threads that pass a barrier then call target(); return (threads, results, errors)."""
    barrier = threading.Barrier(n)
    results, errors = [], []
    lock = threading.Lock()

    def worker():
        barrier.wait(TIMEOUT)
        try:
            value = target()
        except BaseException as error:  # noqa: BLE001 (recorded for the assertion)
            with lock:
                errors.append(error)
        else:
            with lock:
                results.append(value)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, results, errors


def join(threads):
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"


def test_concurrent_callers_for_one_key_build_once_and_share_the_value():
    cache = LRUCache(4)
    value = object()
    builder = SlowBuilder(value)
    threads, results, errors = run_threads(8, lambda: cache.get_or_build("k", builder))
    assert builder.started.wait(TIMEOUT)
    threading.Event().wait(0.1)  # let the others reach the pending build
    builder.release.set()
    join(threads)
    assert errors == []
    assert len(results) == 8 and all(r is value for r in results)
    assert builder.calls == 1
    assert cache.builds == 1 and cache.keys() == ["k"]


def test_a_slow_build_does_not_block_another_key():
    cache = LRUCache(4)
    slow = SlowBuilder("A")
    t = threading.Thread(target=lambda: cache.get_or_build("a", slow), daemon=True)
    t.start()
    assert slow.started.wait(TIMEOUT)
    # While "a" is still building, other keys build and read freely.
    done = []
    other = threading.Thread(target=lambda: done.append(cache.get_or_build("b", lambda: "B")), daemon=True)
    other.start()
    other.join(TIMEOUT)
    assert done == ["B"], "building key b waited for the build of key a"
    assert cache.get("b") == "B" and "a" not in cache and len(cache) == 1
    slow.release.set()
    t.join(TIMEOUT)
    assert cache.get("a") == "A"


def test_a_failed_build_raises_in_every_waiter_and_is_retried():
    cache = LRUCache(4)
    error = RuntimeError("graph build failed")
    builder = SlowBuilder(error)
    threads, results, errors = run_threads(5, lambda: cache.get_or_build("k", builder))
    assert builder.started.wait(TIMEOUT)
    threading.Event().wait(0.1)
    builder.release.set()
    join(threads)
    assert results == []
    assert len(errors) == 5 and all(e is error for e in errors)
    assert builder.calls == 1
    assert "k" not in cache and cache.builds == 0
    # the next call builds again, and this time it sticks
    assert cache.get_or_build("k", lambda: "ok") == "ok"
    assert cache.get("k") == "ok"


def test_a_failed_build_single_thread_is_not_cached():
    cache = LRUCache(4)

    def fail():
        raise KeyError("nope")

    for _ in range(2):
        with pytest.raises(KeyError):
            cache.get_or_build("k", fail)
    assert len(cache) == 0


def test_many_threads_many_keys_stay_within_bound():
    cache = LRUCache(16)
    counts: dict[int, int] = {}
    lock = threading.Lock()

    def build(key):
        with lock:
            counts[key] = counts.get(key, 0) + 1
        return key * 2

    def work():
        for i in range(200):
            key = i % 8
            assert cache.get_or_build(key, lambda key=key: build(key)) == key * 2

    threads, results, errors = run_threads(8, work)
    join(threads)
    assert errors == []
    assert len(cache) == 8 and len(cache) <= cache.maxsize
    assert counts == {key: 1 for key in range(8)}  # 8 keys fit in 16: each built exactly once


def test_clear_during_a_build_drops_its_result():
    started, release = threading.Event(), threading.Event()
    cache = LRUCache(4)

    def slow_build():
        started.set()
        release.wait(5)
        return "stale"

    results = []
    worker = threading.Thread(target=lambda: results.append(cache.get_or_build("k", slow_build)))
    worker.start()
    assert started.wait(5)
    cache.clear()
    release.set()
    worker.join(5)
    assert results == ["stale"]  # the caller still gets its value
    assert "k" not in cache  # but the cleared cache does not keep it


def test_kept_while_alive_gives_a_result_to_its_own_owner_only():
    class Owner:
        pass

    cache, made = LRUCache(4), []
    first, second = Owner(), Owner()
    make = lambda: made.append(1) or len(made)  # noqa: E731
    assert kept_while_alive(cache, "key", first, make) == 1
    assert kept_while_alive(cache, "key", first, make) == 1  # kept
    assert kept_while_alive(cache, "key", second, make) == 2  # another object under the same key (a reused id)
    del second
    assert kept_while_alive(cache, "key", Owner(), make) == 3  # its owner gone: never given to a newcomer


# --------------------------------------------------------------------------- at exit

_EXIT_SCRIPT = """
import sys, types
from unittest import mock

frontend = types.ModuleType("cudnn")  # the frontend is not installed here: its names are mocks
frontend.__getattr__ = lambda name: mock.MagicMock(name=name)
sys.modules["cudnn"] = frontend
from fusedattn.backends.cudnn import graph_cache


class FrontendObject:  # stands for a built graph, which nanobind reports if it outlives the atexit phase
    def __del__(self):
        print(f"released finalizing={sys.is_finalizing()}", flush=True)


graph_cache.graph_cache().put("graph", FrontendObject())
graph_cache._local.handles = {0: FrontendObject()}
cycle = [FrontendObject()]  # held by a reference cycle only, as a kept traceback's frames hold graphs
cycle.append(cycle)
del cycle
"""


def test_the_cudnn_objects_kept_are_released_before_the_interpreter_finalizes(tmp_path):
    """At exit the graph cache, this thread's handles and reference cycles let go of their cuDNN frontend
    objects while atexit handlers run; kept until the frontend's module is torn down, nanobind would report each as
    leaked (bench_score_mod printed 333 on the H200)."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_EXIT_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n").count("released finalizing=False") == 3, done.stdout + done.stderr
