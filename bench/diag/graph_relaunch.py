"""Does the host wait when it launches a CUDA graph whose previous launch has not run yet?

With the GPU held by a spin kernel, times n back-to-back launches (host us per launch): one graph
launched n times, k graphs of the same work in turn, and plain kernel launches; then the host cost of
an event record and query, the guard a replay would need to avoid such a wait; then the same held
loops of fusedattn's forward (B1 S128 H8 D64 causal), which replays from the launch core's graphs.
Prints one line each (FUSEDATTN_NATIVE_PROFILE=1 adds the core's steps at exit).
"""

from __future__ import annotations

import time

import torch


def held_us(launch, n: int, hold_cycles: int = 2_000_000_000) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(hold_cycles)
    began = time.perf_counter()
    for i in range(n):
        launch(i)
    host = (time.perf_counter() - began) / n * 1e6
    torch.cuda.synchronize()
    return host


def main() -> None:
    x = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.add_(1)
    torch.cuda.synchronize()
    graphs = []
    for _ in range(8):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        graphs.append(graph)
    for n in (8, 32, 128):
        line = [f"n={n}: kernel {held_us(lambda i: x.add_(1), n):7.1f}"]
        for k in (1, 2, 8):
            line.append(f"{k} graph(s) {held_us(lambda i, k=k: graphs[i % k].replay(), n):9.1f}")
        print(" | ".join(line), "us/launch (GPU held)", flush=True)
    event = torch.cuda.Event()
    for _ in range(100):
        event.record()
        event.query()
    began = time.perf_counter()
    for _ in range(1000):
        event.record()
        event.query()
    print(f"event record + query: {(time.perf_counter() - began) / 1000 * 1e6:.2f} us", flush=True)

    import fusedattn.torch as fat
    from fusedattn.backends.cudnn.native import core

    queries = [torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(16)]
    with torch.no_grad():
        for q in queries:  # each q is its own key: captured on its second call
            for _ in range(3):
                fat.attention(q, q, q, mask="causal")
        for keys, n in ((1, 8), (1, 12), (1, 16), (1, 24), (1, 32), (8, 64), (16, 64), (16, 128)):
            before = core.replay_counts()
            host = held_us(lambda i, keys=keys: fat.attention(*[queries[i % keys]] * 3, mask="causal"), n)
            after = core.replay_counts()
            routes = {key: after[key] - before[key] for key in after}
            print(f"{keys} key(s), n={n}: fusedattn forward {host:7.1f} us/call (GPU held), launches {routes}",
                  flush=True)


if __name__ == "__main__":
    main()
