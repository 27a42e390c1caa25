"""Building cuDNN graphs and keeping them: handles per device and thread, the bounded graph cache,
and the probe that proves support by building. No framework here: torch and JAX calls build the
same graphs the same way (the device is made current through the CUDA driver, cuda_driver.py)."""

from __future__ import annotations

import atexit
import gc
import os
import threading

import cudnn

from fusedattn.backends.cudnn import cuda_driver
from fusedattn.backends.cudnn.graphs import BuiltGraph, GraphBuildError, build_backward, build_forward
from fusedattn.backends.cudnn.spec import graph_key, sdpa_spec
from fusedattn.cache import LRUCache, clear_all, register
from fusedattn.config import AttentionConfig

__all__ = ["graph_cache", "handle", "build_lock", "get_graph", "probe", "current_device"]

ENV_CACHE_SIZE = "FUSEDATTN_CUDNN_CACHE_SIZE"
_graphs: LRUCache = register("cudnn.graphs", LRUCache(int(os.environ.get(ENV_CACHE_SIZE, "256"))))
# Not caches, so not in the registry: one lock per device index (bounded by the device count),
# and per thread one cuDNN handle per device (bounded by devices; freed with the thread).
_build_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()
_local = threading.local()


def graph_cache() -> LRUCache:
    return _graphs


def _release_at_exit() -> None:
    """Drops the cuDNN frontend objects this library keeps (built graphs in its caches, this thread's
    handles) while the interpreter still runs: kept until the frontend's module is torn down, each is
    reported as leaked there ("nanobind: leaked N instances!"). Registered after the frontend imported,
    so it runs before anything the frontend registered. A collection then frees the graphs that only
    reference cycles still hold (a kept exception's traceback and the frames it holds, for one)."""
    clear_all()
    handles = getattr(_local, "handles", None)
    if handles:
        handles.clear()
    gc.collect()


atexit.register(_release_at_exit)


def handle(device: int, stream: int | None = None):
    """This thread's cuDNN handle for `device`; bound to `stream` when one is given."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    if device not in handles:
        with cuda_driver.on_device(device):
            handles[device] = cudnn.create_handle()
    if stream is not None:
        cudnn.set_stream(handle=handles[device], stream=stream)
    return handles[device]


def build_lock(device: int) -> threading.Lock:
    # cuDNN handles and graph builds are not thread-safe: builds on one device take turns.
    with _locks_guard:
        return _build_locks.setdefault(device, threading.Lock())


def get_graph(cfg: AttentionConfig, direction: str, device: int) -> BuiltGraph:
    """The built forward or backward graph of cfg on `device`, built once and cached."""
    def build() -> BuiltGraph:
        with build_lock(device), cuda_driver.on_device(device):
            builder = build_forward if direction == "forward" else build_backward
            return builder(cfg, sdpa_spec(cfg), handle(device))

    return _graphs.get_or_build(graph_key(cfg, direction, device), build)


def current_device(framework: str) -> int | None:
    """The GPU a call of `framework` runs on when nothing else says (None: it sees none): torch's
    current device; JAX's default device when it is a GPU."""
    if framework == "torch":
        import torch

        return torch.cuda.current_device() if torch.cuda.is_available() else None
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        return None
    return getattr(device, "local_hardware_id", None) or 0


def probe(cfg: AttentionConfig) -> list[str]:
    """Build what the run will use on the call's current device; reasons when cuDNN declines."""
    device = current_device(cfg.framework)
    if device is None:
        why = cuda_driver.unavailable()
        return [f"no CUDA device visible to {cfg.framework}" + (f": {why}" if why else "")]
    directions = ("forward", "backward") if cfg.is_training else ("forward",)
    for direction in directions:
        try:
            get_graph(cfg, direction, device)
        except GraphBuildError as error:
            return [f"cuDNN {cudnn.backend_version()}: {error} ({_relevant(cfg)})"]
    return []


def _relevant(cfg: AttentionConfig) -> str:
    """The config fields cuDNN's support rules look at, for the reason text."""
    return (f"dtype={cfg.dtype} B={cfg.batch} Sq={cfg.seqlen_q} Skv={cfg.seqlen_kv} Hq={cfg.heads_q} "
            f"Hkv={cfg.heads_kv} D={cfg.head_dim_qk} Dv={cfg.head_dim_v} mask={cfg.mask.value} "
            f"window={cfg.window} bias={cfg.bias.value} softmax={cfg.softmax.value} dropout_p={cfg.dropout_p} "
            f"deterministic={cfg.deterministic}")
