"""The cuDNN forward and backward from raw device addresses: the JAX bridge's lean path.

XLA hands a buffer callback dense row-major buffers. When a call's graph reads and writes
exactly those layouts and needs nothing computed around it (no padding penalties, score_mod
aux values, widened dropout seeds, bias sums or filled-in rows), the buffers' addresses go
straight to cuDNN on XLA's stream: no torch tensors, no DLPack views, a few microseconds of
Python. Every other call takes torch_run's path.
"""

from __future__ import annotations

import threading

from fusedattn.backends.cudnn import core_launch
from fusedattn.backends.cudnn.spec import rows_without_keys, sdpa_spec
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig, SoftmaxType
from fusedattn.layout import layout_spec

__all__ = ["runs_from_addresses", "AddressRunner"]

# Graph tensor names of each pass, in the order the bridge hands over their buffers.
FORWARD_INPUTS, FORWARD_OUTPUTS = ("q", "k", "v"), ("o", "stats")
BACKWARD_INPUTS, BACKWARD_OUTPUTS = ("q", "k", "v", "o", "stats", "dO"), ("dq", "dk", "dv")
BUFFER_NAMES = {"forward": FORWARD_INPUTS + FORWARD_OUTPUTS, "backward": BACKWARD_INPUTS + BACKWARD_OUTPUTS}

_eligible: LRUCache = register("cudnn.pointer_run.eligible", LRUCache(1024))
# (device, stream) -> the largest workspace used there so far (see _workspace). XLA runs a few
# streams per device, so 64 (device, stream) pairs hold every one a program uses.
_workspaces: LRUCache = register("cudnn.pointer_run.workspaces", LRUCache(64))
_workspace_lock = threading.Lock()


def runs_from_addresses(cfg: AttentionConfig) -> bool:
    """Whether this call can run from raw addresses (decided once per config).

    Unpacked, padded-free base layouts are what XLA hands over: for them sdpa_spec's q/k/v/o
    (layout_strides), their gradients (gradient_spec of a dense spec) and the stats are
    already dense row-major, so only what is computed around the graph rules a call out.
    """
    def decide() -> bool:
        if cfg.layout != layout_spec(cfg.layout).base or cfg.layout.is_ragged or rows_without_keys(cfg):
            return False
        spec = sdpa_spec(cfg)
        return not (spec.padding or spec.score_mod or spec.max_logit or spec.dropout or spec.bias is not None
                    or spec.sink or cfg.softmax is not SoftmaxType.VANILLA)

    return _eligible.get_or_build(cfg, decide)


def _workspace(device: int, stream: int, size: int):
    """A uint8 tensor of at least `size` bytes used only on `stream`: work on one stream runs in
    order, so reusing it there is safe. The caller holds it until its launch is queued.

    Each workspace is marked with record_stream(stream) when made: when the last reference to an
    outgrown, evicted or cleared one goes, torch's caching allocator records an event on `stream`
    and reuses the memory only after the stream has passed it, so queued work that still reads it
    is never handed someone else's data. Only the largest per (device, stream) is kept. A new one
    comes from the pool of torch's current stream, where earlier work may still use its memory:
    `stream` waits for that stream once, when the workspace is made."""
    import torch

    key = (device, stream)
    with _workspace_lock:
        kept = _workspaces.get(key)
        if kept is None or kept.numel() < size:
            kept = torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=device)
            used_on = torch.cuda.ExternalStream(stream, device=device)
            used_on.wait_stream(torch.cuda.current_stream(device))
            kept.record_stream(used_on)
            _workspaces.put(key, kept)
        return kept


class AddressRunner:
    """Runs one config's graphs from raw addresses; remembers each (direction, device)'s graph and
    the uids its buffers bind to, so a call is a few lookups and one launch."""

    def __init__(self, cfg: AttentionConfig):
        self.cfg = cfg
        self._bound: dict = {}

    def __call__(self, direction: str, device: int, stream: int, addresses: list[int]) -> None:
        """Execute with the buffers at `addresses` (inputs then outputs, in the FORWARD_*/BACKWARD_*
        orders) on `stream`."""
        from fusedattn.backends.cudnn.runtime import _handle, get_graph

        key = (direction, device)
        bound = self._bound.get(key)
        if bound is None:
            built = get_graph(self.cfg, direction, device)
            uids = _buffer_uids(built, direction)
            used = tuple(i for i, uid in enumerate(uids) if uid >= 0)  # no stats in inference
            bound = (built.graph, tuple(uids[i] for i in used), built.workspace, used)
            self._bound[key] = bound
        graph, uids, size, used = bound
        addresses = [addresses[i] for i in used]
        if isinstance(graph, core_launch.CoreLaunch):
            held = _workspace(device, stream, graph.workspace)  # referenced until the launch is queued
            graph(addresses, held.data_ptr(), stream)
            return
        held = _workspace(device, stream, size)
        graph.execute(dict(zip(uids, addresses)), held.data_ptr(), handle=_handle(device, stream))
        launcher = core_launch.learn(graph, uids, device)  # after one public execute
        if launcher is not None:
            self._bound[key] = (launcher, uids, size, used)

    def serialized(self, direction: str, device: int) -> tuple[bytes, tuple[int, ...]]:
        """The pass's graph as cuDNN's serialized plan, and the uid each buffer binds to (-1: none),
        for running it without Python (fusedattn.jax.native)."""
        from fusedattn.backends.cudnn.graph_cache import get_graph

        built = get_graph(self.cfg, direction, device)
        return bytes(built.graph.serialize(as_bytes=True)), _buffer_uids(built, direction)


def _buffer_uids(built, direction: str) -> tuple[int, ...]:
    """Each buffer's uid in the graph, in the bridge's order; -1 where the graph has no such tensor."""
    return tuple(built.tensors[name].get_uid() if name in built.tensors else -1 for name in BUFFER_NAMES[direction])
