"""Smoke test of the native torch operator on a GPU: build, correctness against SDPA, where host time goes.

Prints the build, whether calls took the operator, the largest differences against SDPA in float32, and
the enqueue time per call at two shapes (forward without grad, forward+backward) of: the public call,
the operator called directly, its forward alone, four allocations (a baseline), and SDPA.
"""
import sys
import time
from pathlib import Path

import torch

import fusedattn.torch as fat
from fusedattn.backends.cudnn.native import build, torch_plans

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: its timing loop
from profile_overhead import host_and_total_us as per_call_us  # noqa: E402  (host us, wall us) per call


def check(q, k, v, grad):
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fat.attention(*leaves, mask="causal")
    print("grad_fn:", out.grad_fn.name(), flush=True)
    out.backward(grad)
    ref = [x.clone().float().requires_grad_(True) for x in (q, k, v)]
    out_ref = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ref),
                                                              is_causal=True).transpose(1, 2)
    out_ref.backward(grad.float())
    print("max |out - sdpa fp32|:", (out.float() - out_ref).abs().max().item(),
          "grads:", [(a.grad.float() - b.grad).abs().max().item() for a, b in zip(leaves, ref)], flush=True)
    return leaves


def shape(b, s, h, d):
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    grad = torch.randn_like(q)
    leaves = check(q, k, v, grad)
    plan = next(iter(torch_plans._plans._items.values()))
    op, fwd = torch.ops.fusedattn_native.attention.default, torch.ops.fusedattn_native.forward.default
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with torch.no_grad():
        rows = {
            "public": per_call_us(lambda: fat.attention(q, k, v, mask="causal")),
            "operator": per_call_us(lambda: op(plan, q, k, v, None, None, None, None, [], [], False, [])),
            "forward op": per_call_us(lambda: fwd(plan, q, k, v, None, None, None, None, [], [], False, [])),
            "4 allocations": per_call_us(lambda: [torch.empty_like(q) for _ in range(4)]),
            "sdpa": per_call_us(lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)),
        }
    rows["public fwd+bwd"] = per_call_us(lambda: fat.attention(*leaves, mask="causal").backward(grad))
    rows["sdpa fwd+bwd"] = per_call_us(lambda: sdpa(*(x.transpose(1, 2) for x in leaves),
                                                    is_causal=True).backward(grad.transpose(1, 2)))
    for name, (host, total) in rows.items():
        print(f"B{b} S{s} H{h} D{d} {name:>16}: host {host:7.1f} us, with the GPU {total:7.1f} us", flush=True)
    torch_plans._plans.clear()


def main():
    start = time.perf_counter()
    print("build path:", build.built_path("torch"), flush=True)
    print("unavailable:", torch_plans.unavailable(), f"({time.perf_counter() - start:.1f} s)", flush=True)
    shape(1, 128, 8, 64)
    shape(8, 1024, 12, 64)
    print("registry sizes:", torch_plans.registry_sizes())


if __name__ == "__main__":
    main()
