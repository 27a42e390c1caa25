"""jax suite: fusedattn.jax.attention against jax.nn.dot_product_attention under jax.jit, same inputs, one process.

ours       fusedattn.jax.attention(q, k, v, layout="bshd", mask=..., scale=D**-0.5, backend="cudnn")
jax_cudnn  jax.nn.dot_product_attention(q, k, v, scale=D**-0.5, is_causal=..., implementation="cudnn")
jax_xla    the same with implementation="xla" (only S <= 4096: it materialises B*H*S*S scores)

Workloads: bf16 (B, S, H, D) arrays (bshd, jax.nn's layout), B=4, H=16, S in {1024, 4096, 16384}, D in
{64, 128}, causal and not (--quick: S in {1024, 4096}, D=128). "fwd" is the jitted forward; "fwd+bwd" the
jit of jax.vjp returning the output and the (q, k, v) gradients for a fixed random cotangent (nothing is
dead code). Per-call overhead at B=1, H=8, S=128, D=64: rows overhead-b1-h8-s128-d64-{loop,latency}-<mode>
with params.us_per_call and params.ours_minus_jax_cudnn_us.

Feature rows (issue "JAX without torch"; --features runs only them): B=4, H=16, D=128, S in {1024, 4096}
(--seqlens overrides), bf16, named <feature>-b4-h16-s<S>-d128-<mode>: plain (causal), bias (post-scale
(1, H, S, S)), padding (mask="padding" from cu_seqlens; lengths S and 3S/4 in turn), window ((256, 0),
causal), sink (learnable, (H,) float32), softcap (score_mod softcap(30), causal), thd (the B*S tokens as 4
unequal causal sequences, static max_seqlen), then small_seq-b30720-h16-sq1-skv16-d128 (backend="small_seq",
q (B, 1, H, D), k and v (B, 16, H, D)); bench/feature_rows.py defines them and their inputs (NumPy, seeded).
Arrays other than q, k, v (bias, sink, cu_seqlens, jax.nn's sequence lengths) are arguments of the jitted
step, not differentiated. The jax.nn peers run where they can express the call (bias; padding through
query_seq_lengths/key_value_seq_lengths; window through local_window_size; small_seq as plain attention);
elsewhere their entry says why ("skipped: ..."). Padding rows compare outputs on unpadded query rows (the
cotangent is 0 on padded ones). Each feature row also records:
  host_us        (S <= 1024) {contestant: us}: host time of a call at the row's shape: median over 20 rounds
                 of the wall time to issue the last 12 of 16 back-to-back calls, the queue empty at the
                 round's start and the timer stopped before block_until_ready (the first calls after the
                 queue drains return slower; XLA keeps 32 in flight, so none waits for the GPU), per call
  host_loop_us   (S <= 1024) ours at a tiny shape (B=2, S=256, same feature): per-call wall time of
                 back-to-back loops ended by block_until_ready, so XLA's own threads count too; the GPU time
                 there is small
  plain_host_us, host_us_minus_plain, plain_host_loop_us, host_loop_us_minus_plain: the same of ours on the
                 plain call of the row's S and mode, its rounds and loops interleaved with the row's (the
                 acceptance: within 15 us at S=1024)
  torch_path     (--torch-peer; sink, softcap, thd, small_seq) fusedattn.torch.attention on the same NumPy data
                 in a subprocess (bench/torch_path_peer.py, both modes of a case in one; torch sets up no CUDA
                 here), timed the same way (wall clock, back-to-back, one synchronize per loop): a peer entry,
                 params.torch_path_us, torch_path_ratio (its time / ours) and torch_path_max_abs_diff /
                 _grad_diff (sampled outputs and gradients; the row's check where no jax.nn peer ran)
  small_seq      params.bytes (bench_small_seq's count), ours_GBps, copy_GBps (jax.jit(jnp.copy) of a
                 --copy-gib bf16 array: reads and writes its size; back-to-back, once per run),
                 fraction_of_copy (the acceptance: >= 0.85 in fwd and fwd+bwd), ours_launch
  torch_cuda_in_jax_process: whether torch (which bench/common.py imports) has set up CUDA in this process;
                 on a GPU the header's versions are read in a subprocess, as reading them does that
A summary of the feature rows (peer time / ours, host times) ends the run.

Timing is wall clock, dispatch included, after compiling and --warmup calls. "loop" (every other row too):
median over --repeats loops of N back-to-back calls then one block_until_ready, per call (N fills about
--loop-ms): steady-state throughput. "latency": median of single calls each followed by block_until_ready.
The contestants' loops are interleaved (ours, jax_cudnn, jax_xla, ours, ...): at S=1024 every one of them
is bound by JAX's dispatch (about 45 us a call on the H200 host), and a drift of the host during a row
used to move one contestant's numbers only.
FLOPs (feature rows: of the visible (query, key) pairs, causal counted as L*L/2), ratio_vs_best_peer (best
peer ms / ours ms), error entries and the JSON as in bench_cudnn; max_abs_diff_vs_sdpa /
max_abs_grad_diff_vs_sdpa: max |ours - max_abs_diff_ref| over the output / the gradients, the reference
being the first of jax_cudnn, jax_xla that ran. Results: bench/results/jax.json, rewritten after every row.
XLA_PYTHON_CLIENT_MEM_FRACTION defaults to 0.6 (the --torch-peer subprocess shares the GPU).

    python bench/bench_jax.py --quick
    python bench/bench_jax.py --features --torch-peer --merge --repeats 5 --loop-ms 50   # ~4 min on an H100
    python bench/bench_jax.py --cpu-smoke     # S=128, D=64 on the CPU (feature rows smaller), reference backend
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

# The environment this process started with, for the torch subprocess: jax-triton empties TRITON_CACHE_DIR when
# imported (a small_seq row imports it), which leaves torch's Triton without a cache.
STARTING_ENVIRONMENT = dict(os.environ)
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")  # before jax allocates its pool

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:  # python -m bench.bench_jax
    from . import bench_cudnn, common, feature_rows
except ImportError:  # python bench/bench_jax.py
    import bench_cudnn
    import common
    import feature_rows

SUITE = "jax"
OURS_BACKEND = "cudnn"
PEERS = {"jax_cudnn": "cudnn", "jax_xla": "xla"}  # name -> jax.nn.dot_product_attention(implementation=)
XLA_MAX_S = 4096
XLA_SKIPPED = "skipped: materialises B*H*S*S scores"
MAX_LATENCY_SAMPLES = 2000
SEED = 1234

FEATURE_SEQLENS = (1024, 4096)
FEATURE_SHAPE = {"B": 4, "H": 16, "D": 128}
SMALL_SEQ_SHAPE = {"B": 30720, "H": 16, "S": 16, "D": 128}  # the small_seq acceptance row
SMOKE_FEATURE_SHAPE = {"B": 2, "H": 2, "D": 32}
SMOKE_SMALL_SEQ_SHAPE = {"B": 64, "H": 2, "S": 16, "D": 32}
# What jax.nn.dot_product_attention has no keyword for.
PEER_CANNOT = {"sink": "sink logits (softmax_type='learnable')", "softcap": "a score_mod (logit softcap)",
               "thd": "packed (THD) sequences"}
TORCH_PATH = "torch_path"
TORCH_PATH_FEATURES = ("sink", "softcap", "thd", "small_seq")  # the rows the jax.nn peers cannot express, and small_seq
TORCH_PATH_SCRIPT = Path(__file__).resolve().with_name("torch_path_peer.py")
TORCH_PATH_TIMEOUT_S = 300
# Host-time rounds: HOST_CALLS back-to-back calls, the first HOST_SKIPPED untimed (the first calls after the queue
# drains return up to 4x slower, H100 at S=4096); fewer than the 32 XLA keeps in flight, so none waits for the GPU.
HOST_CALLS, HOST_SKIPPED = 16, 4
HOST_ROUNDS, HOST_LOOP_ROUNDS = 20, 10
HOST_MAX_S = 1024  # host times at S <= this (the acceptance is at S=1024; longer rows are bound by the GPU)
HOST_SHAPE = {"B": 2, "S": 256}  # host_loop_us: small enough that the GPU time is under the host's
COPY_GIB, SMOKE_COPY_GIB = 4.0, 1 / 256
COPY_LOOPS, COPY_LOOP_MS, COPY_ROW = 5, 100.0, 1 << 16


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


def feature_cases(args) -> list[feature_rows.FeatureCase]:
    """By growing S every feature but small_seq, plain first (the others' host times are compared with its),
    then small_seq."""
    shape = SMOKE_FEATURE_SHAPE if args.cpu_smoke else FEATURE_SHAPE
    cases = [feature_rows.FeatureCase(feature, S=s, **shape) for s in sorted(args.seqlens or FEATURE_SEQLENS)
             for feature in feature_rows.FEATURES if feature != "small_seq"]
    small_seq = SMOKE_SMALL_SEQ_SHAPE if args.cpu_smoke else SMALL_SEQ_SHAPE
    return cases + [feature_rows.FeatureCase("small_seq", **small_seq)]


# --- implementations and timing -----------------------------------------------------------------------------------

def attention_fn(name: str, case: Case, backend: str):
    """(q, k, v) -> out of one implementation, not jitted."""
    if name == "ours":
        import fusedattn.jax as faj

        return partial(faj.attention, layout="bshd", mask=case.mask, scale=case.D ** -0.5, backend=backend)
    return partial(jax.nn.dot_product_attention, scale=case.D ** -0.5, is_causal=case.causal,
                   implementation=PEERS[name])


def jitted(fn, mode: str):
    """The timed step: jit(fn), or jit of the output and the vjp's (dq, dk, dv) for a given cotangent.
    Arguments after q, k, v (and the cotangent) go to fn as they are, not differentiated."""
    if mode == common.FWD:
        return jax.jit(lambda q, k, v, *extras: (fn(q, k, v, *extras),))

    def fwd_bwd(q, k, v, cotangent, *extras):
        out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, *extras), q, k, v)
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
    return feature_rows.loop_ms(step, inputs, jax.block_until_ready, samples, calls)


def prepare(fn, mode: str, inputs, args) -> tuple[dict | None, tuple | None, object, int | None]:
    """(an error entry or None, the first call's outputs, the compiled step of fn, the calls that fill a
    --loop-ms loop); never raises."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            step = jitted(fn, mode)
            outputs = jax.block_until_ready(step(*inputs))  # compiles
            for _ in range(args.warmup):
                jax.block_until_ready(step(*inputs))
            return None, outputs, step, feature_rows.loop_calls(step, inputs, jax.block_until_ready, args.loop_ms)
        except Exception as error:  # any failure of a peer (or of ours) becomes an entry
            return common.error_entry(error, caught), None, None, None


def measure_interleaved(steps: dict, calls: dict, inputs: dict, rounds: int, latency: bool = False) -> dict:
    """{name: {"ms": median}} with the contestants' loops taken in turn (ours, peer, ours, peer, ...), so
    a drift of the host or the GPU during the row touches all of them alike. A loop row's sample is
    one loop of calls[name] calls; a latency row takes single calls, as many as the loops would make
    (at most MAX_LATENCY_SAMPLES), spread over the rounds. inputs: name -> its arguments."""
    samples = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            if latency:
                per_round = max(1, min(MAX_LATENCY_SAMPLES, rounds * calls[name]) // rounds)
                samples[name] += [timed_ms(step, inputs[name], 1, 1) for _ in range(per_round)]
            else:
                samples[name].append(timed_ms(step, inputs[name], 1, calls[name]))
    return {name: {"ms": statistics.median(times)} for name, times in samples.items()}


def max_abs_diff(ours: tuple, theirs: tuple) -> float:
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))) for a, b in zip(ours, theirs))


def record_diff(params: dict, reference: tuple, outputs: tuple, mode: str, name: str, valid=None) -> None:
    """The first peer's max |ours - peer| (output, then gradients) into params; `valid` (broadcastable to the
    output, or None) keeps the output rows compared."""
    if params["max_abs_diff_ref"] is not None:
        return
    kept = (lambda x: x) if valid is None else (lambda x: jnp.where(valid, x, 0))
    try:
        params["max_abs_diff_vs_sdpa"] = max_abs_diff((kept(reference[0]),), (kept(outputs[0]),))
        if mode == common.FWD_BWD:
            params["max_abs_grad_diff_vs_sdpa"] = max_abs_diff(reference[1:], outputs[1:])
    except Exception as error:
        params["max_abs_diff_vs_sdpa"] = common.error_entry(error)["error"]
    params["max_abs_diff_ref"] = name


def race(fns: dict, mode: str, inputs: dict, case, args, params: dict, valid=None) -> tuple[dict, dict, list]:
    """Each contestant compiled and its outputs checked against ours (the first), then all timed interleaved.
    fns: name -> fn, or the entry of one that cannot run; inputs: name -> its arguments. Returns
    ({name: {"ms"} or error entry}, {name: compiled step}, ours' outputs sampled for other processes' checks)."""
    entries, steps, calls_of, reference, samples = {}, {}, {}, None, []
    for name, fn in fns.items():
        error, outputs, step, calls = (fn, None, None, None) if isinstance(fn, dict) else prepare(
            fn, mode, inputs[name], args)
        if error is not None:
            entries[name] = error
            continue
        steps[name], calls_of[name] = step, calls
        params["calls_per_loop"][name] = 1 if case.timing == "latency" else calls
        if name == "ours":
            reference = outputs
            samples = [np.asarray(feature_rows.sample(x).astype(jnp.float32)) for x in outputs]
        elif reference is not None:
            record_diff(params, reference, outputs, mode, name, valid)
        del outputs
    del reference
    timed = measure_interleaved(steps, calls_of, inputs, args.repeats, latency=case.timing == "latency")
    return {name: timed.get(name, entries.get(name)) for name in fns}, steps, samples


def timing_params(flops: float, case, args) -> dict:
    return {"flops": int(flops), "timing": case.timing, "warmup": args.warmup, "repeats": args.repeats,
            "loop_ms": args.loop_ms, "calls_per_loop": {}, "jit": True, "l2_flushed": False,
            "timing_order": "interleaved", "max_abs_diff_vs_sdpa": None, "max_abs_diff_ref": None}


def finish_row(workload: str, params: dict, entries: dict, backend: str) -> dict:
    """The row, from entries with values: ours (popped) and the peers."""
    ours = {"backend": backend, **entries.pop("ours")}
    ratio = common.best_peer_ratio(ours, entries)
    return {"workload": workload, "params": params, "metric": "tflops", "ours": ours, "peers": entries,
            "ratio_vs_best_peer": None if ratio is None else round(ratio, 4)}


# --- one row --------------------------------------------------------------------------------------------------------

def run_row(case: Case, mode: str, args, device) -> dict:
    flops = case.flops(mode)
    shared = make_inputs(case, device)[: 4 if mode == common.FWD_BWD else 3]
    params = {**case.params(mode), **timing_params(flops, case, args)}
    fns = {name: {"error": XLA_SKIPPED} if name == "jax_xla" and case.S > XLA_MAX_S
           else attention_fn(name, case, args.ours_backend) for name in ("ours", *PEERS)}
    raw, _, _ = race(fns, mode, dict.fromkeys(fns, shared), case, args, params)
    del shared
    entries = {name: bench_cudnn._with_value(entry, flops) for name, entry in raw.items()}
    if case.overhead:
        us = {name: round(e["ms"] * 1e3, 2) for name, e in entries.items() if "ms" in e}
        params["us_per_call"] = us
        params["ours_minus_jax_cudnn_us"] = (round(us["ours"] - us["jax_cudnn"], 2)
                                             if "ours" in us and "jax_cudnn" in us else None)
    return finish_row(f"{case.name}-{mode}", params, entries, args.ours_backend)


# --- feature rows ---------------------------------------------------------------------------------------------------

def to_jax(arrays: dict, device) -> dict:
    """feature_rows.numpy_inputs' arrays committed to `device`, the bit patterns viewed as bfloat16."""
    made = {}
    for name, array in arrays.items():
        placed = jax.device_put(array, device)
        made[name] = jax.lax.bitcast_convert_type(placed, jnp.bfloat16) if feature_rows.is_bf16(name) else placed
    return made


def _with_keywords(call):
    """fn(q, k, v, traced) = call(q, k, v, **traced): arrays given by keyword are arguments of the jitted step."""
    return lambda q, k, v, traced: call(q, k, v, **traced)


def ours_fn(case: feature_rows.FeatureCase, arrays: dict, backend: str) -> tuple:
    """(fn(q, k, v, traced), traced) of fusedattn.jax.attention on the case."""
    import fusedattn.jax as faj

    static, traced = feature_rows.ours_keywords(case, arrays)
    return _with_keywords(partial(faj.attention, backend=backend, **static)), traced


def peer_fn(name: str, case: feature_rows.FeatureCase, arrays: dict) -> tuple | dict:
    """(fn(q, k, v, traced), traced) of jax.nn.dot_product_attention on the case, or the entry saying why not."""
    if case.feature in PEER_CANNOT:
        return {"error": f"skipped: jax.nn.dot_product_attention takes no {PEER_CANNOT[case.feature]}"}
    if name == "jax_xla" and case.S > XLA_MAX_S:
        return {"error": XLA_SKIPPED}
    static = {"scale": case.D ** -0.5, "is_causal": case.mask == "causal", "implementation": PEERS[name]}
    traced = {}
    if case.feature == "bias":
        traced["bias"] = arrays["bias"]
    elif case.feature == "padding":
        traced.update(query_seq_lengths=arrays["lengths"], key_value_seq_lengths=arrays["lengths"])
    elif case.feature == "window":
        static["local_window_size"] = case.window
    return _with_keywords(partial(jax.nn.dot_product_attention, **static)), traced


def row_backend(case: feature_rows.FeatureCase, args) -> str:
    """small_seq's row forces backend="small_seq" unless another --ours-backend (or --cpu-smoke's) was asked for."""
    return "small_seq" if case.feature == "small_seq" and args.ours_backend == OURS_BACKEND else args.ours_backend


def feature_flops(case: feature_rows.FeatureCase, mode: str) -> float:
    return common.attention_flops(1, case.H, case.visible_pairs(), 1, case.D, causal=False, mode=mode)


def step_inputs(arrays: dict, mode: str, traced: dict) -> list:
    """A step's arguments: q, k, v (and the cotangent), then its keyword arrays."""
    names = ("q", "k", "v", "cotangent") if mode == common.FWD_BWD else ("q", "k", "v")
    return [*(arrays[name] for name in names), traced]


def issue_us(steps: dict, rounds: int) -> dict:
    """{name: host us of a call} of (step, inputs) pairs: median over rounds (the pairs in turn) of the wall time
    to issue the last HOST_CALLS - HOST_SKIPPED of HOST_CALLS back-to-back calls (the queue empty at the round's
    start, the timer stopped before block_until_ready), per call."""
    times, timed = {name: [] for name in steps}, HOST_CALLS - HOST_SKIPPED
    for _ in range(rounds):
        for name, (step, inputs) in steps.items():
            for _ in range(HOST_SKIPPED):
                out = step(*inputs)
            began = time.perf_counter()
            for _ in range(timed):
                out = step(*inputs)
            times[name].append((time.perf_counter() - began) * 1e6 / timed)
            jax.block_until_ready(out)
    return {name: round(statistics.median(values), 2) for name, values in times.items()}


def copy_GBps(device, gib: float) -> float:
    """GB/s of jax.jit(jnp.copy) (XLA's device-to-device copy) of a `gib` GiB bf16 array, counting its size
    read and written; back-to-back calls timed as every row."""
    rows = max(1, int(gib * 2**30) // (2 * COPY_ROW))  # 2-D: no dimension near 2**31 elements
    with jax.default_device(device):
        x = jax.device_put(jnp.zeros((rows, COPY_ROW), jnp.bfloat16), device)
    step = jax.jit(jnp.copy)
    jax.block_until_ready(step(x))
    ms = timed_ms(step, [x], COPY_LOOPS, feature_rows.loop_calls(step, [x], jax.block_until_ready, COPY_LOOP_MS))
    del x
    return 2 * 2 * rows * COPY_ROW / (ms * 1e6)


def _bench_small_seq():
    """bench_small_seq, for its byte count and bandwidth fields (imported when a small_seq row runs)."""
    try:
        from . import bench_small_seq
    except ImportError:
        import bench_small_seq
    return bench_small_seq


def small_seq_launch(args) -> str:
    """How ours' small_seq kernels launch from JAX: jax-triton, or through torch (and why)."""
    if args.cpu_smoke:
        return "reference (cpu smoke)"
    try:
        from fusedattn.jax import small_seq_call

        reason = small_seq_call.unavailable()
    except Exception as error:
        reason = f"{type(error).__name__}: {error}"
    return "jax-triton" if reason is None else f"torch bridge ({reason[:300]})"


def _tiny(case: feature_rows.FeatureCase) -> feature_rows.FeatureCase:
    """The case at host_loop_us's shape."""
    return dataclasses.replace(case, B=HOST_SHAPE["B"], S=min(case.S, HOST_SHAPE["S"]))


def _minus(value, plain):
    return round(value - plain, 2) if isinstance(value, float) and isinstance(plain, float) else None


class FeatureRun:
    """What a run's feature rows share: the current case's arrays (both modes use them), ours compiled on the
    plain and tiny-shape calls of the host times, the torch path's results of the current case, the copy
    bandwidth (measured once) and ours' small_seq forward times."""

    def __init__(self, args, device, rows: list):
        self.args, self.device = args, device
        self.modes = {}  # case -> its modes in this run (the torch path measures them in one process)
        for case, mode in rows:
            self.modes.setdefault(case, []).append(mode)
        self.case, self.arrays = None, None
        self.steps: dict = {}  # (case, mode) -> ours' (step, inputs, calls), or why it failed
        self.torch: dict = {}  # case -> the torch path's (result, samples)
        self.copy = None  # what bench_small_seq.record_bandwidth reads: copy_GBps, forward_ms

    def inputs(self, case: feature_rows.FeatureCase) -> dict:
        if case != self.case:
            self.case, self.arrays = None, None  # the last case's arrays go first
            self.arrays, self.case = to_jax(feature_rows.numpy_inputs(case), self.device), case
        return self.arrays

    def compiled(self, case: feature_rows.FeatureCase, mode: str, backend: str) -> tuple | str:
        """Ours' (step, inputs, calls) on the case, compiled once on inputs of its own (or why it failed)."""
        if (case, mode) not in self.steps:
            arrays = to_jax(feature_rows.numpy_inputs(case), self.device)
            fn, traced = ours_fn(case, arrays, backend)
            inputs = step_inputs(arrays, mode, traced)
            error, _, step, calls = prepare(fn, mode, inputs, self.args)
            self.steps[case, mode] = error["error"] if error else (step, inputs, calls)
        return self.steps[case, mode]

    def host(self, case, mode: str, steps: dict, inputs: dict, calls: dict, backend: str) -> dict:
        """The host times of the module docstring: every contestant's and plain's at the row's shape, interleaved,
        then ours' and plain's at the tiny shape, interleaved; {} above HOST_MAX_S."""
        if case.S > HOST_MAX_S or "ours" not in steps:
            return {}
        plain = dataclasses.replace(case, feature="plain")
        if case in (plain, _tiny(case)):  # compiled() is asked for it again: not compiled twice
            self.steps.setdefault((case, mode), (steps["ours"], inputs["ours"], calls["ours"]))
        at_shape = {name: (steps[name], inputs[name]) for name in steps}
        at_tiny = {"ours": self.compiled(_tiny(case), mode, backend)}
        if case != plain:
            at_shape["plain"] = self.compiled(plain, mode, backend)
            at_tiny["plain"] = self.compiled(_tiny(plain), mode, backend)
        host = issue_us({name: got[:2] for name, got in at_shape.items() if isinstance(got, tuple)}, HOST_ROUNDS)
        ready = {name: got for name, got in at_tiny.items() if isinstance(got, tuple)}
        loops = measure_interleaved({n: s[0] for n, s in ready.items()}, {n: s[2] for n, s in ready.items()},
                                    {n: s[1] for n, s in ready.items()}, HOST_LOOP_ROUNDS)
        loop_us = {name: round(entry["ms"] * 1e3, 2) for name, entry in loops.items()}
        reference = "ours" if case == plain else "plain"
        return {"host_us": {name: us for name, us in host.items() if name != "plain"},
                "host_rounds": f"{HOST_ROUNDS} x {HOST_CALLS} calls, {HOST_SKIPPED} untimed",
                "plain_host_us": host.get(reference), "host_us_minus_plain": _minus(host.get("ours"),
                                                                                   host.get(reference)),
                "host_loop_us": loop_us.get("ours", at_tiny["ours"]), "host_loop_shape": _tiny(case).name,
                "plain_host_loop_us": loop_us.get(reference),
                "host_loop_us_minus_plain": _minus(loop_us.get("ours"), loop_us.get(reference))}

    def torch_path(self, case, mode: str, backend: str) -> tuple[dict, dict]:
        """The torch path's (result, samples) of the case: every mode of it measured in one subprocess."""
        if case not in self.torch:
            self.torch = {case: run_torch_path(case, self.modes[case], backend, self.args)}
        return self.torch[case]

    def bandwidth(self, case, mode: str, ours: dict) -> dict:
        """small_seq: bytes moved (bench_small_seq's count), ours' GB/s and its fraction of the copy bandwidth."""
        small_seq = _bench_small_seq()
        gib = self.args.copy_gib or (SMOKE_COPY_GIB if self.args.cpu_smoke else COPY_GIB)
        if self.copy is None:
            self.copy = SimpleNamespace(copy_GBps=copy_GBps(self.device, gib), forward_ms={})
            print(f"copy bandwidth: {self.copy.copy_GBps:.1f} GB/s (jax.jit(jnp.copy), {gib:g} GiB bf16)", flush=True)
        counted = small_seq.Case(small_seq.Batch(case.B), case.H, case.H, case.S, case.D)
        params = {"bytes": counted.moved_bytes(mode), "copy": f"jax.jit(jnp.copy) of {gib:g} GiB bf16"}
        ours_gbps = small_seq.with_value(ours, params["bytes"])
        small_seq.record_bandwidth(params, counted, mode, ours_gbps, self.copy)
        return {**params, "ours_GBps": ours_gbps.get("value")}


def run_torch_path(case, modes: list, backend: str, args) -> tuple[dict, dict]:
    """(result, samples) of bench/torch_path_peer.py on the case's modes, in a subprocess: result {"modes":
    {mode: {"ms", "calls_per_loop"} or an error entry}, "timing", "jax_loaded"} or an error entry."""
    request = {"case": dataclasses.asdict(case), "modes": modes, "backend": backend, "repeats": args.repeats,
               "device": "cpu" if args.cpu_smoke else "cuda", "warmup": args.warmup, "loop_ms": args.loop_ms}
    with tempfile.TemporaryDirectory(prefix="fusedattn-torch-path-") as folder:
        result_path, samples_path = Path(folder, "result.json"), Path(folder, "samples.npz")
        command = [sys.executable, str(TORCH_PATH_SCRIPT), "--request", json.dumps(request),
                   "--out", str(result_path), "--samples", str(samples_path)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=TORCH_PATH_TIMEOUT_S,
                                  env=STARTING_ENVIRONMENT)
        except subprocess.TimeoutExpired:
            return {"error": f"torch path: no result in {TORCH_PATH_TIMEOUT_S} s"}, {}
        if not result_path.exists():
            return common.error_entry(f"torch path: exited {done.returncode}: {done.stderr[-1000:]}"), {}
        if not samples_path.exists():
            return json.loads(result_path.read_text()), {}
        with np.load(samples_path) as samples:
            return json.loads(result_path.read_text()), dict(samples)


def add_torch_path(case, mode: str, backend: str, run: FeatureRun, ours_samples: list, raw: dict,
                   params: dict) -> None:
    """The torch path's entry into raw, its fields into params: its time over ours, and its sampled diffs
    (ours' outputs against its) as the row's check where no jax.nn peer ran."""
    result, samples = run.torch_path(case, mode, backend)
    raw[TORCH_PATH] = result["modes"][mode] if "modes" in result else result
    if "ms" not in raw[TORCH_PATH]:
        return
    diffs = [float(np.max(np.abs(ours - samples[f"{mode}_{i}"]))) for i, ours in enumerate(ours_samples)]
    params.update(torch_path_us=round(raw[TORCH_PATH]["ms"] * 1e3, 2), torch_path_timing=result["timing"],
                  torch_path_calls_per_loop=raw[TORCH_PATH]["calls_per_loop"],
                  torch_path_jax_loaded=result["jax_loaded"], torch_path_max_abs_diff=diffs[0] if diffs else None,
                  torch_path_max_abs_grad_diff=max(diffs[1:], default=None),
                  torch_path_process="bench/torch_path_peer.py")
    raw[TORCH_PATH] = {"ms": raw[TORCH_PATH]["ms"]}
    if "ms" in raw["ours"]:
        params["torch_path_ratio"] = round(params["torch_path_us"] / (raw["ours"]["ms"] * 1e3), 4)
    if params["max_abs_diff_ref"] is None and diffs:
        params.update(max_abs_diff_ref=f"{TORCH_PATH} (sampled)", max_abs_diff_vs_sdpa=diffs[0])
        if mode == common.FWD_BWD:
            params["max_abs_grad_diff_vs_sdpa"] = params["torch_path_max_abs_grad_diff"]


def versions_elsewhere() -> dict:
    """common.versions() (torch, cuDNN, fusedattn, ...) taken in a subprocess: it sets up torch's CUDA, which
    this JAX process is to go without."""
    done = subprocess.run([sys.executable, "-c", "import json, common; print(json.dumps(common.versions()))"],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300,
                          env=STARTING_ENVIRONMENT)
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"versions": f"not read (exit {done.returncode}): {done.stderr[-300:]}"}


def _torch_cuda_initialized() -> bool:
    """Whether torch (imported by bench/common.py) has set up CUDA in this, the JAX, process."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def run_feature_row(case: feature_rows.FeatureCase, mode: str, args, device, run: FeatureRun) -> dict:
    flops, backend = feature_flops(case, mode), row_backend(case, args)
    arrays = run.inputs(case)
    fns = {"ours": ours_fn(case, arrays, backend)}
    fns.update({name: peer_fn(name, case, arrays) for name in PEERS})
    inputs = {name: step_inputs(arrays, mode, fn[1]) for name, fn in fns.items() if isinstance(fn, tuple)}
    fns = {name: fn if isinstance(fn, dict) else fn[0] for name, fn in fns.items()}
    params = {**case.params(mode), **timing_params(flops, case, args)}
    valid = feature_rows.valid_rows(case)
    valid = None if valid is None else jax.device_put(valid, device)
    raw, steps, samples = race(fns, mode, inputs, case, args, params, valid)
    if case.feature != "small_seq":
        params.update(run.host(case, mode, steps, inputs, params["calls_per_loop"], backend))
    del steps, inputs
    if args.torch_peer and case.feature in TORCH_PATH_FEATURES:
        add_torch_path(case, mode, backend, run, samples, raw, params)
    if case.feature == "small_seq":
        params.update(run.bandwidth(case, mode, raw["ours"]), ours_launch=small_seq_launch(args))
    params["torch_cuda_in_jax_process"] = _torch_cuda_initialized()
    entries = {name: bench_cudnn._with_value(entry, flops) for name, entry in raw.items()}
    return finish_row(f"{case.name}-{mode}", params, entries, backend)


def _number(value, width: int, spec: str = ".1f") -> str:
    """value in spec, right-aligned in width; '-' when it is not a number."""
    return (format(value, spec) if isinstance(value, (int, float)) else "-").rjust(width)


def print_feature_summary(rows: list[dict], peers: list[str]) -> None:
    """Per feature row: ours' us, each peer's time / ours (> 1: ours faster), host times against plain's."""
    rows = [row for row in rows if "feature" in row["params"]]
    if not rows:
        return
    print("\nfeature rows: peer us / ours us (> 1: ours faster); host = ours' us per call issued, at the row's "
          "shape (- plain's); loop = ours' us per call in loops at B=2, S=256 (- plain's); copy = fraction of "
          "the copy bandwidth", flush=True)
    print(f"{'workload':<44} {'ours us':>9} | " + " ".join(f"{p:>10}" for p in peers)
          + f" | {'host':>6} {'-plain':>6} | {'loop':>6} {'-plain':>6} | {'copy':>5}", flush=True)
    for row in rows:
        ours, p = row["ours"].get("ms"), row["params"]
        peer_ms = [row["peers"].get(name, {}).get("ms") for name in peers]
        cells = [_number(ms / ours if ms and ours else None, 10, ".2f") for ms in peer_ms]
        print(f"{row['workload']:<44} {_number(ours and ours * 1e3, 9)} | " + " ".join(cells)
              + f" | {_number(p.get('host_us', {}).get('ours'), 6)} {_number(p.get('host_us_minus_plain'), 6, '+.1f')}"
              + f" | {_number(p.get('host_loop_us'), 6)} {_number(p.get('host_loop_us_minus_plain'), 6, '+.1f')}"
              + f" | {_number(p.get('fraction_of_copy'), 5, '.2f')}", flush=True)


# --- command line ---------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench_jax.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only S in {1024, 4096} and D = 128")
    parser.add_argument("--seqlens", type=bench_cudnn._int_list, default=None,
                        help="override S (comma-separated; feature rows too, small_seq's aside)")
    parser.add_argument("--head-dims", type=bench_cudnn._int_list, default=None, help="override D (comma-separated)")
    parser.add_argument("--modes", type=common.choice_list(common.MODES), default=list(common.MODES),
                        help=f"modes, comma-separated (default {','.join(common.MODES)})")
    parser.add_argument("--features", action="store_true",
                        help="only the feature rows (bias, padding, window, sink, softcap, thd, small_seq and plain)")
    parser.add_argument("--torch-peer", action="store_true", help="feature rows jax.nn cannot express, and "
                        "small_seq: also time fusedattn.torch on the same data, in a subprocess")
    parser.add_argument("--copy-gib", type=float, default=None,
                        help=f"size of the copy-bandwidth array in GiB (default {COPY_GIB:g}; {SMOKE_COPY_GIB:g} "
                             "with --cpu-smoke)")
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
                        help="fusedattn backend forced for ours (default cudnn, small_seq on its row; another: "
                             "suite jax-ours-<backend>)")
    parser.add_argument("--cpu-smoke", action="store_true", help="on the CPU: S=128, D=64 (feature rows B=2, H=2, "
                        "D=32), few timings, ours on the reference backend (jax_cudnn fails into an error entry), "
                        "results in a temporary file")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.ours_backend = "reference" if args.ours_backend == OURS_BACKEND else args.ours_backend
        args.seqlens, args.head_dims = args.seqlens or [128], args.head_dims or [64]
        args.repeats, args.warmup, args.loop_ms = min(args.repeats, 3), min(args.warmup, 1), min(args.loop_ms, 5.0)
        args.out = args.out or os.path.join(tempfile.gettempdir(), "fusedattn-bench-jax-smoke.json")
    if args.repeats < 1 or args.warmup < 0 or args.loop_ms <= 0 or (args.copy_gib is not None and args.copy_gib <= 0):
        parser.error(f"expected --repeats >= 1, --warmup >= 0, --loop-ms > 0, --copy-gib > 0, got {args.repeats}, "
                     f"{args.warmup}, {args.loop_ms}, {args.copy_gib}")
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


def workloads(args) -> list[tuple]:
    """(case, mode) of the run: the plain grid (unless --features), then the feature rows, --only applied."""
    cases = [] if args.features else make_cases(*bench_cudnn.shape_grid(args))
    return [(case, mode) for case in cases + feature_cases(args) for mode in args.modes
            if common.workload_matches(args.only, f"{case.name}-{mode}")]


def _print_row_notes(row: dict) -> None:
    """The live table's extra lines: per-call us of the overhead rows, host and bandwidth of the feature rows."""
    params = row["params"]
    if "us_per_call" in params:
        us, diff = params["us_per_call"], params["ours_minus_jax_cudnn_us"]
        print("    us/call: " + ", ".join(f"{n} {t:.1f}" for n, t in us.items())
              + ("" if diff is None else f"; ours - jax_cudnn = {diff:+.1f} us"), flush=True)
    if "host_us" in params:
        print("    host us/call: " + ", ".join(f"{n} {t:.1f}" for n, t in params["host_us"].items())
              + f"; ours - plain {_number(params['host_us_minus_plain'], 0, '+.1f')}; loop at "
              + f"{params['host_loop_shape']}: {params['host_loop_us']} (- plain "
              + f"{_number(params['host_loop_us_minus_plain'], 0, '+.1f')})", flush=True)
    if "fraction_of_copy" in params:
        print(f"    ours {params['ours_GBps']} GB/s = {params['fraction_of_copy']:.3f} of the copy's "
              f"{params['copy_GBps']} GB/s", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = workloads(args)
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
    torch_side = common.versions() if args.cpu_smoke else versions_elsewhere()
    found = {**torch_side, "jax": jax.__version__, "jaxlib": jaxlib.__version__,
             "xla_platform": " ".join(f"{device.platform} {getattr(device.client, 'platform_version', '')}".split()),
             "ours_launch": _launch_path(args)}
    header = {"suite": args.suite, "device": name, "date": common.today(), "versions": found}
    print(f"suite {args.suite} on {name}, {header['date']}; {len(rows)} rows -> {args.out}", flush=True)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()), flush=True)
    print(f"jit; wall-clock median of {args.repeats} loops of ~{args.loop_ms:g} ms (calls, then one "
          "block_until_ready); latency rows: single call + block", flush=True)
    peers = [*PEERS, *([TORCH_PATH] if args.torch_peer else [])]
    results, table, features = common.ResultsFile(args.out, header, merge=args.merge), common.LiveTable(peers), None
    began = time.perf_counter()
    for case, mode in rows:
        row_began = time.perf_counter()
        try:
            if isinstance(case, feature_rows.FeatureCase):
                features = features or FeatureRun(args, device, rows)
                row = run_feature_row(case, mode, args, device, features)
            else:
                row = run_row(case, mode, args, device)
        except Exception as error:  # a fault of the script: keep going, the row records it
            traceback.print_exc()
            row = common.harness_error_row(f"{case.name}-{mode}", case.params(mode), args.ours_backend, error)
        results.add(row)
        table.row(row, seconds=time.perf_counter() - row_began)
        _print_row_notes(row)
    print_feature_summary(results.rows, peers)
    print(f"wrote {len(results.rows)} rows to {args.out} in {time.perf_counter() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
