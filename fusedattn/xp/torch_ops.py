"""torch implementation of the shared array namespace (see fusedattn.xp)."""

from __future__ import annotations

import numpy as np
import torch

from fusedattn.xp import loaded

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float32": torch.float32, "float64": torch.float64,
    "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_U32 = 0xFFFFFFFF


class TorchOps:
    name = "torch"
    module = torch  # elementwise functions with NumPy names (tanh, trunc, ...) for score_mod graphs
    erf = staticmethod(torch.erf)

    # dtypes and conversion
    def dtype_name(self, x) -> str:
        return _NAMES.get(x.dtype, str(x.dtype).removeprefix("torch."))

    def astype(self, x, name: str):
        return x.to(_DTYPES[name])

    def to_host(self, x) -> np.ndarray:
        return x.detach().cpu().numpy()

    def device_kind(self, x) -> str:
        return x.device.type

    def device_label(self, x) -> str:
        return str(x.device)

    def asarray(self, values, like, dtype: str):
        return torch.as_tensor(values, dtype=_DTYPES[dtype], device=like.device)

    # creation
    def arange(self, n: int, like, dtype: str = "int64"):
        return torch.arange(n, device=like.device, dtype=_DTYPES[dtype])

    def full(self, shape, value, like, dtype: str):
        return torch.full(tuple(shape), value, device=like.device, dtype=_DTYPES[dtype])

    # elementwise and reductions
    where = staticmethod(torch.where)
    exp = staticmethod(torch.exp)
    log = staticmethod(torch.log)
    abs = staticmethod(torch.abs)
    isfinite = staticmethod(torch.isfinite)
    maximum = staticmethod(torch.maximum)
    logical_and = staticmethod(torch.logical_and)
    einsum = staticmethod(torch.einsum)

    def amax(self, x, axis, keepdims=False):
        return torch.amax(x, dim=axis, keepdim=keepdims)

    def sum(self, x, axis, keepdims=False):
        return torch.sum(x, dim=axis, keepdim=keepdims)

    def any(self, x, axis):
        return torch.any(x, dim=axis)

    def cumsum(self, x, axis):
        return torch.cumsum(x, dim=axis)

    def stop_gradient(self, x):
        return x.detach()

    def vjp(self, fn, primals: dict, cotangents: tuple) -> dict:
        """Gradients of fn(**primals) (a tuple) against the given output cotangents. Called with grad mode on
        (a backward with create_graph=True), the gradients keep their graph to the primals and cotangents,
        so they can be differentiated again."""
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            leaves = {name: x if create_graph and x.requires_grad else x.detach().requires_grad_(True)
                      for name, x in primals.items() if x is not None and x.is_floating_point()}
            outputs = fn(**{**primals, **leaves})
            pairs = [(o, c) for o, c in zip(outputs, cotangents)
                     if c is not None and o is not None and o.requires_grad]
            grads = (torch.autograd.grad([o for o, _ in pairs], list(leaves.values()),
                                         [c.to(o.dtype) for o, c in pairs], allow_unused=True,
                                         create_graph=create_graph)
                     if pairs else [None] * len(leaves))
        return {name: (g if g is not None else torch.zeros_like(x))
                for (name, x), g in zip(leaves.items(), grads)}

    # shape
    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def moveaxis(self, x, source, destination):
        return torch.movedim(x, source, destination)

    def broadcast_to(self, x, shape):
        return torch.broadcast_to(x, tuple(shape))

    def repeat(self, x, repeats: int, axis: int):
        return torch.repeat_interleave(x, repeats, dim=axis)

    def take(self, x, index, axis: int):
        return torch.index_select(x, axis, index.reshape(-1)).reshape(
            x.shape[:axis] + tuple(index.shape) + x.shape[axis + 1:])

    def concatenate(self, xs, axis: int):
        return torch.cat(list(xs), dim=axis)

    def searchsorted(self, sorted_, values, right: bool):
        return torch.searchsorted(sorted_.contiguous(), values.contiguous(), right=right)

    def clip(self, x, low, high):
        return torch.clamp(x, low, high)

    # 32-bit unsigned hashing, kept in int64 so every op is defined on CPU and GPU;
    # multipliers stay below 2**31 so no product overflows int64.
    def u32(self, x):
        return x.to(torch.int64) & _U32

    def u32_mul(self, x, c: int):
        return (x * c) & _U32

    def u32_add(self, x, c):
        return (x + c) & _U32

    def u32_xor(self, x, y):
        return x ^ y

    def u32_shr(self, x, n: int):
        return x >> n

    def u32_to_unit_float(self, x):
        """Top 24 bits as a float32 in [0, 1)."""
        return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


OPS = TorchOps()
loaded("torch", OPS)
