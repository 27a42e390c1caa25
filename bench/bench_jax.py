"""jax suite: fusedattn.jax.attention against jax.nn.dot_product_attention under jax.jit, same inputs, one process.

ours       fusedattn.jax.attention(q, k, v, layout="bshd", mask=..., scale=D**-0.5, backend="cudnn")
jax_cudnn  jax.nn.dot_product_attention(q, k, v, scale=D**-0.5, is_causal=..., implementation="cudnn")
jax_xla    the same with implementation="xla" (only S <= 4096: it materialises B*H*S*S scores)

Workloads: bf16 (B, S, H, D) arrays (bshd, jax.nn's layout), B=4, H=16, S in {1024, 4096, 16384}, D in
{64, 128}, causal and not (--quick: S in {1024, 4096}, D=128). "fwd" is the jitted forward; "fwd+bwd" the
jit of jax.vjp returning the output and the (q, k, v) gradients for a fixed random cotangent (nothing is
dead code). Per-call overhead at B=1, H=8, S=128, D=64: rows overhead-b1-h8-s128-d64-{loop,latency}-<mode>
with params.us_per_call and params.ours_minus_jax_cudnn_us.

Timing is wall clock, dispatch included, after compiling and --warmup calls. "loop" (every other row too):
median over --repeats loops of N back-to-back calls then one block_until_ready, per call (N fills about
--loop-ms): steady-state throughput. "latency": median of single calls each followed by block_until_ready.
The contestants' loops are interleaved (ours, jax_cudnn, jax_xla, ours, ...): at S=1024 every one of them
is bound by JAX's dispatch (about 45 us a call on the H200 host), and a drift of the host during a row
used to move one contestant's numbers only.
FLOPs, ratio_vs_best_peer (best peer ms / ours ms), error entries and the JSON as in bench_cudnn;
max_abs_diff_vs_sdpa / max_abs_grad_diff_vs_sdpa: max |ours - max_abs_diff_ref| over the output / the
gradients, the reference being the first of jax_cudnn, jax_xla that ran. Results: bench/results/jax.json,
rewritten after every row. XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.6 (ours' torch shares the GPU).

    python bench/bench_jax.py --quick
    python bench/bench_jax.py --cpu-smoke     # S=128, D=64 on the CPU, ours on the reference backend
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # before jax allocates its pool

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

try:  # python -m bench.bench_jax
    from . import bench_cudnn, common
except ImportError:  # python bench/bench_jax.py
    import bench_cudnn
    import common

SUITE = "jax"
OURS_BACKEND = "cudnn"
PEERS = {"jax_cudnn": "cudnn", "jax_xla": "xla"}  # name -> jax.nn.dot_product_attention(implementation=)
XLA_MAX_S = 4096
XLA_SKIPPED = "skipped: materialises B*H*S*S scores"
MAX_CALLS = 10000  # per timed loop
MAX_LATENCY_SAMPLES = 2000
SEED = 1234


@dataclass(frozen=True)
class Case:
    """One input shape; each case runs in every mode. Overhead cases time "loop" or "latency"."""

    B: int
    H: int
    S: int
    D: int
    causal: bool
    timing: str = "loop"
    overhead: bool = False

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "none"

    @property
    def name(self) -> str:
        shape = f"b{self.B}-h{self.H}-s{self.S}-d{self.D}"
        return f"overhead-{shape}-{self.timing}" if self.overhead else f"bshd-{shape}-{self.mask}"

    def flops(self, mode: str) -> float:
        return common.attention_flops(self.B, self.H, self.S, self.S, self.D, causal=self.causal, mode=mode)

    def params(self, mode: str) -> dict:
        return {"layout": "bshd", "B": self.B, "Sq": self.S, "Skv": self.S, "Hq": self.H, "Hkv": self.H,
                "D": self.D, "dtype": "bfloat16", "mask": self.mask, "mode": mode}


def make_cases(seqlens: list[int], head_dims: list[int]) -> list[Case]:
    """The overhead rows, then the grid by growing S (a cut-off run keeps most rows)."""
    grid = [Case(4, 16, s, d, causal) for s in sorted(seqlens) for d in head_dims for causal in (False, True)]
    return [Case(1, 8, 128, 64, False, timing, overhead=True) for timing in ("loop", "latency")] + grid


# --- implementations and timing -----------------------------------------------------------------------------------

def attention_fn(name: str, case: Case, backend: str):
    """(q, k, v) -> out of one implementation, not jitted."""
    if name == "ours":
        import fusedattn.jax as faj

        return partial(faj.attention, layout="bshd", mask=case.mask, scale=case.D ** -0.5, backend=backend)
    return partial(jax.nn.dot_product_attention, scale=case.D ** -0.5, is_causal=case.causal,
                   implementation=PEERS[name])


def jitted(fn, mode: str):
    """The timed step: jit(fn), or jit of the output and the vjp's (dq, dk, dv) for a given cotangent."""
    if mode == common.FWD:
        return jax.jit(lambda q, k, v: (fn(q, k, v),))

    def fwd_bwd(q, k, v, cotangent):
        out, pullback = jax.vjp(fn, q, k, v)
        return (out, *pullback(cotangent))
    return jax.jit(fwd_bwd)


def make_inputs(case: Case, device) -> list[jax.Array]:
    """q, k, v and the output cotangent, committed to `device`."""
    keys = jax.random.split(jax.random.key(SEED), 4)
    with jax.default_device(device):  # made there, then committed: jit runs where its inputs are
        return [jax.device_put(jax.random.normal(key, (case.B, case.S, case.H, case.D), jnp.bfloat16), device)
                for key in keys]


def timed_ms(step, inputs, samples: int, calls: int) -> float:
    """Median over `samples` of the wall time of `calls` back-to-back calls then one block_until_ready, per call."""
    times = []
    for _ in range(samples):
        began = time.perf_counter()
        for _ in range(calls):
            out = step(*inputs)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - began) * 1e3 / calls)
    return statistics.median(times)


def prepare(name: str, case: Case, mode: str, inputs, args) -> tuple[dict | None, tuple | None, object, int | None]:
    """(an error entry or None, the first call's outputs, the compiled step, the calls that fill a
    --loop-ms loop); never raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = jitted(attention_fn(name, case, args.ours_backend), mode)
            outputs = jax.block_until_ready(step(*inputs))  # compiles
            for _ in range(args.warmup):
                jax.block_until_ready(step(*inputs))
            calls = max(1, min(MAX_CALLS, round(args.loop_ms / timed_ms(step, inputs, 3, 1))))
            return None, outputs, step, calls
        except Exception as error:  # any failure of a peer (or of ours) becomes an entry
            return common.error_entry(error, caught), None, None, None


def measure_interleaved(steps: dict, calls: dict, case: Case, inputs, args) -> dict:
    """{name: {"ms": median}} with the contestants' loops taken in turn (ours, peer, ours, peer, ...), so
    a drift of the host or the GPU during the row touches all of them alike. A loop row's sample is
    one loop of calls[name] calls; a latency row takes single calls, as many as the loops would make
    (at most MAX_LATENCY_SAMPLES), spread over the rounds."""
    samples = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            if case.timing == "latency":
                per_round = max(1, min(MAX_LATENCY_SAMPLES, args.repeats * calls[name]) // args.repeats)
                samples[name] += [timed_ms(step, inputs, 1, 1) for _ in range(per_round)]
            else:
                samples[name].append(timed_ms(step, inputs, 1, calls[name]))
    return {name: {"ms": statistics.median(times)} for name, times in samples.items()}


def max_abs_diff(ours: tuple, theirs: tuple) -> float:
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(ours, theirs))


# --- one row --------------------------------------------------------------------------------------------------------

def run_row(case: Case, mode: str, args, device) -> dict:
    flops = case.flops(mode)
    inputs = make_inputs(case, device)[: 4 if mode == common.FWD_BWD else 3]
    params = {**case.params(mode), "flops": int(flops), "timing": case.timing, "warmup": args.warmup,
              "repeats": args.repeats, "loop_ms": args.loop_ms, "calls_per_loop": {}, "jit": True,
              "l2_flushed": False, "max_abs_diff_vs_sdpa": None, "max_abs_diff_ref": None}
    entries, reference, steps, calls_of = {}, None, {}, {}
    for name in ("ours", *PEERS):
        if name == "jax_xla" and case.S > XLA_MAX_S:
            entries[name] = {"error": XLA_SKIPPED}
            continue
        error, outputs, step, calls = prepare(name, case, mode, inputs, args)
        if error is not None:
            entries[name] = error
            continue
        steps[name], calls_of[name] = step, calls
        params["calls_per_loop"][name] = 1 if case.timing == "latency" else calls
        if name == "ours":
            reference = outputs
        elif outputs is not None and reference is not None and params["max_abs_diff_ref"] is None:
            try:
                params["max_abs_diff_vs_sdpa"] = max_abs_diff(reference[:1], outputs[:1])
                if mode == common.FWD_BWD:
                    params["max_abs_grad_diff_vs_sdpa"] = max_abs_diff(reference[1:], outputs[1:])
            except Exception as error:
                params["max_abs_diff_vs_sdpa"] = common.error_entry(error)["error"]
            params["max_abs_diff_ref"] = name
        del outputs
    timed = measure_interleaved(steps, calls_of, case, inputs, args)
    entries = {name: bench_cudnn._with_value(timed.get(name, entries.get(name)), flops) for name in ("ours", *PEERS)}
    del reference, inputs, steps
    params["timing_order"] = "interleaved"

    if case.overhead:
        us = {name: round(e["ms"] * 1e3, 2) for name, e in entries.items() if "ms" in e}
        params["us_per_call"] = us
        params["ours_minus_jax_cudnn_us"] = (round(us["ours"] - us["jax_cudnn"], 2)
                                             if "ours" in us and "jax_cudnn" in us else None)
    ours = {"backend": args.ours_backend, **entries.pop("ours")}
    ratio = common.best_peer_ratio(ours, entries)
    return {"workload": f"{case.name}-{mode}", "params": params, "metric": "tflops", "ours": ours,
            "peers": entries, "ratio_vs_best_peer": None if ratio is None else round(ratio, 4)}


# --- command line ---------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_jax.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only S in {1024, 4096} and D = 128")
    parser.add_argument("--seqlens", type=bench_cudnn._int_list, default=None, help="override S (comma-separated)")
    parser.add_argument("--head-dims", type=bench_cudnn._int_list, default=None, help="override D (comma-separated)")
    parser.add_argument("--modes", type=common.choice_list(common.MODES), default=list(common.MODES),
                        help=f"modes, comma-separated (default {','.join(common.MODES)})")
    parser.add_argument("--only", metavar="REGEX", default=None,
                        help="run workloads whose name matches (re.search, or a plain substring; see --list)")
    parser.add_argument("--list", action="store_true", help="print the workload names and exit")
    parser.add_argument("--out", default=None, help="results file (default bench/results/jax.json; "
                        "jax-ours-<backend>.json with another --ours-backend; a temporary file with --cpu-smoke)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows (and peers) of an existing --out file that this run does not measure")
    parser.add_argument("--repeats", type=int, default=10, help="timed loops per entry, median taken (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls after compiling (default 3)")
    parser.add_argument("--loop-ms", type=float, default=100.0, help="a timed loop lasts about this (default 100)")
    parser.add_argument("--ours-backend", "--backend", dest="ours_backend", default=OURS_BACKEND,
                        help="fusedattn backend forced for ours (default cudnn; another: suite jax-ours-<backend>)")
    parser.add_argument("--cpu-smoke", action="store_true", help="on the CPU: S=128, D=64, few timings, ours on "
                        "the reference backend (jax_cudnn fails into an error entry), results in a temporary file")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.ours_backend = "reference" if args.ours_backend == OURS_BACKEND else args.ours_backend
        args.seqlens, args.head_dims = args.seqlens or [128], args.head_dims or [64]
        args.repeats, args.warmup, args.loop_ms = min(args.repeats, 3), min(args.warmup, 1), min(args.loop_ms, 5.0)
        args.out = args.out or os.path.join(tempfile.gettempdir(), "fusedattn-bench-jax-smoke.json")
    if args.repeats < 1 or args.warmup < 0 or args.loop_ms <= 0:
        parser.error(f"expected --repeats >= 1, --warmup >= 0, --loop-ms > 0, got {args.repeats}, {args.warmup}, "
                     f"{args.loop_ms}")
    args.suite = SUITE if args.ours_backend == OURS_BACKEND else f"{SUITE}-ours-{args.ours_backend}"
    args.out = args.out or str(common.RESULTS / f"{args.suite}.json")
    return args


def _launch_path(args) -> str:
    """How our cuDNN calls launch: the native XLA custom call, or Python buffer callbacks (and why)."""
    if args.cpu_smoke:
        return "reference (cpu smoke)"
    from fusedattn.jax import native

    reason = native.unavailable()
    return "native custom call" if reason is None else f"buffer callbacks ({reason[:300]})"


def main(argv=None) -> int:
    args = parse_args(argv)
    seqlens, head_dims = bench_cudnn.shape_grid(args)
    rows = [(case, mode) for case in make_cases(seqlens, head_dims) for mode in args.modes
            if common.workload_matches(args.only, f"{case.name}-{mode}")]
    listed = common.list_or_missing("bench_jax", args, rows)
    if listed is not None:
        return listed
    device = jax.devices("cpu")[0] if args.cpu_smoke else jax.devices()[0]
    if device.platform != "gpu" and not args.cpu_smoke:
        print(f"bench_jax: JAX sees no GPU (default device {device}); run on a GPU machine, or --cpu-smoke",
              file=sys.stderr)
        return 2
    import jaxlib

    name = device.device_kind if device.platform == "gpu" else f"cpu ({platform.processor() or platform.machine()})"
    found = {**common.versions(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
             "xla_platform": " ".join(f"{device.platform} {getattr(device.client, 'platform_version', '')}".split()),
             "ours_launch": _launch_path(args)}
    header = {"suite": args.suite, "device": name, "date": common.today(), "versions": found}
    print(f"suite {args.suite} on {name}, {header['date']}; {len(rows)} rows -> {args.out}", flush=True)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()), flush=True)
    print(f"jit; wall-clock median of {args.repeats} loops of ~{args.loop_ms:g} ms (calls, then one "
          "block_until_ready); latency rows: single call + block", flush=True)
    results, table = common.ResultsFile(args.out, header, merge=args.merge), common.LiveTable(list(PEERS))
    began = time.perf_counter()
    for case, mode in rows:
        row_began = time.perf_counter()
        try:
            row = run_row(case, mode, args, device)
        except Exception as error:  # a fault of the script: keep going, the row records it
            traceback.print_exc()
            row = common.harness_error_row(f"{case.name}-{mode}", case.params(mode), args.ours_backend, error)
        results.add(row)
        table.row(row, seconds=time.perf_counter() - row_began)
        if "us_per_call" in row["params"]:
            us, diff = row["params"]["us_per_call"], row["params"]["ours_minus_jax_cudnn_us"]
            print("    us/call: " + ", ".join(f"{n} {t:.1f}" for n, t in us.items())
                  + ("" if diff is None else f"; ours - jax_cudnn = {diff:+.1f} us"), flush=True)
    print(f"wrote {len(results.rows)} rows to {args.out} in {time.perf_counter() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
