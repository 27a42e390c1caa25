"""Launching a Triton kernel again without Triton's per-call argument binding.

`kernel[grid](...)` binds and specializes every argument in Python on every call: about 30 us of host
time for a kernel of thirty arguments, as much as the small kernels around cuDNN's padded and THD
graphs take on the GPU. `FastLaunch` lets Triton launch (and compile) the first call of each
specialization, keeps the compiled kernel, and launches later calls of that specialization through it.
The specialization is what Triton's own cache key reads from the arguments: each tensor's dtype and
16-byte alignment, each int's width, divisibility by 16 and equality to 1, and the constexprs.
Where Triton runs in its interpreter, or launch hooks are set (profilers), every call goes through Triton.
"""

from __future__ import annotations

import torch

__all__ = ["FastLaunch"]

_KERNELS_PER_FUNCTION = 64  # specializations kept per kernel (a few configs' worth)
_INT32 = range(-(2**31), 2**31)


def _specialization(args: tuple) -> tuple:
    key = []
    for x in args:
        if isinstance(x, torch.Tensor):
            key.append((x.dtype, x.data_ptr() % 16 == 0))
        elif isinstance(x, bool) or not isinstance(x, int):
            key.append(type(x))
        else:
            key.append((x in _INT32, x % 16 == 0, x == 1))
    return tuple(key)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: None, or (Triton >= 3.5) a chain of none, means no."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLaunch:
    """A @triton.jit function, called as launch(grid, *positional args, **constexprs)."""

    def __init__(self, function):
        self.function = function
        self._kernels: dict = {}

    def __call__(self, grid: tuple, *args, **constexprs) -> None:
        from triton import knobs

        fixed = tuple(constexprs[name] for name in self.function.arg_names[len(args):])  # the kernel's order
        key = (torch.cuda.current_device() if torch.cuda.is_available() else -1, _specialization(args), fixed)
        kernel = self._kernels.get(key)
        if kernel is None or _hooked(knobs.runtime.launch_enter_hook):
            kernel = self.function[grid](*args, **constexprs)
            if hasattr(kernel, "packed_metadata") and len(self._kernels) < _KERNELS_PER_FUNCTION:
                self._kernels[key] = kernel  # a compiled kernel (the interpreter returns none)
            return
        stream = torch.cuda.current_stream().cuda_stream
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata, None, None, None, *args, *fixed)
