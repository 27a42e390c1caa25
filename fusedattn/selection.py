"""Choosing a backend for a call: ordered probing, reasons, overrides and a decision cache.

    select_backend(cfg)             -> Selection(backend, rejected={name: reasons})
    select_backend(cfg, "cudnn")    forces one backend; raises NoBackendError with its reasons
    explain(cfg)                    the whole table as text; never raises

Environment: FUSEDATTN_BACKEND=<name> forces a backend where the call names none
(a debugging override); FUSEDATTN_LOG=1 logs each new decision once.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from fusedattn.backends import BACKENDS, Backend, backend_names, get_backend
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig
from fusedattn.score_mods.key import dense_aux_notes

__all__ = ["Selection", "NoBackendError", "select_backend", "explain", "clear_decisions", "probe_all"]

ENV_BACKEND = "FUSEDATTN_BACKEND"
ENV_LOG = "FUSEDATTN_LOG"
DECISION_CACHE_SIZE = 4096

logger = logging.getLogger("fusedattn")
_decisions: LRUCache = register("selection.decisions", LRUCache(DECISION_CACHE_SIZE))
# Frontends remember (config, selection) per call signature (shapes, dtypes, options) so a
# repeated call skips validation and config building; cleared with the decisions.
_calls: LRUCache = register("selection.calls", LRUCache(DECISION_CACHE_SIZE))


def recall_call(signature):
    """What was remembered for a call signature (its config, selection and native plan), or None.
    Read without marking the entry recent: the hot path of every repeat call."""
    return _calls.peek(signature)


def remember_call(signature, planned) -> None:
    _calls.put(signature, planned)


def forget_calls() -> None:
    """Drop every remembered call: one holds a native plan the library evicted, under a signature its
    caller does not have (a call run as part of another), so the next calls plan again."""
    _calls.clear()


@dataclass(frozen=True)
class Selection:
    """The backend chosen for a config, and why each other backend was not."""

    backend: Backend
    rejected: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    forced_by: str | None = None  # "backend='x'" or "FUSEDATTN_BACKEND=x" when forced

    @property
    def name(self) -> str:
        return self.backend.name


class NoBackendError(ValueError):
    """No backend can run the call (or the forced one cannot). The message lists every reason."""

    def __init__(self, message: str, cfg: AttentionConfig, reasons: Mapping[str, tuple[str, ...]]):
        super().__init__(message)
        self.cfg = cfg
        self.reasons = dict(reasons)


def _forced_name(backend: str | None) -> tuple[str | None, str | None]:
    """(name, how it was forced) from the argument, else the environment, else (None, None)."""
    if backend is not None:
        get_backend(backend)  # validates the name
        return backend, f"backend={backend!r}"
    env = os.environ.get(ENV_BACKEND, "").strip()
    if env:
        if env not in backend_names():
            raise ValueError(
                f"{ENV_BACKEND}: expected one of {', '.join(backend_names())}, got {env!r}"
            )
        return env, f"{ENV_BACKEND}={env}"
    return None, None


def probe_all(cfg: AttentionConfig) -> dict[str, list[str]]:
    """Every backend's reasons for `cfg`, in selection order (probes each one)."""
    return {b.name: b.supports(cfg) for b in BACKENDS}


CallLines = Sequence[str] | Callable[[], Sequence[str]]


def _decide(cfg: AttentionConfig, forced: str | None, forced_by: str | None,
            call_lines: CallLines) -> Selection:
    if forced is not None:
        reasons = get_backend(forced).supports(cfg)
        if reasons:
            raise NoBackendError(
                format_no_backend(f"backend {forced!r} cannot run this call (forced by {forced_by})",
                                  cfg, {forced: reasons}, call_lines),
                cfg, {forced: tuple(reasons)},
            )
        return Selection(get_backend(forced), {}, forced_by)
    rejected: dict[str, tuple[str, ...]] = {}
    for backend in BACKENDS:
        reasons = backend.supports(cfg)
        if not reasons:
            for later in BACKENDS[BACKENDS.index(backend) + 1:]:
                rejected[later.name] = (f"not probed: {backend.name} comes first in the order",)
            return Selection(backend, rejected)
        rejected[backend.name] = tuple(reasons)
    raise NoBackendError(format_no_backend("no backend can run this call", cfg, rejected, call_lines),
                         cfg, rejected)


def select_backend(cfg: AttentionConfig, backend: str | None = None, *,
                   call_lines: CallLines = ()) -> Selection:
    """Choose the backend for `cfg`: the first in order with no reasons, or the forced one.

    `call_lines` (or a function returning them, called only on error) describe the
    call's tensors for the error message. Decisions are
    cached per (config, forced backend); failures are not cached.
    """
    forced, forced_by = _forced_name(backend)
    key = (cfg, forced)
    def decide_and_announce() -> Selection:  # runs once per key, even under concurrent callers
        decided = _decide(cfg, forced, forced_by, call_lines)
        _announce(cfg, decided)
        return decided

    return _decisions.get_or_build(key, decide_and_announce)


def _stacklevel_outside_package() -> int:
    """The warnings stacklevel of the first frame outside fusedattn: the user's call."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _announce(cfg: AttentionConfig, selection: Selection) -> None:
    """Say once per decision what was chosen; warn when a GPU call falls back to the reference."""
    if os.environ.get(ENV_LOG, "") not in ("", "0"):
        # The variable asks for these records: let them through even where the
        # application configured logging at WARNING; print them where nothing is configured.
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
        if not logger.handlers and not logging.getLogger().handlers:
            logger.addHandler(logging.StreamHandler(sys.stderr))
        rejected = "; ".join(f"{n}: {', '.join(r)}" for n, r in selection.rejected.items())
        how = f" (forced by {selection.forced_by})" if selection.forced_by else ""
        logger.info("fusedattn: %s -> %s%s; others: %s", cfg.summary(), selection.name, how, rejected or "-")
    if selection.name == "reference" and cfg.device == "cuda" and selection.forced_by is None:
        reasons = "; ".join(f"{n}: {r[0]}" for n, r in selection.rejected.items() if r)
        warnings.warn(
            f"fusedattn: no fused backend supports this call, so it runs on the unfused reference "
            f"(slow, memory-hungry). {reasons}. fusedattn.torch.explain(q, k, v, **the same keywords) (or "
            f"fusedattn.explain(cfg)) shows the full table.",
            RuntimeWarning, stacklevel=_stacklevel_outside_package(),
        )


def clear_decisions() -> None:
    """Forget cached decisions (after installing a package, or in tests)."""
    _decisions.clear()
    _calls.clear()


def _indent_reasons(table: Mapping[str, Sequence[str]], verdicts: Mapping[str, str] | None = None,
                    notes: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    lines = []
    for name, reasons in table.items():
        verdict = (verdicts or {}).get(name)
        lines.append(f"  {name}:" + (f" {verdict}" if verdict else ""))
        lines.extend(f"    - {reason}" for reason in reasons)
        lines.extend(f"    note: {note}" for note in (notes or {}).get(name, ()))
    return lines


def format_no_backend(title: str, cfg: AttentionConfig, table: Mapping[str, Sequence[str]],
                      call_lines: CallLines = ()) -> str:
    """The fixed shape of a "no backend" error: call summary, attributes, then every backend's reasons."""
    if callable(call_lines):
        call_lines = call_lines()
    lines = [f"fusedattn: {title}"]
    lines.extend(f"  {line}" for line in call_lines)
    lines.append(f"  attributes: {cfg.summary()}")
    lines.append("backends:")
    lines.extend(_indent_reasons(table))
    return "\n".join(lines)


def explain(cfg: AttentionConfig, backend: str | None = None) -> str:
    """The selection table for `cfg` as text: what is chosen and every backend's reasons. Never raises."""
    try:
        forced, forced_by = _forced_name(backend)
    except ValueError as error:
        return f"config: {cfg.summary()}\nerror: {error}"
    table = probe_all(cfg)
    verdicts: dict[str, str] = {}
    chosen = None
    if forced is not None:
        chosen = forced if not table[forced] else None
    else:
        chosen = next((name for name, reasons in table.items() if not reasons), None)
    for name, reasons in table.items():
        if name == chosen:
            verdicts[name] = "selected" + (f" (forced by {forced_by})" if forced_by else "")
        elif reasons:
            verdicts[name] = "rejected"
        elif forced is not None:
            verdicts[name] = f"supported (not used: forced by {forced_by})"
        else:
            verdicts[name] = f"supported (not used: {chosen} comes first)"
    lines = [f"config: {cfg.summary()}"]
    if chosen is None:
        if forced:
            lines.append(f"selected: none; backend {forced!r} (forced by {forced_by}) cannot run this call, "
                         "which raises NoBackendError")
        else:
            lines.append("selected: none; no backend can run this call, which raises NoBackendError")
    else:
        lines.append(f"selected: {chosen}")
    recipe = cfg.score_mod_recipe
    if recipe is not None:
        lines.extend(dense_aux_notes(recipe.aux))
    lines.append("backends (in selection order):")
    notes = {name: get_backend(name).notes(cfg) for name, reasons in table.items() if not reasons}
    lines.extend(_indent_reasons(table, verdicts, notes))
    return "\n".join(lines)
