"""GPU time of the empty-rows kernel at the S=1024 bench shape (LSE (4, 16, 1024), out bshd (4, 1024, 16,
128) bf16), launched by Triton with the GPU held by a spin while 100 launches queue (so host time does not
count), with no row empty and with every third row empty, training and inference; and the compiled
kernel's registers and spills, as Triton compiles it and as the operator's compile does (no alignment)."""

import torch

from fusedattn.backends.cudnn import empty_rows_kernel
from fusedattn.backends.cudnn.native import sequence_plans
from fusedattn.score_mods.core import MASKED_BELOW

LAUNCHES = 100


def held_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)
    start.record()
    for _ in range(LAUNCHES):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / LAUNCHES * 1e3


out = torch.randn(4, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
rows = out.permute(0, 2, 1, 3)
for empty in (False, True):
    raw = torch.randn(4, 16, 1024, device="cuda")
    if empty:
        raw[:, :, 1::3] = MASKED_BELOW * 2
    for training in (True, False):
        lse = torch.empty_like(raw)
        grid = (empty_rows_kernel.programs(4 * 16, 1024),)
        constants = empty_rows_kernel.constants(128, training)

        def launch(raw=raw, lse=lse, grid=grid, constants=constants):
            empty_rows_kernel.clear_empty_rows[grid](rows, raw, lse, raw.numel(), 16, 1024, *rows.stride()[:3],
                                                     **constants)

        print(f"empty rows {empty}, training {training}: {held_us(launch):7.1f} us a launch", flush=True)
kernel = empty_rows_kernel.clear_empty_rows[(1,)](rows, raw, raw.clone(), raw.numel(), 16, 1024,
                                                  *rows.stride()[:3], **empty_rows_kernel.constants(128, True))
print("triton's compile: regs", kernel.n_regs, "spills", kernel.n_spills, "cubin", len(kernel.asm["cubin"]))
image, name, warps, shared = sequence_plans.compile_kernel(
    empty_rows_kernel.clear_empty_rows, "bfloat16", None, empty_rows_kernel.constants(128, True),
    {"OUT": None, **empty_rows_kernel.POINTERS})
print("the operator's compile: cubin", len(image), "warps", warps, "shared", shared)
