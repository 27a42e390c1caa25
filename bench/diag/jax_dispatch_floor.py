"""The host time of the cheapest jitted JAX call (one tiny kernel, and two), back to back, beside torch's
eager x + 1: the floor under any JAX row whose GPU time is shorter (the S=1024 forwards of bench_jax)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

CALLS = 3000


def per_call_us(step, x) -> float:
    """Median over 5 loops of CALLS back-to-back calls then one wait, per call."""
    jax.block_until_ready(step(x))
    loops = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(CALLS):
            out = step(x)
        jax.block_until_ready(out)
        loops.append((time.perf_counter() - began) / CALLS * 1e6)
    return float(np.median(loops))


def torch_us() -> float:
    t = torch.ones(8, device="cuda")
    for _ in range(100):
        t + 1
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(CALLS):
        t + 1
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / CALLS * 1e6


def main():
    x = jnp.ones((8,), jnp.float32)
    one = per_call_us(jax.jit(lambda x: x + 1), x)
    two = per_call_us(jax.jit(lambda x: jnp.sin(x + 1).sum() * x), x)
    print(f"jax dispatch floor: jit(x + 1) {one:.1f} us/call, a two-kernel jit {two:.1f} us/call")
    print(f"torch eager x + 1: {torch_us():.1f} us/call")


if __name__ == "__main__":
    main()
