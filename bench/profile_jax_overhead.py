"""Where the per-call host time of fusedattn.jax on cuDNN goes, at a shape where overhead shows.

Prints wall time per jitted call (forward, and forward+backward) of ours and of
jax.nn.dot_product_attention(implementation="cudnn"), the time spent inside our buffer
callbacks, and a cProfile of the callbacks (they run on the calling thread). GPU only.

    python bench/profile_jax_overhead.py [B H S D]
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fusedattn.jax as fj  # noqa: E402
from fusedattn.backends import get_backend  # noqa: E402


def per_call_us(fn, *args, n=500) -> float:
    for _ in range(20):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(n):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / n * 1e6


def execute_forms(B: int, H: int, S: int, D: int) -> None:
    """cuDNN's execute alone, from raw addresses: the mapping form and the ordered (tensor_uids) form."""
    import torch
    from profile_overhead import per_call_us as timed  # torch-synchronized timing of a callable

    from fusedattn.backends.cudnn import runtime
    from fusedattn.backends.cudnn.pointer_run import FORWARD_INPUTS, FORWARD_OUTPUTS, _workspace

    cfg = next(key[0] for key in runtime.graph_cache().keys()
               if key[1] == "forward" and key[0].framework == "jax" and key[0].seqlen_q == S)
    built = runtime.get_graph(cfg, "forward", 0)
    tensors = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    tensors.append(torch.empty(B, H, S, device="cuda"))
    addresses = [t.data_ptr() for t in tensors]
    uids = tuple(built.tensors[n].get_uid() for n in FORWARD_INPUTS + FORWARD_OUTPUTS)
    stream = torch.cuda.current_stream().cuda_stream
    handle = runtime._handle(0, stream)
    workspace = _workspace(0, stream, built.workspace)

    mapping = lambda: built.graph.execute(dict(zip(uids, addresses)), workspace, handle=handle)  # noqa: E731
    ordered = lambda: built.graph.execute(tuple(addresses), workspace, handle=handle, tensor_uids=uids)  # noqa: E731
    print(f"execute, uid->address dict: {timed(mapping, n=2000):7.1f} us/call")
    try:
        print(f"execute, ordered addresses: {timed(ordered, n=2000):7.1f} us/call")
    except Exception as error:
        print(f"execute, ordered addresses: failed: {type(error).__name__}: {error}")


def main() -> None:
    B, H, S, D = (int(x) for x in sys.argv[1:5]) if len(sys.argv) >= 5 else (1, 8, 128, 64)
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (B, S, H, D), jnp.bfloat16) for key in keys)
    ours = lambda q, k, v: fj.attention(q, k, v, backend="cudnn")  # noqa: E731
    peer = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn")  # noqa: E731
    for name, fn in (("ours", ours), ("jax_cudnn", peer)):
        fwd = jax.jit(fn)
        both = jax.jit(lambda q, k, v, fn=fn: jax.grad(lambda *x: fn(*x).astype(jnp.float32).sum(),
                                                       argnums=(0, 1, 2))(q, k, v))
        print(f"{name:10s} fwd {per_call_us(fwd, q, k, v):8.1f} us/call   "
              f"fwd+bwd {per_call_us(both, q, k, v):8.1f} us/call", flush=True)

    backend = get_backend("cudnn")
    spent = {"forward": 0.0, "backward": 0.0, "calls": 0}
    real_forward, real_backward = backend.forward_into, backend.backward_into

    def timed(direction, fn):
        def wrapper(*args):
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                spent[direction] += time.perf_counter() - start
                spent["calls"] += direction == "forward"
        return wrapper

    backend.forward_into, backend.backward_into = timed("forward", real_forward), timed("backward", real_backward)
    both = jax.jit(lambda q, k, v: jax.grad(lambda *x: ours(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v))
    total = per_call_us(both, q, k, v, n=500)
    calls = max(spent["calls"], 1)  # 0 when the raw-address path ran (it bypasses forward_into)
    print(f"inside backend.forward_into {spent['forward'] / calls * 1e6:.1f} us, backward_into "
          f"{spent['backward'] / calls * 1e6:.1f} us, whole fwd+bwd call {total:.1f} us")
    backend.forward_into, backend.backward_into = real_forward, real_backward

    execute_forms(B, H, S, D)
    profile = cProfile.Profile()
    profile.enable()
    per_call_us(both, q, k, v, n=300)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
