"""Launching a built cuDNN graph with raw addresses through the frontend's internal call.

cuDNN frontend 1.32's public execute() re-inspects every buffer in Python on every call (35-60 us,
as much as an attention kernel at S=1024). `_RawLaunch` learns, from one public normalization,
where each of our buffers goes in the frontend's address array and which slots the graph binds
itself (host scalars), then each call copies that array, writes the call's addresses into their
slots and launches. Used by the JAX bridge's lean path (pointer_run) and by the torch path
(runtime.execute) once a graph has run through the public execute.
"""

from __future__ import annotations

import ctypes
import os

ENV_RAW = os.environ.get("FUSEDATTN_CUDNN_RAW_LAUNCH", "1")  # "0": always cuDNN's public execute

# The frontend version whose internal launch `_RawLaunch` calls (measured and tested with it).
RAW_LAUNCH_FRONTEND = "1.32."


class _RawLaunch:
    """The launch cuDNN frontend 1.32's execute() ends with, called directly. Only for graphs the
    frontend runs on its C++ backend; anything unexpected keeps the public path."""

    def __init__(self, graph, uids, addresses, workspace: int):
        from cudnn._handle import to_backend_handle

        pack = graph._normalize(graph._uid_to_data(dict(zip(uids, addresses))), workspace)
        self._keep = pack  # the graph's own bindings (host scalars) live as long as the pack
        count = len(pack.uids)
        self._template = tuple((ctypes.c_void_p * count).from_address(pack.address))
        self._slots = tuple(pack.uids.index(uid) for uid in uids)
        self._array = ctypes.c_void_p * count
        plan = graph._materialize_backend_plan(graph._plan_index)
        self._plan = -1 if plan.cpp_index is None else plan.cpp_index
        self._launch = graph._lowered_graph._execute_with_raw_ptrs
        self._backend_handle = to_backend_handle

    @classmethod
    def usable(cls, graph) -> bool:
        import cudnn

        return (cudnn.__version__.startswith(RAW_LAUNCH_FRONTEND) and graph._is_built
                and graph.selected_engine is None and getattr(graph, "_lowered_graph", None) is not None)

    def __call__(self, addresses, workspace: int, handle) -> None:
        array = self._array(*self._template)  # per call: two threads may launch one graph at once
        for slot, address in zip(self._slots, addresses):
            array[slot] = address
        self._launch(ctypes.addressof(array), len(array), workspace, self._backend_handle(handle) or 0, self._plan)


def learn(graph, uids, addresses, workspace: int) -> _RawLaunch | None:
    """After a public execute with these buffers: their raw launcher, or None where the frontend
    runs the graph otherwise, its internals moved, or FUSEDATTN_CUDNN_RAW_LAUNCH=0."""
    if ENV_RAW == "0" or not _RawLaunch.usable(graph):
        return None
    try:
        return _RawLaunch(graph, uids, addresses, workspace)
    except Exception:  # an internal that moved: stay on the public path
        return None
