"""Running built cuDNN graphs on torch tensors: handles per device and thread, the graph
cache, and binding buffers on torch's current stream."""

from __future__ import annotations

import os
import threading

import cudnn
import torch

from fusedattn.backends.cudnn import core_launch
from fusedattn.backends.cudnn.alignment import ALIGNMENT, aligned_copy
from fusedattn.backends.cudnn.graphs import OUTPUT_NAMES, BuiltGraph, GraphBuildError, build_backward, build_forward
from fusedattn.backends.cudnn.spec import graph_key, sdpa_spec
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig

ENV_CACHE_SIZE = "FUSEDATTN_CUDNN_CACHE_SIZE"
_graphs: LRUCache = register("cudnn.graphs", LRUCache(int(os.environ.get(ENV_CACHE_SIZE, "256"))))
# Not caches, so not in the registry: one lock per device index (bounded by the device count),
# and per thread one cuDNN handle per device (bounded by devices; freed with the thread).
_build_locks: dict[int, threading.Lock] = {}
_locks_guard = threading.Lock()
_local = threading.local()


def graph_cache() -> LRUCache:
    return _graphs


def _handle(device: int, stream: int | None = None):
    """This thread's cuDNN handle for `device`, bound to `stream` (default: torch's current stream there)."""
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    if device not in handles:
        with torch.cuda.device(device):
            handles[device] = cudnn.create_handle()
    handle = handles[device]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream if stream is None else stream)
    return handle


def _build_lock(device: int) -> threading.Lock:
    # cuDNN handles and graph builds are not thread-safe: builds on one device take turns.
    with _locks_guard:
        return _build_locks.setdefault(device, threading.Lock())


def get_graph(cfg: AttentionConfig, direction: str, device: int) -> BuiltGraph:
    """The built forward or backward graph of cfg on `device`, built once and cached."""
    def build() -> BuiltGraph:
        with _build_lock(device), torch.cuda.device(device):
            builder = build_forward if direction == "forward" else build_backward
            return builder(cfg, sdpa_spec(cfg), _handle(device))

    return _graphs.get_or_build(graph_key(cfg, direction, device), build)


def probe(cfg: AttentionConfig) -> list[str]:
    """Build what the run will use on the current device; reasons when cuDNN declines."""
    if not torch.cuda.is_available():
        return ["no CUDA device visible to torch"]
    device = torch.cuda.current_device()
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


def execute(built: BuiltGraph, buffers: dict, device: int) -> None:
    """Run a graph with {our name: tensor, or an int address} on torch's current stream.

    cuDNN gets device pointers (THD tensors are (T, H, D) in torch but logical (B, H, S, D) in
    the graph, so only their addresses mean the same thing). After one public execute, calls that
    bind the same names launch from their addresses through the native launch core (core_launch.py):
    the buffers' strides are fixed by the config, which the graph was built for.
    """
    stream = torch.cuda.current_stream(device).cuda_stream
    names = tuple(name for name in buffers if name in built.tensors)
    addresses = []
    for name in names:
        buffer = buffers[name]
        if isinstance(buffer, int):  # an address already (a sequence table's row, 16-byte aligned)
            addresses.append(buffer)
            continue
        if name not in OUTPUT_NAMES and buffer.is_cuda and buffer.data_ptr() % ALIGNMENT:
            buffers[name] = buffer = aligned_copy(buffer)
        addresses.append(buffer.data_ptr())
    launcher = built.launchers.get(names)
    if launcher is not None:  # the core's copy of the graph says how much workspace it needs
        workspace = torch.empty(max(launcher.workspace, 1), dtype=torch.uint8, device=device)
        launcher(addresses, workspace.data_ptr(), stream)
        return
    workspace = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device=device)
    # Addresses, not tensors (a pass-by-value scalar's is a host address): tensors reach cuDNN
    # through DLPack, which may order work on the legacy stream (not allowed while a CUDA graph is
    # captured), and hold references the frontend's objects keep for as long as they live.
    pack = {built.tensors[name]: address for name, address in zip(names, addresses)}
    built.graph.execute(pack, workspace.data_ptr(), handle=_handle(device, stream))
    if names not in built.launchers:
        uids = [built.tensors[name].get_uid() for name in names]
        built.launchers[names] = core_launch.learn(built.graph, uids, device)
