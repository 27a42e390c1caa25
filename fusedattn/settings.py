"""Reading fusedattn's environment variables on the hot path.

Settings that change what a call does (a forced backend, THD bucketing) are part of the keys they
affect, so each repeat call reads them: `value(name)` does that in one dict lookup, on the process
environment's own mapping where Python keeps one (os.environ._data, updated by os.environ and
monkeypatch alike), instead of os.environ.get's encode-and-decode round trip.
"""

from __future__ import annotations

import os

__all__ = ["value"]

_RAW = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_KEYS: dict = {}  # name -> the raw mapping's key for it


def value(name: str) -> str | None:
    """os.environ.get(name), read cheaply."""
    if _RAW is None or _ENCODE is None or _DECODE is None:
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    raw = _RAW.get(key)
    return None if raw is None else _DECODE(raw)
