"""The first jitted call of a fresh process, ours against jax.nn's cuDNN attention (issue "JAX without
torch": with the native library built, the first call should cost XLA's own compile time plus the
cuDNN graph build, nothing more).

Each measurement runs in its own fresh process: trace and lower (ours: selection, the probe and the
graph builds happen here), XLA compile, then the first run (block_until_ready). Ours also reports
the time spent building cuDNN graphs (graph_cache's builders, timed). Forward+backward of a causal
call at B4 H16 S1024 D128 bf16 by default.

    python bench/diag/jax_first_call.py [--out bench/results/jax-first-call.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SHAPE = (4, 1024, 16, 128)


def _measure(impl: str) -> dict:
    import jax
    import jax.numpy as jnp

    started = time.perf_counter()
    building = {"s": 0.0}
    if impl == "ours":
        import fusedattn.jax as fj
        from fusedattn.backends.cudnn import graph_cache

        for name in ("build_forward", "build_backward"):
            original = getattr(graph_cache, name)

            def timed(*args, _original=original, **kwargs):
                begin = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    building["s"] += time.perf_counter() - begin

            setattr(graph_cache, name, timed)

        def attend(q, k, v):
            return fj.attention(q, k, v, mask="causal", backend="cudnn")
    else:
        def attend(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, SHAPE, jnp.bfloat16) for key in keys)
    jax.block_until_ready((q, k, v))
    imported = time.perf_counter()

    def step(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(out)

    begin = time.perf_counter()
    lowered = jax.jit(step).lower(q, k, v)
    traced = time.perf_counter()
    compiled = lowered.compile()
    built = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    done = time.perf_counter()
    return {"impl": impl, "import_and_inputs_s": round(imported - started, 3),
            "trace_and_lower_s": round(traced - begin, 3), "xla_compile_s": round(built - traced, 3),
            "first_run_s": round(done - built, 3), "first_call_s": round(done - begin, 3),
            "cudnn_graph_build_s": round(building["s"], 3) if impl == "ours" else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("ours", "jax_nn_cudnn"), help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.impl:
        print(json.dumps(_measure(args.impl)))
        return
    rows = []
    for impl in ("ours", "jax_nn_cudnn", "ours"):  # ours twice: the second with every cache on disk warm
        result = subprocess.run([sys.executable, __file__, "--impl", impl], capture_output=True, text=True)
        if result.returncode:
            raise SystemExit(result.stderr[-4000:])
        rows.append(json.loads(result.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    ours, peer = rows[2], rows[1]
    extra = ours["first_call_s"] - peer["first_call_s"] - ours["cudnn_graph_build_s"]
    print(f"ours first call {ours['first_call_s']:.2f} s = jax.nn's {peer['first_call_s']:.2f} s + graph build "
          f"{ours['cudnn_graph_build_s']:.2f} s + {extra:+.2f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape_bshd": SHAPE, "rows": rows, "ours_minus_peer_minus_graph_build_s": round(extra, 3)},
                      f, indent=1)


if __name__ == "__main__":
    main()
