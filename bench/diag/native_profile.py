"""Where the host time of a forward call goes (run with FUSEDATTN_NATIVE_PROFILE=1: the launch core prints
its steps at exit). B1 S128 H8 D64 causal bf16 under no_grad: the public call, the operator, the forward
operator, SDPA default and SDPA on cuDNN, each timed alone."""

import torch
from native_smoke import per_call_us  # this folder: the same timing loop
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedattn.torch as fat
from fusedattn.backends.cudnn.native import torch_plans


def main():
    q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        fat.attention(q, k, v, mask="causal")
        plan = next(iter(torch_plans._plans._items.values()))
        op, fwd = torch.ops.fusedattn_native.attention.default, torch.ops.fusedattn_native.forward.default
        rows = {"public": lambda: fat.attention(q, k, v, mask="causal"),
                "operator": lambda: op(plan, q, k, v, None, None, None, None, [], [], False, []),
                "forward op": lambda: fwd(plan, q, k, v, None, None, None, None, [], [], False, []),
                "empty_like": lambda: torch.empty_like(q),
                "sdpa": lambda: sdpa(qt, kt, vt, is_causal=True)}
        for name, fn in rows.items():
            print(f"{name:>12}: {per_call_us(fn, n=2000)[0]:6.1f} us/call (host)", flush=True)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            host = per_call_us(lambda: sdpa(qt, kt, vt, is_causal=True), n=2000)[0]
            print(f"{'sdpa cudnn':>12}: {host:6.1f} us/call (host)")


if __name__ == "__main__":
    main()
