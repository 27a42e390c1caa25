"""Shared helpers of the benchmark scripts: FLOP counts, timing, error entries, the results file, the live table.

A suite describes each implementation of a workload as an `Impl` (a forward callable, the
leaves its backward differentiates, a fixed output gradient) and hands it to `measure`,
which times it and turns any failure into a `{"error": "..."}` entry. Results follow the
"Benchmark results" format of DESIGN.md and are rewritten after every row, so a run that is
killed still leaves what it measured.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"

# `python bench/<suite>.py` puts bench/ on sys.path, not the checkout: benchmark the checkout's fusedattn.
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

from fusedattn.cli import choice_list  # noqa: E402  (the suites' list options parse as the CLI's do)

__all__ = [
    "FWD", "FWD_BWD", "MODES", "ROOT", "RESULTS", "Impl", "ResultsFile", "LiveTable",
    "attention_flops", "tflops", "time_ms", "interleaved_host_us", "medians", "paired_median", "measure",
    "error_entry", "max_abs_diff",
    "best_peer_ratio", "workload_matches", "device_name", "versions", "today", "choice_list",
]

FWD, FWD_BWD = "fwd", "fwd+bwd"
MODES = (FWD, FWD_BWD)
BACKWARD_FACTOR = 2.5  # backward ~ 2.5x forward FLOPs (5 matmuls against 2), so fwd+bwd = 3.5x forward
ERROR_CHARS = 1500  # an error entry keeps this much of the message (fusedattn's reasons come last)
WARNING_CHARS = 300  # and this much of each distinct warning seen before it


# --- FLOPs -------------------------------------------------------------------------------------------------------

def attention_flops(B: int, Hq: int, Sq: int, Skv: int, D: int, *, causal: bool, mode: str, Dv: int | None = None
                    ) -> float:
    """Matmul FLOPs of one call: 2*B*Hq*Sq*Skv*(D + Dv) forward, halved for causal when Sq == Skv."""
    forward = 2.0 * B * Hq * Sq * Skv * (D + (D if Dv is None else Dv))
    if causal and Sq == Skv:
        forward /= 2
    return forward * (1.0 + BACKWARD_FACTOR if mode == FWD_BWD else 1.0)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e9)


# --- timing ------------------------------------------------------------------------------------------------------

def time_ms(step: Callable[[], object], *, warmup: int, repeats: int, device: torch.device) -> list[float]:
    """Per-call times in ms after `warmup` calls.

    On CUDA: an event pair around each call, calls queued back to back, one synchronize at
    the end (so launch overhead counts only where it exceeds the GPU time). L2 is not flushed
    between calls. On CPU (smoke tests of the script only): wall clock.
    """
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends):
            start.record()
            step()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in zip(starts, ends)]
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        step()
        times.append((time.perf_counter() - began) * 1e3)
    return times


# --- host time ---------------------------------------------------------------------------------------------------

HOLD_MARGIN_US = 2000.0  # a held loop's spin outlasts twice the plain loop's enqueue time by this much


def kernel_table(step: Callable[[], object], repeats: int = 10, warmup: int = 3) -> dict[str, tuple[float, float]]:
    """{kernel name (90 characters): (launches, GPU us)} per call of step, from torch's profiler (diagnostics:
    which kernels a call launches, and for how long)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            step()
        torch.cuda.synchronize()
    table: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            row = table.setdefault(event.name[:90], [0.0, 0.0])
            row[0] += 1
            row[1] += event.device_time_total
    return {name: (launches / repeats, us / repeats) for name, (launches, us) in table.items()}


def with_python_path(measure: Callable[[], dict], script: str, child_flag: str) -> tuple[dict, dict]:
    """(measure() here, measure() in a child process running `script` with the native operator off,
    FUSEDATTN_TORCH_NATIVE=0): a diagnostic's two paths on the same inputs. The script prints its
    measure() as JSON on its last line when child_flag is set in its environment."""
    native = measure()
    env = dict(os.environ, **{child_flag: "1"}, FUSEDATTN_TORCH_NATIVE="0")
    child = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=400)
    if child.returncode:
        print(child.stderr[-2000:])
        return native, {}
    return native, json.loads(child.stdout.strip().splitlines()[-1])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plain_loop(call: Callable[[], object], calls: int, device: torch.device) -> tuple[float, float]:
    """(enqueue us, synchronize-wait us) per call of `calls` back-to-back calls."""
    synchronize(device)
    began = time.perf_counter()
    for _ in range(calls):
        call()
    enqueued = time.perf_counter()
    synchronize(device)
    done = time.perf_counter()
    return (enqueued - began) / calls * 1e6, (done - enqueued) / calls * 1e6


def held_loop(call: Callable[[], object], calls: int, hold_cycles: int) -> tuple[float, float, bool]:
    """(host us, GPU us) per call with the GPU held by a spin kernel while the host enqueues; whether it held."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(hold_cycles)
    start.record()
    began = time.perf_counter()
    for _ in range(calls):
        call()
    enqueued = time.perf_counter()
    end.record()
    held = not start.query()  # the spin was still running: every call was queued before the GPU reached them
    end.synchronize()
    return (enqueued - began) / calls * 1e6, start.elapsed_time(end) * 1e3 / calls, held


def spin_cycles_per_us() -> float:
    """torch.cuda._sleep's clock: cycles per microsecond, measured once."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)  # a first launch pays for loading the kernel
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


@contextlib.contextmanager
def one_core(device: torch.device):
    """On a GPU, every thread of this process on one of its cores (the highest it may use) for the block,
    then back. Host loops timed so vary by a few percent; free to move between the cores of a shared
    machine, the same forward+backward loop read from 128 to 197 us a call within one process (H200 host,
    2026-11-29; 60 to 65 us pinned). Processes started before the block (compile workers) keep their
    cores. On the CPU nothing changes: there the threads compute, and one core would serialize them."""
    if device.type != "cuda" or not hasattr(os, "sched_getaffinity"):
        yield
        return
    core = {max(os.sched_getaffinity(0))}
    before = {}
    for name in os.listdir("/proc/self/task"):
        try:
            before[int(name)] = os.sched_getaffinity(int(name))
            os.sched_setaffinity(int(name), core)
        except OSError:  # a thread that ended meanwhile
            pass
    try:
        yield
    finally:
        for thread, cores in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(thread, cores)


def plain_then_held(call: Callable[[], object], calls: int, device: torch.device, cycles_per_us: float | None
                    ) -> tuple[tuple[float, float], tuple[float, float, bool] | None]:
    """(host us, wait us) of a plain loop of `calls` calls, then (host us, GPU us, whether it held) of a held
    loop whose spin outlasts twice the plain loop's enqueue time (None without a GPU: cycles_per_us None);
    both on one core on a GPU (one_core)."""
    with one_core(device):
        host, wait = plain_loop(call, calls, device)
        if cycles_per_us is None:
            return (host, wait), None
        hold = int(cycles_per_us * (2 * host * calls + HOLD_MARGIN_US))
        return (host, wait), held_loop(call, calls, hold)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass
class Impl:
    """One implementation of a workload, ready to call on inputs made outside the timed region."""

    name: str
    call: Callable[[], torch.Tensor]  # the forward; returns the attention output
    inputs: tuple[torch.Tensor, ...]  # leaves the backward differentiates
    grad_out: torch.Tensor | None = None  # fixed output gradient, shaped like call()'s output
    to_reference: Callable[[torch.Tensor], torch.Tensor] = _identity  # output/grad -> the reference layout
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext  # entered around everything
    forward_no_grad: bool = False  # time the forward under torch.no_grad()

    def step(self, mode: str) -> Callable[[], object]:
        """One timed call: the forward, or the forward then the gradients of (q, k, v)."""
        if mode == FWD:
            if self.forward_no_grad:
                def forward_only():
                    with torch.no_grad():
                        return self.call()
                return forward_only
            return self.call
        return lambda: torch.autograd.grad(self.call(), self.inputs, self.grad_out)

    def outputs(self, mode: str) -> list[torch.Tensor]:
        """Output (and in fwd+bwd the input gradients) of one call, in the reference layout, for checking."""
        if mode == FWD:
            with torch.no_grad() if self.forward_no_grad else contextlib.nullcontext():
                return [self.to_reference(self.call().detach())]
        out = self.call()
        grads = torch.autograd.grad(out, self.inputs, self.grad_out)
        return [self.to_reference(t.detach()) for t in (out, *grads)]


def _one_line(text: str, limit: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_entry(error: BaseException | str, caught: Sequence[warnings.WarningMessage] = ()) -> dict:
    """{"error": "<Type>: <message>"} plus the distinct warnings seen before it (SDPA explains itself there)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    text = _one_line(text, ERROR_CHARS)
    seen = []
    for w in caught:
        message = _one_line(str(w.message), WARNING_CHARS)
        if message not in seen:
            seen.append(message)
    if seen:
        text += " | warnings: " + " / ".join(seen[:4])
    return {"error": text}


def release_memory(device: torch.device) -> None:
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def measure(impl: Impl, *, mode: str, warmup: int, repeats: int, device: torch.device, keep_outputs: bool
            ) -> tuple[dict, list[torch.Tensor] | None]:
    """({"ms": median} or {"error": ...}, the checked outputs when keep_outputs) for one implementation.

    The first call (which compiles or builds graphs) also yields the outputs checked against
    the reference; then `warmup` more calls, then `repeats` timed ones. Never raises for a
    failure of the implementation.
    """
    outputs = None
    failed = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with impl.context():
                outputs = impl.outputs(mode)
                if not keep_outputs:
                    outputs = None
                times = time_ms(impl.step(mode), warmup=warmup, repeats=repeats, device=device)
        except Exception as error:  # any failure of a peer (or of ours) becomes an entry
            failed = error_entry(error, caught)
            outputs = None
    if failed is not None:
        release_memory(device)
        return failed, None
    return {"ms": statistics.median(times)}, outputs


# Rows whose calls take less than this run their contestants again in interleaved rounds: there the host's
# time per call decides, and a slow spell of the host (other processes, clocks) lasts longer than one entry.
ROUNDS_BELOW_MS = 2.0


def _take_turns(impls: dict, rounds: int, measure: Callable) -> dict[str, list[float | None]]:
    """Each implementation's samples over `rounds` rounds in which they take turns, in reversed order every
    other round, so a slow spell of the host touches all of them alike: the i-th of each list is round i's.
    measure(impl) gives one sample (None: none this round), inside impl's context; an implementation that
    fails is dropped (it was measured before)."""
    samples: dict[str, list[float | None]] = {name: [] for name in impls}
    names = list(impls)
    for index in range(rounds):
        for name in names if index % 2 == 0 else names[::-1]:
            if name not in samples:
                continue
            impl = impls[name]
            try:
                with impl.context():
                    value = measure(impl)
            except Exception:  # noqa: BLE001 - measured once already; keep that entry
                del samples[name]
                continue
            samples[name].append(value)
    return samples


def medians(samples: dict[str, list[float | None]]) -> dict[str, float]:
    present = {name: [x for x in values if x is not None] for name, values in samples.items()}
    return {name: statistics.median(values) for name, values in present.items() if values}


def paired_median(samples: dict[str, list[float | None]], first: str, second: str) -> float | None:
    """The median over rounds of first's sample minus second's of the same round (rounds where both have
    one): what first adds, with the host's slow spells, which touch a round's turns alike, cancelled."""
    pairs = [a - b for a, b in zip(samples.get(first, ()), samples.get(second, ()))
             if a is not None and b is not None]
    return statistics.median(pairs) if pairs else None


def interleaved_ms(impls: dict, *, mode: str, rounds: int, warmup: int, repeats: int, device: torch.device
                   ) -> dict[str, float]:
    """Each implementation's median over `rounds` interleaved rounds (_take_turns) of its median call time
    (time_ms)."""
    return medians(_take_turns(impls, rounds, lambda impl: statistics.median(
        time_ms(impl.step(mode), warmup=warmup, repeats=repeats, device=device))))


def interleaved_host_us(impls: dict, *, mode: str, rounds: int, calls: int, device: torch.device
                        ) -> dict[str, list[float | None]]:
    """Each implementation's host enqueue time per call (us) in each of `rounds` interleaved rounds
    (_take_turns: medians gives each one's median, paired_median what one adds to another), from a loop of
    `calls` back-to-back calls, on a GPU with the GPU held by a spin kernel, so that only the host's work
    counts (a round whose spin ended early gives None)."""
    cycles_per_us = spin_cycles_per_us() if device.type == "cuda" else None

    def host_us(impl) -> float | None:
        (host, _), held = plain_then_held(impl.step(mode), calls, device, cycles_per_us)
        if held is None:
            return host
        return held[0] if held[2] else None

    return _take_turns(impls, rounds, host_us)


def max_abs_diff(ours: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Largest |ours - reference| over paired tensors (float32 arithmetic)."""
    worst = 0.0
    for a, b in zip(ours, reference):
        if a.shape != b.shape:
            raise ValueError(f"max_abs_diff: shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
        worst = max(worst, float((a.float() - b.float()).abs().max()))
    return worst


def best_peer_ratio(ours: dict, peers: dict) -> float | None:
    """Best peer's ms / our ms (> 1: we are faster), over peers without error; None when undefined."""
    times = [p["ms"] for p in peers.values() if "ms" in p]
    if "ms" not in ours or not times or ours["ms"] <= 0:
        return None
    return min(times) / ours["ms"]


def workload_matches(pattern: str | None, name: str) -> bool:
    """--only: a regex searched in the name, or failing that a plain substring ('fwd+bwd' works as typed)."""
    if not pattern:
        return True
    try:
        if re.search(pattern, name):
            return True
    except re.error:
        pass
    return pattern in name


# --- environment -------------------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def today() -> str:
    return datetime.date.today().isoformat()


def _module_version(name: str) -> str | None:
    try:
        module = importlib.import_module(name)
    except Exception as error:
        return f"not importable ({type(error).__name__})"
    return str(getattr(module, "__version__", "unknown"))


def _cudnn_frontend() -> str:
    try:
        import cudnn
    except Exception as error:
        return f"not importable ({type(error).__name__}: {_one_line(str(error), 120)})"
    text = str(getattr(cudnn, "__version__", "unknown"))
    try:
        text += f" (backend {cudnn.backend_version()})"
    except Exception:
        pass
    return text


ENV_GIT_REV = "FUSEDATTN_GIT_REV"  # the commit measured, for machines whose checkout copy has stale git data


def _git_describe() -> str | None:
    if os.environ.get(ENV_GIT_REV):
        return os.environ[ENV_GIT_REV]
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except Exception:
        return None
    return head + ("+dirty" if dirty else "")


def versions() -> dict:
    """python, torch, cuda, triton, cudnn (as torch sees it), cudnn_frontend, fusedattn (and its git commit)."""
    try:
        cudnn = torch.backends.cudnn.version()
    except Exception as error:
        cudnn = f"unknown ({type(error).__name__})"
    fusedattn = _module_version("fusedattn")
    commit = _git_describe()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _module_version("triton"),
        "cudnn": cudnn,
        "cudnn_frontend": _cudnn_frontend(),
        "fusedattn": fusedattn if commit is None else f"{fusedattn} (git {commit})",
    }


# --- results -----------------------------------------------------------------------------------------------------

def _json_safe(value):
    """NaN and infinities as strings (JSON has none); tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def merge_rows(earlier: dict, later: dict) -> dict:
    """One workload measured twice: the later ours and peers, plus the earlier peers it did not run."""
    peers = {**earlier.get("peers", {}), **later.get("peers", {})}
    params = {**earlier.get("params", {}), **later.get("params", {})}
    ranked = params.get("ratio_peers")
    ratio = best_peer_ratio(later["ours"], {n: e for n, e in peers.items() if ranked is None or n in ranked})
    return {**later, "params": params, "peers": peers, "ratio_vs_best_peer": ratio}


@dataclass
class ResultsFile:
    """bench/results/<suite>.json, rewritten (atomically) after every row.

    With merge, rows of an earlier file whose workload this run does not measure are kept,
    and a workload measured again keeps the earlier file's peers that this run did not run
    (so peers can be measured in separate processes: one that crashes takes no others down).
    """

    path: Path
    header: dict  # suite, device, date, versions
    merge: bool = False
    rows: list[dict] = field(default_factory=list)
    kept: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.path = Path(self.path)
        if self.merge and self.path.exists():
            try:
                self.kept = list(json.loads(self.path.read_text()).get("rows", []))
            except (OSError, ValueError) as error:
                print(f"warning: --merge: cannot read {self.path}: {error}; starting afresh", file=sys.stderr)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write()

    def write(self) -> None:
        measured = {row["workload"] for row in self.rows}
        earlier = {row.get("workload"): row for row in self.kept}
        rows = [row for row in self.kept if row.get("workload") not in measured]
        rows += [merge_rows(earlier[row["workload"]], row) if row["workload"] in earlier else row for row in self.rows]
        document = _json_safe({**self.header, "rows": rows})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(document, indent=1) + "\n")
        os.replace(partial, self.path)


class LiveTable:
    """A compact table on stdout, one line per row as it is measured (flushed)."""

    def __init__(self, peers: Sequence[str], name_width: int = 44):
        self.peers = list(peers)
        self.name_width = name_width
        self.widths = [max(len(p), 7) for p in self.peers]
        cells = [f"{p:>{w}}" for p, w in zip(self.peers, self.widths)]
        print(f"{'workload':<{name_width}} {'ours ms':>9} {'ours TF':>8} | " + " ".join(cells)
              + f" | {'ratio':>6} {'maxdiff':>8}", flush=True)
        print("  (TF = TFLOP/s; peers in TFLOP/s; ratio = best peer ms / ours ms, > 1: ours faster; "
              "maxdiff = max |ours - reference| over the output and, in fwd+bwd, the gradients)", flush=True)

    def row(self, row: dict, seconds: float | None = None) -> None:
        ours = row["ours"]
        ms = f"{ours['ms']:9.3f}" if "ms" in ours else f"{'error':>9}"
        tf = f"{ours['value']:8.1f}" if "value" in ours else f"{'-':>8}"
        cells = []
        for name, width in zip(self.peers, self.widths):
            entry = row["peers"].get(name)
            text = "" if entry is None else f"{entry['value']:.1f}" if "value" in entry else "err"
            cells.append(f"{text:>{width}}")
        ratio = row.get("ratio_vs_best_peer")
        ratio_text = f"{ratio:6.2f}" if isinstance(ratio, float) else f"{'-':>6}"
        diff = row["params"].get("max_abs_diff_vs_sdpa")
        grad_diff = row["params"].get("max_abs_grad_diff_vs_sdpa")
        if isinstance(diff, float) and isinstance(grad_diff, float):
            diff = max(diff, grad_diff)
        diff_text = f"{diff:8.1e}" if isinstance(diff, float) else f"{'-':>8}"
        took = "" if seconds is None else f"  [{seconds:.1f} s]"
        print(f"{row['workload']:<{self.name_width}} {ms} {tf} | " + " ".join(cells) + f" | {ratio_text} {diff_text}"
              + took, flush=True)
        if "error" in ours:
            print(f"    ! ours: {_console_error(ours['error'])}", flush=True)
        for name, entry in row["peers"].items():
            if "error" in entry and not entry["error"].startswith("skipped"):
                print(f"    ! {name}: {_console_error(entry['error'])}", flush=True)


def _console_error(text: str, limit: int = 240) -> str:
    """An error for the live table: fusedattn's per-backend reasons rather than its call summary."""
    reasons = text.find(" backends: ")
    if reasons > 0 and "fusedattn" in text[:reasons]:
        text = text[: min(reasons, 90)] + " ..." + text[reasons:]
    return _one_line(text, limit)


# --- the run loop every suite shares ------------------------------------------------------------------------------

def harness_error_row(workload: str, params: dict, backend: str, error: BaseException) -> dict:
    """The row of a fault of the benchmark script itself, not of an implementation."""
    return {"workload": workload, "params": params, "metric": "tflops",
            "ours": {"backend": backend, **error_entry(f"benchmark harness: {error!r}")}, "peers": {},
            "ratio_vs_best_peer": None}


def list_or_missing(name: str, args, rows) -> int | None:
    """The exit code when there is nothing to measure: --list prints the (case, mode) workloads
    (0), and no workload matching --only is an error (2); None to go on."""
    if args.list:
        print("\n".join(f"{case.name}-{mode}" for case, mode in rows))
        return 0
    if not rows:
        print(f"{name}: no workload matches --only {args.only!r} (see --list)", file=sys.stderr)
        return 2
    return None


def run_suite(name: str, args, rows: list, run_row: Callable, peers: Sequence[str], *, harness_row: Callable,
              cpu_hint: str, notes: Sequence[str] = (), time_limit: float = 0.0,
              on_time_limit: Callable | None = None) -> int:
    """--list, the device check, the header, then each (case, mode) row: measured, written, shown.

    run_row(case, mode, device) -> row; harness_row(case, mode, error) -> row when run_row
    itself fails (the suite keeps going). Returns the process exit code.
    """
    listed = list_or_missing(name, args, rows)
    if listed is not None:
        return listed
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"{name}: no CUDA device visible to torch; run on a GPU machine ({cpu_hint})", file=sys.stderr)
        return 2
    header = {"suite": args.suite, "device": device_name(device), "date": today(), "versions": versions()}
    print(f"suite {args.suite} on {header['device']}, {header['date']}; {len(rows)} rows -> {args.out}", flush=True)
    print("versions: " + ", ".join(f"{k} {v}" for k, v in header["versions"].items()), flush=True)
    for note in notes:
        print(note, flush=True)
    results = ResultsFile(args.out, header, merge=args.merge)
    table = LiveTable(list(peers))
    began = time.perf_counter()
    for index, (case, mode) in enumerate(rows):
        if time_limit > 0 and time.perf_counter() - began > time_limit and on_time_limit is not None:
            on_time_limit(rows[index:])
            break
        row_began = time.perf_counter()
        try:
            row = run_row(case, mode, device)
        except Exception as error:  # a fault of the script: keep going, the row records it
            traceback.print_exc()
            row = harness_row(case, mode, error)
            release_memory(device)
        results.add(row)
        table.row(row, seconds=time.perf_counter() - row_began)
    print(f"wrote {len(results.rows)} rows to {args.out} in {time.perf_counter() - began:.0f} s", flush=True)
    return 0


def add_run_arguments(parser, suite: str) -> None:
    """The options every suite shares: which rows, where the results go, how long to time."""
    parser.add_argument("--only", metavar="REGEX", default=None,
                        help="run workloads whose name matches (re.search, or a plain substring; see --list)")
    parser.add_argument("--list", action="store_true", help="print the workload names and exit")
    parser.add_argument("--out", default=None,
                        help=f"results file (default: bench/results/{suite}.json in this checkout; "
                             f"{suite}-ours-<backend>.json with --ours-backend)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows (and peers) of an existing --out file that this run does not measure")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per entry (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before timing (default 5)")


def parse_suite_args(parser, argv, suite: str, default_backend: str):
    """Parse, then name the suite (another --ours-backend gets its own results file) and check counts."""
    args = parser.parse_args(argv)
    args.suite = suite if args.ours_backend == default_backend else f"{suite}-ours-{args.ours_backend}"
    if args.out is None:
        args.out = str(RESULTS / f"{args.suite}.json")
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    return args
