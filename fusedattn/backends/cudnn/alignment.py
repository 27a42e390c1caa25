"""Operands cuDNN can take: every address a multiple of 16 bytes (torch only, no cudnn import)."""

from __future__ import annotations

import torch

from fusedattn.backends.cudnn.spec import ALIGNMENT

__all__ = ["ALIGNMENT", "aligned_copy"]


def aligned_copy(x: torch.Tensor) -> torch.Tensor:
    """x in new (aligned) memory with x's strides, broadcast (stride 0) axes included: cuDNN refuses an
    operand whose address is not a multiple of ALIGNMENT, and a view a few elements into its storage has one."""
    unique = x
    for axis, (size, stride) in enumerate(zip(x.shape, x.stride())):
        if stride == 0 and size > 1:  # one stored element serves the whole axis
            unique = unique.narrow(axis, 0, 1)
    span = 1 + sum((size - 1) * stride for size, stride in zip(unique.shape, unique.stride()))
    storage = torch.empty(max(span, 1), dtype=x.dtype, device=x.device)
    torch.as_strided(storage, unique.shape, unique.stride()).copy_(unique)
    return torch.as_strided(storage, x.shape, x.stride())
