"""The CUDA driver, just enough to build cuDNN graphs on a chosen GPU without any framework.

A cuDNN handle belongs to the device whose context is current when it is made. torch's and JAX's
runtimes both use each device's primary context, so making it current here (and restoring what
was current before) gives the handle the same device a framework call would, with no torch
import: JAX processes build their graphs this way.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading

__all__ = ["on_device", "unavailable"]

_lock = threading.Lock()
_state: dict = {}  # "driver" (ctypes.CDLL) or "reason" (str), once decided; "contexts": {device: handle}


def _driver() -> ctypes.CDLL:
    with _lock:
        if "driver" not in _state and "reason" not in _state:
            try:
                driver = ctypes.CDLL("libcuda.so.1")
                _check(driver, driver.cuInit(0), "cuInit")
                _state.update(driver=driver, contexts={})
            except (OSError, RuntimeError) as error:
                _state["reason"] = f"the CUDA driver is unavailable ({error})"
    if "reason" in _state:
        raise RuntimeError(_state["reason"])
    return _state["driver"]


def _check(driver, status: int, call: str) -> None:
    if status != 0:
        name = ctypes.c_char_p()
        driver.cuGetErrorName(status, ctypes.byref(name))
        raise RuntimeError(f"{call} failed: {(name.value or b'error').decode()} ({status})")


def unavailable() -> str | None:
    """Why no GPU can be used through the driver (None: it can)."""
    try:
        _driver()
    except RuntimeError as error:
        return str(error)
    return None


def _primary_context(driver, device: int) -> ctypes.c_void_p:
    with _lock:
        context = _state["contexts"].get(device)
        if context is None:  # retained for the life of the process, as the frameworks do
            handle = ctypes.c_int()
            _check(driver, driver.cuDeviceGet(ctypes.byref(handle), device), f"cuDeviceGet({device})")
            context = ctypes.c_void_p()
            _check(driver, driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle), "cuDevicePrimaryCtxRetain")
            _state["contexts"][device] = context
        return context


@contextlib.contextmanager
def on_device(device: int):
    """`device`'s primary context is current on this thread inside the block."""
    driver = _driver()
    _check(driver, driver.cuCtxPushCurrent_v2(_primary_context(driver, device)), "cuCtxPushCurrent")
    try:
        yield
    finally:
        driver.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
