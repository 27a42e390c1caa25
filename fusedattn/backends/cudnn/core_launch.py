"""Launching a built cuDNN graph from buffer addresses through the native launch core.

cuDNN frontend's public execute() re-inspects every buffer in Python on every call (35-60 us, as
much as an attention kernel at S=1024). After a graph's first public execute with a given set of
buffers, `learn` registers it with the launch core (its serialized bytes and the uid each buffer
binds to, native/core.py), and each later call is one C call with the buffers' addresses: the same
launch the torch operator and the JAX custom call make. Where the core cannot be loaded (no
compiler or headers; the reason is in `unavailable()`), or FUSEDATTN_CUDNN_CORE_LAUNCH=0, calls keep
the public execute. Used by the torch path (runtime.execute) and the JAX bridge (pointer_run).
"""

from __future__ import annotations

import ctypes
import os

ENV_SWITCH = "FUSEDATTN_CUDNN_CORE_LAUNCH"  # "0": always cuDNN's public execute


class CoreLaunch:
    """One graph's launches through the core, its buffers bound in the order they were learnt."""

    def __init__(self, blob: bytes, uids: tuple, device: int):
        from fusedattn.backends.cudnn.native import core

        self._core, self._blob, self._uids, self.device = core, blob, uids, device
        self._library = core.library()  # loaded once here: core.library() takes a lock on every call
        self._slots = ctypes.c_void_p * len(uids)
        self.plan_id = self.workspace = None
        self.register()

    def register(self) -> None:
        """Register (again, after the core's bounded registry dropped it) and deserialize on the device;
        RuntimeError when cuDNN cannot rebuild the graph from its bytes."""
        registered = self._core.register(self._blob, self._uids, self.device)
        if isinstance(registered, str):
            raise RuntimeError(registered)
        self.plan_id, self.workspace = registered

    def __call__(self, addresses, workspace: int, stream: int) -> None:
        """Launch on `stream` with these buffers (host addresses for pass-by-value scalars) and a
        workspace of at least the graph's size."""
        slots = self._slots(*addresses)
        status = self._execute(slots, workspace, stream)
        if status == self._core.NOT_REGISTERED:
            self.register()
            status = self._execute(slots, workspace, stream)
        if status != 0:
            raise RuntimeError(f"fusedattn: the launch core: {self._library.fusedattn_core_last_error().decode()}")

    def _execute(self, slots, workspace: int, stream: int) -> int:
        return self._library.fusedattn_core_execute(self.plan_id, self.device, stream, slots, len(slots),
                                                    workspace or None, self.workspace)


def unavailable() -> str | None:
    """Why calls keep the public execute (None: they launch through the core)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    from fusedattn.backends.cudnn.native import core

    return core.unavailable()


def learn(graph, uids, device: int) -> CoreLaunch | None:
    """After a public execute of `graph` with buffers bound to `uids` (in call order) on `device`: its
    launcher through the core, or None where calls keep the public execute (see unavailable), or
    cuDNN cannot rebuild the graph from its bytes."""
    if unavailable() is not None:
        return None
    try:
        blob = bytes(graph.serialize(as_bytes=True))
    except Exception:  # a graph the frontend runs on its own engines has no serialized plan
        return None
    try:
        return CoreLaunch(blob, tuple(uids), device)
    except RuntimeError:
        return None
