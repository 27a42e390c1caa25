"""A bounded, thread-safe LRU cache whose values are built once per key, and the registry of
every such cache in fusedattn.

Concurrent callers asking for the same missing key wait for one build; callers
for other keys are never blocked by it (no lock is held while building).

Each module-level cache registers itself where it is created (`register(name, cache)`), so
`sizes()` shows every cache with its bound and `clear_all()` empties them all. Every cache's
owner must tolerate a cleared (or evicted) entry at any time: the next use rebuilds it.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["LRUCache", "registry", "register", "clear_all", "sizes", "kept_while_alive"]

V = TypeVar("V")


class _Pending:
    """A build in progress: other callers for the same key wait on `done`."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value = None
        self.error: BaseException | None = None


class LRUCache(Generic[V]):
    def __init__(self, maxsize: int) -> None:
        if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
            raise ValueError(f"LRUCache: expected maxsize >= 1, got {maxsize!r}")
        self.maxsize = maxsize
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self._pending: dict[Hashable, _Pending] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.builds = 0
        self._generation = 0  # bumped by clear(): builds started before it are not kept
        self._when_cleared: list[Callable[[], None]] = []  # caches built on this one's entries (clear())

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._items

    def get(self, key: Hashable, default=None):
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            return default

    def peek(self, key: Hashable, default=None):
        """The value for `key` without the lock and without marking it recently used: for a hot path
        whose keys are re-inserted when built (one dict read, atomic under the GIL)."""
        return self._items.get(key, default)

    def put(self, key: Hashable, value: V) -> None:
        with self._lock:
            self._insert(key, value)

    def get_or_build(self, key: Hashable, build: Callable[[], V]) -> V:
        """Return the cached value for `key`, building it once if absent.

        A failed build is not cached: its exception reaches every caller that
        waited on it, and the next call tries again.
        """
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                self.hits += 1
                return self._items[key]
            pending = self._pending.get(key)
            owner = pending is None
            generation = self._generation
            if owner:
                pending = self._pending[key] = _Pending()
                self.misses += 1
        if not owner:
            pending.done.wait()
            if pending.error is not None:
                raise pending.error
            return pending.value
        try:
            value = build()
        except BaseException as error:
            pending.error = error
            with self._lock:
                del self._pending[key]
            pending.done.set()
            raise
        pending.value = value
        with self._lock:
            self.builds += 1
            if generation == self._generation:
                self._insert(key, value)
            del self._pending[key]
        pending.done.set()
        return value

    def pop(self, key: Hashable) -> None:
        """Drop one entry, if present."""
        with self._lock:
            self._items.pop(key, None)

    def clear(self) -> None:
        """Drop every entry; builds in progress still answer their callers but are not kept. What was
        made from the entries goes too (when_cleared)."""
        with self._lock:
            self._items.clear()
            self._generation += 1
        for dependent in self._when_cleared:
            dependent()

    def when_cleared(self, dependent: Callable[[], None]) -> None:
        """Calls `dependent` whenever this cache is cleared: it drops what it made from the entries."""
        self._when_cleared.append(dependent)

    def keys(self) -> list:
        with self._lock:
            return list(self._items)

    def _insert(self, key: Hashable, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.maxsize:
            self._items.popitem(last=False)


# name -> cache. Bounded by the modules that create caches: one entry each, registered at import.
registry: dict[str, LRUCache] = {}
_registry_lock = threading.Lock()


def register(name: str, cache: LRUCache) -> LRUCache:
    """Add a module-level cache to the registry under `name` (a module re-imported replaces its
    entry); returns the cache."""
    if not isinstance(cache, LRUCache):
        raise ValueError(f"fusedattn.cache.register: expected an LRUCache (bounded) for {name!r}, "
                         f"got {type(cache).__name__}")
    with _registry_lock:
        registry[name] = cache
    return cache


def clear_all() -> None:
    """Empty every registered cache (builds in progress answer their callers but are not kept)."""
    with _registry_lock:
        caches = list(registry.values())
    for cache in caches:
        cache.clear()


def sizes() -> dict[str, tuple[int, int]]:
    """name -> (entries, maxsize) of every registered cache."""
    with _registry_lock:
        caches = list(registry.items())
    return {name: (len(cache), cache.maxsize) for name, cache in caches}


def kept_while_alive(cache: LRUCache, key: Hashable, owner, make: Callable[[], V]) -> V:
    """make()'s result for `owner`, kept in cache under key (which names owner by id) while owner lives:
    a new object at a reused id is never given another's result. owner is held weakly."""
    hit = cache.get(key)
    if hit is not None and hit[0]() is owner:
        return hit[1]
    value = make()
    cache.put(key, (weakref.ref(owner), value))
    return value
