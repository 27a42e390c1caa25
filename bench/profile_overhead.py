"""Where the per-call time of fusedattn's cuDNN path goes, at a shape where overhead shows.

Prints wall time per call of: the whole public call, our frontend alone, and the cuDNN
execute call in three forms (IR-tensor dict, uid -> int pointer dict, ordered uids), plus
a cProfile of the public call. Run on a GPU machine with nvidia-cudnn-frontend installed.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import fusedattn.torch as fat  # noqa: E402
from fusedattn.backends.cudnn import runtime  # noqa: E402


def per_call_us(fn, n=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    q = torch.randn(4, 1024, 16, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    ours = lambda: fat.attention(q, k, v, mask="causal", backend="cudnn")  # noqa: E731
    print(f"torch sdpa (default backend): {per_call_us(sdpa):8.1f} us/call")
    print(f"fusedattn cudnn, public call: {per_call_us(ours):8.1f} us/call")

    cfg = next(key[0] for key in runtime.graph_cache().keys() if key[1] == "forward")
    built = runtime.get_graph(cfg, "forward", 0)
    from fusedattn.backends.cudnn.spec import sdpa_spec
    spec = sdpa_spec(cfg)
    o = torch.empty_like(q)
    stats = torch.empty(spec.stats.dim, device="cuda")
    views = {"q": q.transpose(1, 2), "k": k.transpose(1, 2), "v": v.transpose(1, 2), "o": o.transpose(1, 2),
             "stats": stats}
    views = {n: t for n, t in views.items() if n in built.tensors}  # an inference graph has no stats
    handle = runtime._handle(0)
    ws = torch.empty(max(built.workspace, 1), dtype=torch.uint8, device="cuda")
    by_ir = {built.tensors[n]: t for n, t in views.items()}
    print(f"execute, IR-tensor dict:      {per_call_us(lambda: built.graph.execute(by_ir, ws, handle=handle)):8.1f}")
    uids = {n: built.tensors[n].get_uid() for n in views}
    by_uid = {uids[n]: t.data_ptr() for n, t in views.items()}
    print(f"execute, uid->pointer dict:   "
          f"{per_call_us(lambda: built.graph.execute(by_uid, ws.data_ptr(), handle=handle)):8.1f}")
    order = tuple(uids[n] for n in views)
    ptrs = tuple(t.data_ptr() for t in views.values())
    try:
        fast = lambda: built.graph.execute(ptrs, ws.data_ptr(), handle=handle, tensor_uids=order)  # noqa: E731
        print(f"execute, ordered uids:        {per_call_us(fast):8.1f}")
    except Exception as error:  # the ordered form is read from source, not documented
        print(f"execute, ordered uids: failed: {type(error).__name__}: {error}")
    _profile("forward", ours)

    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    grad = torch.randn_like(q)
    sdpa_fb = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        *(x.transpose(1, 2) for x in leaves), is_causal=True).backward(grad.transpose(1, 2))
    ours_fb = lambda: fat.attention(*leaves, mask="causal", backend="cudnn").backward(grad)  # noqa: E731
    print(f"torch sdpa forward+backward:  {per_call_us(sdpa_fb):8.1f} us/call")
    print(f"fusedattn forward+backward:   {per_call_us(ours_fb):8.1f} us/call")
    _profile("forward+backward", ours_fb)


def _profile(label: str, call) -> None:
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(200):
        call()
    profile.disable()
    torch.cuda.synchronize()
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(22)
        print(f"--- {label}, 200 calls, by {order}")
        print(text.getvalue()[-6000:])


if __name__ == "__main__":
    main()
