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
    calls = spent["calls"]
    print(f"inside backend.forward_into {spent['forward'] / calls * 1e6:.1f} us, backward_into "
          f"{spent['backward'] / calls * 1e6:.1f} us, whole fwd+bwd call {total:.1f} us")
    backend.forward_into, backend.backward_into = real_forward, real_backward

    profile = cProfile.Profile()
    profile.enable()
    per_call_us(both, q, k, v, n=300)
    profile.disable()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())


if __name__ == "__main__":
    main()
