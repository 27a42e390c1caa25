"""Running built cuDNN graphs on torch tensors: binding buffers on torch's current stream. Graphs
are built and cached framework-free (graph_cache.py); its names are re-exported here for torch's
callers."""

from __future__ import annotations

import torch

from fusedattn.backends.cudnn import core_launch
from fusedattn.backends.cudnn.alignment import ALIGNMENT, aligned_copy
from fusedattn.backends.cudnn.graph_cache import build_lock, get_graph, graph_cache, handle, probe
from fusedattn.backends.cudnn.graphs import OUTPUT_NAMES, BuiltGraph

__all__ = ["execute", "get_graph", "graph_cache", "probe", "build_lock"]


def _handle(device: int, stream: int | None = None):
    """This thread's cuDNN handle for `device`, bound to `stream` (default: torch's current stream there)."""
    return handle(device, torch.cuda.current_stream(device).cuda_stream if stream is None else stream)


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
