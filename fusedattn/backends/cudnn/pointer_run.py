"""The cuDNN forward and backward from raw device addresses: the JAX bridge's lean path.

XLA hands a buffer callback dense row-major buffers. When a call's graph reads and writes
exactly those layouts and needs nothing computed around it (no padding penalties, score_mod
aux values, widened dropout seeds, bias sums or filled-in rows), the buffers' addresses go
straight to cuDNN on XLA's stream: no torch tensors, no DLPack views, a few microseconds of
Python. Every other call takes torch_run's path.
"""

from __future__ import annotations

import threading

from fusedattn.backends.cudnn.spec import TensorSpec, gradient_spec, rows_without_keys, sdpa_spec
from fusedattn.cache import LRUCache
from fusedattn.config import AttentionConfig, SoftmaxType
from fusedattn.layout import layout_spec

__all__ = ["runs_from_addresses", "run"]

# Graph tensor names of each pass, in the order the bridge hands over their buffers.
FORWARD_INPUTS, FORWARD_OUTPUTS = ("q", "k", "v"), ("o", "stats")
BACKWARD_INPUTS, BACKWARD_OUTPUTS = ("q", "k", "v", "o", "stats", "dO"), ("dq", "dk", "dv")

_eligible: LRUCache = LRUCache(1024)
_workspaces: dict = {}  # (device, stream) -> list of uint8 tensors, never freed (see _workspace)
_workspace_lock = threading.Lock()


def _dense_in_memory(spec: TensorSpec, cfg: AttentionConfig) -> bool:
    """Whether a BHSD graph tensor is a dense row-major array of the base layout's memory order."""
    order = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3), "bhsd": (0, 1, 2, 3)}[cfg.layout.value]
    memory_dims = [spec.dim[i] for i in order]
    stride, step = [0] * 4, 1
    for position in reversed(range(4)):
        stride[order[position]] = step
        step *= memory_dims[position]
    return all(n == 1 or a == b for n, a, b in zip(spec.dim, spec.stride, stride))


def runs_from_addresses(cfg: AttentionConfig) -> bool:
    """Whether this call can run from raw addresses (decided once per config)."""
    def decide() -> bool:
        if cfg.layout != layout_spec(cfg.layout).base or cfg.layout.is_ragged or rows_without_keys(cfg):
            return False
        spec = sdpa_spec(cfg)
        if (spec.padding or spec.score_mod or spec.max_logit or spec.dropout or spec.bias is not None
                or spec.sink or cfg.softmax is not SoftmaxType.VANILLA):
            return False
        tensors = [spec.q, spec.k, spec.v, spec.o]
        if cfg.is_training:
            tensors += [gradient_spec(spec.q), gradient_spec(spec.k), gradient_spec(spec.v)]
        dense_stats = spec.stats.stride[:3] == (cfg.heads_q * cfg.seqlen_q, cfg.seqlen_q, 1)
        return dense_stats and all(_dense_in_memory(t, cfg) for t in tensors)

    return _eligible.get_or_build(cfg, decide)


def _workspace(device: int, stream: int, size: int) -> int:
    """A workspace of at least `size` bytes used only on `stream`: work on one stream runs in order,
    so reusing it is safe; an outgrown one is kept (queued work may still read it)."""
    import torch

    key = (device, stream)
    with _workspace_lock:
        kept = _workspaces.setdefault(key, [])
        if not kept or kept[-1].numel() < size:
            kept.append(torch.empty(max(size, 1 << 20), dtype=torch.uint8, device=device))
        return kept[-1].data_ptr()


def run(cfg: AttentionConfig, direction: str, device: int, stream: int, addresses: list[int]) -> None:
    """Execute the cached graph of cfg with the buffers at `addresses` (inputs then outputs, in the
    FORWARD_*/BACKWARD_* orders) on `stream`."""
    from fusedattn.backends.cudnn.runtime import _handle, get_graph

    built = get_graph(cfg, direction, device)
    names = FORWARD_INPUTS + FORWARD_OUTPUTS if direction == "forward" else BACKWARD_INPUTS + BACKWARD_OUTPUTS
    handle = _handle(device, stream)
    pack = {built.tensors[name]: address for name, address in zip(names, addresses)}
    built.graph.execute(pack, _workspace(device, stream, built.workspace), handle=handle)
