"""Per-call host cost of fusedattn.torch.attention against torch SDPA; --detail: where the cuDNN path's time goes.

Default (writes bench/results/overhead.json): back-to-back calls, B8 S1024 H12 D64 and B1 S128 H8 D64,
causal, bf16; "fwd" is the forward under torch.no_grad(), "fwd+bwd" the forward then torch.autograd.grad
of (q, k, v) with a fixed random output gradient. ours = fusedattn.torch.attention(q, k, v, mask="causal")
with default selection (--ours-backend forces one); sdpa = F.scaled_dot_product_attention(is_causal=True)
on (B, H, S, D) views of the same tensors, default dispatch. Each round times, per contestant
(interleaved, order alternating), two loops of --calls calls with no synchronize inside:

  plain  perf_counter around the enqueue loop, then around the synchronize that follows:
         loop_us = (enqueue + wait) / calls is the back-to-back time per call a user sees
         (the larger of the host and the GPU cost), wait_us the part spent waiting for the GPU.
  held   the GPU is first given a spin kernel (torch.cuda._sleep) that outlasts the enqueue loop, so
         the host never waits for the GPU and the GPU never waits for the host:
         host_us = enqueue time / calls is the honest host cost of a call (Python, dispatch, launches);
         gpu_us  = CUDA-event time from the spin's end to the last call / calls is the GPU time of a
         call with the queue full. gpu_held says in how many rounds the spin outlasted the loop.

Variants (on; --no-variants leaves them out): ours with a modification, same shapes, rounds and conventions.
ours_softcap_flex: score_mod=softcap (a flex function, 30 * tanh(score / 30)); ours_softcap_builtin:
score_mods.softcap(30.0); ours_alibi_flex: a flex closure, score + slopes[h] * (kv_idx - q_idx); ours_bias:
bias=(1, H, S, S) bf16. They sit in "peers" but the ratios compare ours with SDPA only (params.ratio_peers);
"host_extra_us" holds each variant's host_us minus ours' (printed on a line under the row).

Rows keep medians over --rounds. In the JSON "ms" is host_us / 1000 (so ratio_vs_best_peer = sdpa
host time / ours, > 1: ours cheaper), "value" the attention TFLOP/s at gpu_us (4*B*H*S^2*D/2 forward,
x3.5 with backward); each entry also holds host_us, gpu_us, loop_us and wait_us. On CPU (--smoke) there
is no GPU queue: host_us = loop_us and gpu_us is null.

    python bench/profile_overhead.py                        # -> bench/results/overhead.json
    python bench/profile_overhead.py --smoke --out /tmp/overhead.json   # tiny shapes on CPU
    python bench/profile_overhead.py --detail               # the cuDNN path's parts and a cProfile (GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fusedattn.score_mods import tanh  # noqa: E402

try:  # python -m bench.profile_overhead
    from . import bench_cudnn, common
    from .bench_model import recorded_selections
except ImportError:  # python bench/profile_overhead.py
    import bench_cudnn
    import common
    from bench_model import recorded_selections

SUITE = "overhead"
PEER = "sdpa"
CUDNN_PEER = "sdpa_cudnn"  # SDPA forced to cuDNN (GPU only): the same kernels as ours, torch's own launch
CAP = 30.0  # the softcap variants' cap
VARIANTS = ("ours_softcap_flex", "ours_softcap_builtin", "ours_alibi_flex", "ours_bias")


@dataclass(frozen=True)
class Shape:
    B: int
    H: int
    S: int
    D: int

    @property
    def name(self) -> str:
        return f"enqueue-b{self.B}-h{self.H}-s{self.S}-d{self.D}-causal"

    def flops(self, mode: str) -> float:
        return common.attention_flops(self.B, self.H, self.S, self.S, self.D, causal=True, mode=mode)

    def params(self, mode: str) -> dict:
        return {"layout": "bshd", "B": self.B, "Sq": self.S, "Skv": self.S, "Hq": self.H, "Hkv": self.H,
                "D": self.D, "dtype": "bfloat16", "mask": "causal", "mode": mode,
                "fwd_under_no_grad": mode == common.FWD}


SHAPES = (Shape(8, 12, 1024, 64), Shape(1, 8, 128, 64))
SMOKE_SHAPES = (Shape(2, 4, 64, 16), Shape(1, 2, 16, 16))


# --- timing ------------------------------------------------------------------------------------------------------

def host_and_total_us(fn, n=300) -> tuple[float, float]:
    """Per call of n back-to-back calls: the host's enqueue time, and the wall time once the device has
    synchronized (bench/diag uses both)."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / n * 1e6


def per_call_us(fn, n=300) -> float:
    """Wall time per call of n back-to-back calls, synchronized after (profile_jax_overhead uses it too)."""
    return host_and_total_us(fn, n)[1]


# --- contestants -------------------------------------------------------------------------------------------------

@dataclass
class Contestant:
    name: str
    impl: common.Impl
    mode: str
    samples: dict[str, list] = field(default_factory=lambda: {"host": [], "wait": [], "loop": [], "gpu": [],
                                                              "held": []})

    sdpa_backend: object = None  # an SDPBackend to force around the loop
    records: bool = False  # a fusedattn call: its first warm-up call records the selections fusedattn makes

    def context(self) -> contextlib.AbstractContextManager:
        """The forward runs under no_grad, a forced SDPA backend under sdpa_kernel (entered once around a
        loop, not per call)."""
        stack = contextlib.ExitStack()
        if self.mode == common.FWD:
            stack.enter_context(torch.no_grad())
        if self.sdpa_backend is not None:
            from torch.nn.attention import sdpa_kernel

            stack.enter_context(sdpa_kernel(self.sdpa_backend))
        return stack

    def call(self) -> Callable[[], object]:
        return self.impl.call if self.mode == common.FWD else self.impl.step(common.FWD_BWD)


def softcap(score, b, h, q_idx, kv_idx):
    """The flex form of softcap (module-level, so traced once for the whole run)."""
    return CAP * tanh(score / CAP)


def alibi_flex(slopes: torch.Tensor):
    """A flex score_mod over a captured (H,) tensor: fusedattn loads it as an aux tensor."""
    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return alibi


def _ours(name: str, x: bench_cudnn.Inputs, mode: str, ours_backend: str | None, **options) -> Contestant:
    """fusedattn's causal call on x with extra options; gradients of q, k, v only (as ours)."""
    import fusedattn.torch as fat

    call = partial(fat.attention, x.q, x.k, x.v, layout="bshd", mask="causal", backend=ours_backend, **options)
    return Contestant(name, common.Impl(name, call, (x.q, x.k, x.v), x.grad_out, forward_no_grad=True), mode,
                      records=True)


def variants(x: bench_cudnn.Inputs, mode: str, ours_backend: str | None) -> list[Contestant]:
    """Ours with a score_mod or a bias; their tensors and the builtin are made here, once per row, not per call."""
    import fusedattn
    from fusedattn import score_mods

    _, S, H, _ = x.q.shape
    slopes = torch.tensor(fusedattn.standard_alibi_slopes(H), dtype=torch.float32, device=x.q.device)
    generator = torch.Generator(device=x.q.device).manual_seed(0)
    bias = torch.randn(1, H, S, S, device=x.q.device, dtype=torch.bfloat16, generator=generator)
    options = {"ours_softcap_flex": {"score_mod": softcap},
               "ours_softcap_builtin": {"score_mod": score_mods.softcap(CAP)},
               "ours_alibi_flex": {"score_mod": alibi_flex(slopes)}, "ours_bias": {"bias": bias}}
    return [_ours(name, x, mode, ours_backend, **options[name]) for name in VARIANTS]


def contestants(x: bench_cudnn.Inputs, mode: str, ours_backend: str | None, with_variants: bool) -> list[Contestant]:
    """ours and sdpa first (_check compares those two), then sdpa_cudnn on a GPU, then the variants."""
    sdpa = common.Impl(PEER, partial(torch.nn.functional.scaled_dot_product_attention, x.qt, x.kt, x.vt,
                                     is_causal=True), (x.qt, x.kt, x.vt), x.grad_out.transpose(1, 2),
                       to_reference=lambda t: t.transpose(1, 2), forward_no_grad=True)
    peers = [_ours("ours", x, mode, ours_backend), Contestant(PEER, sdpa, mode)]
    if x.q.is_cuda:
        from torch.nn.attention import SDPBackend

        peers.append(Contestant(CUDNN_PEER, sdpa, mode, sdpa_backend=SDPBackend.CUDNN_ATTENTION))
    return peers + (variants(x, mode, ours_backend) if with_variants else [])


def sample(contestant: Contestant, calls: int, device: torch.device, cycles_per_us: float | None) -> None:
    """One round of one contestant: the plain loop, then (on a GPU) the held loop."""
    with contestant.context():
        (host, wait), held_loop = common.plain_then_held(contestant.call(), calls, device, cycles_per_us)
    contestant.samples["wait"].append(wait)
    contestant.samples["loop"].append(host + wait)
    if held_loop is None:
        contestant.samples["host"].append(host)
        return
    host, gpu, held = held_loop
    contestant.samples["host"].append(host)
    contestant.samples["gpu"].append(gpu)
    contestant.samples["held"].append(held)


def entry(contestant: Contestant, flops: float) -> dict:
    """The results entry: ms = host enqueue time, value = TFLOP/s at the GPU time (the loop's where none)."""
    median = {key: statistics.median(values) for key, values in contestant.samples.items()
              if values and key != "held"}
    gpu_us = median.get("gpu")
    result = {"ms": round(median["host"] / 1e3, 6),
              "value": round(common.tflops(flops, (gpu_us or median["loop"]) / 1e3), 3)}
    result.update({f"{key}_us": round(median[key], 2) if key in median else None
                   for key in ("host", "gpu", "loop", "wait")})
    held = contestant.samples["held"]
    result["gpu_held"] = f"{sum(held)}/{len(held)}" if held else None
    return result


# --- one row -----------------------------------------------------------------------------------------------------

def _warm_up(contestant: Contestant, calls: int, device: torch.device, record: bool) -> list[tuple[str, str]]:
    """Untimed calls (graph builds, selection); with record, first one call whose selections it returns."""
    call = contestant.call()
    made: list[tuple[str, str]] = []
    with contestant.context():
        if record:
            with recorded_selections() as made:
                call()
        for _ in range(calls):
            call()
    common.synchronize(device)
    return list(made)


def _warm_all(live: list[Contestant], entries: dict, warmup: int, device: torch.device) -> dict[str, list]:
    """Warm every contestant up; a fusedattn one's selections by name. Recording clears fusedattn's cached
    decisions, so every recorded call comes before all the plain warm-up calls: none is left to a timed call.
    A contestant that cannot run becomes an error entry and leaves live, not the end of the run."""
    chosen = {}
    for record in (True, False):
        for contestant in [c for c in live if c.records or not record]:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    made = _warm_up(contestant, 0 if record else warmup, device, record)
                except Exception as error:
                    entries[contestant.name] = common.error_entry(error, caught)
                    live.remove(contestant)
                    continue
            if record:
                chosen[contestant.name] = made
    return chosen


def _backends(made: list[tuple[str, str]]) -> str:
    return ",".join(sorted({backend for _, backend in made})) or "default"


def _check(contestants_: list[Contestant], mode: str, params: dict) -> None:
    """max |ours - sdpa| over the output and, in fwd+bwd, the input gradients (one untimed call each)."""
    try:
        outputs = [c.impl.outputs(mode) for c in contestants_ if c.name in ("ours", PEER)]
        params["max_abs_diff_vs_sdpa"] = common.max_abs_diff(outputs[0], outputs[1])
    except Exception as error:
        params["max_abs_diff_vs_sdpa"] = common.error_entry(error)["error"]
    params["max_abs_diff_ref"] = PEER


def run_row(shape: Shape, mode: str, args, device: torch.device, cycles_per_us: float | None) -> dict:
    x = bench_cudnn.make_inputs(bench_cudnn.Case("dense", shape.B, shape.H, shape.H, shape.S, shape.D, True),
                                device)
    flops = shape.flops(mode)
    params = {**shape.params(mode), "calls_per_loop": args.calls, "rounds": args.rounds, "flops": int(flops),
              "ms_is": "host enqueue time per call (host_us / 1000)",
              "value_is": "TFLOP/s at gpu_us" if cycles_per_us else "TFLOP/s at loop_us (no GPU)",
              "ratio_peers": [PEER]}  # --merge ranks by it too: the variants never enter the ratio
    live, entries = contestants(x, mode, args.ours_backend, args.variants), {}
    chosen = _warm_all(live, entries, args.warmup, device)
    if "ours" in chosen:
        params["fusedattn_selection"] = [f"{config} -> {backend}" for config, backend in chosen["ours"]]
        params["ours_backend"] = args.ours_backend or _backends(chosen["ours"])
    if {"ours", PEER} <= {c.name for c in live}:
        _check(live, mode, params)
    for index in range(args.rounds):
        for contestant in live[::-1] if index % 2 else live:
            if contestant.name in entries:
                continue
            try:
                sample(contestant, args.calls, device, cycles_per_us)
            except Exception as error:
                entries[contestant.name] = common.error_entry(error)
    for contestant in live:
        entries.setdefault(contestant.name, entry(contestant, flops))
        if contestant.name in VARIANTS and "error" not in entries[contestant.name]:
            entries[contestant.name]["backend"] = _backends(chosen[contestant.name])
    del live, x
    common.release_memory(device)
    ours = {"backend": params.get("ours_backend", args.ours_backend or "default"), **entries["ours"]}
    peers = {name: entries[name] for name in (PEER, CUDNN_PEER, *VARIANTS) if name in entries}
    ratio = common.best_peer_ratio(ours, {PEER: peers[PEER]})  # the target: SDPA's default dispatch
    cudnn_ratio = common.best_peer_ratio(ours, {CUDNN_PEER: peers[CUDNN_PEER]}) if CUDNN_PEER in peers else None
    return {"workload": f"{shape.name}-{mode}", "params": params, "metric": "tflops", "ours": ours, "peers": peers,
            "ratio_vs_best_peer": None if ratio is None else round(ratio, 4),
            "ratio_vs_sdpa_cudnn": None if cudnn_ratio is None else round(cudnn_ratio, 4),
            "host_extra_us": host_extra(ours, peers)}


def host_extra(ours: dict, peers: dict) -> dict[str, float]:
    """Each variant's host_us minus ours', over entries without errors."""
    if not isinstance(ours.get("host_us"), float):
        return {}
    return {name: round(peers[name]["host_us"] - ours["host_us"], 2) for name in VARIANTS
            if isinstance(peers.get(name, {}).get("host_us"), float)}


# --- output ------------------------------------------------------------------------------------------------------

def _ratio_text(row: dict, key: str) -> str:
    ours, peer = row["ours"].get(key), row["peers"][PEER].get(key)
    if not isinstance(ours, float) or not isinstance(peer, float):
        return f"{'-':>23}"
    return f"{ours:8.1f} {peer:8.1f} {ours / peer:5.2f}"


def print_row(row: dict, seconds: float) -> None:
    held = " ".join(str(entry_.get("gpu_held") or "-") for entry_ in (row["ours"], row["peers"][PEER]))
    cudnn = row["peers"].get(CUDNN_PEER, {}).get("host_us")
    cudnn_text = f" | sdpa_cudnn host {cudnn:.1f} us" if isinstance(cudnn, float) else ""
    print(f"{row['workload']:<40} " + " | ".join(_ratio_text(row, key) for key in ("host_us", "gpu_us", "loop_us"))
          + f" | {held:>11}{cudnn_text}  [{seconds:.1f} s]", flush=True)
    extra = row.get("host_extra_us") or {}
    if extra:  # a variant's backend only where it is not ours' (a fallback explains a large extra)
        backends = {name: row["peers"][name].get("backend") for name in extra}
        cells = (f"{name.removeprefix('ours_')} {us:+.1f}"
                 + (f" ({backends[name]})" if backends[name] != row["ours"].get("backend") else "")
                 for name, us in extra.items())
        print("    host us over ours: " + " | ".join(cells), flush=True)
    for name, entry_ in (("ours", row["ours"]), *row["peers"].items()):
        if "error" in entry_:
            print(f"    ! {name}: {entry_['error'][:300]}", flush=True)


def print_header() -> None:
    cells = " | ".join(f"{title:^23}" for title in ("host us/call", "gpu us/call", "loop us/call"))
    print(f"{'workload':<40} {cells} | {'gpu held':>11}", flush=True)
    print(f"{'':<40} " + " | ".join(f"{'ours':>8} {'sdpa':>8} {'o/s':>5}" for _ in range(3))
          + " |  ours sdpa   (o/s = ours / sdpa, < 1: ours cheaper)", flush=True)


# --- the cuDNN path in detail (--detail, GPU) --------------------------------------------------------------------

def detail() -> None:
    """Wall time per call of the public call and of cuDNN's execute in three forms, then a cProfile."""
    import fusedattn.torch as fat
    from fusedattn.backends.cudnn import runtime
    from fusedattn.backends.cudnn.spec import sdpa_spec

    q = torch.randn(4, 1024, 16, 64, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    ours = lambda: fat.attention(q, k, v, mask="causal", backend="cudnn")  # noqa: E731
    print(f"torch sdpa (default backend): {per_call_us(sdpa):8.1f} us/call")
    print(f"fusedattn cudnn, public call: {per_call_us(ours):8.1f} us/call")

    cfg = next(key[0] for key in runtime.graph_cache().keys() if key[1] == "forward")
    built = runtime.get_graph(cfg, "forward", 0)
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


# --- command line ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="profile_overhead.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--detail", action="store_true",
                        help="instead: the cuDNN path's parts (execute forms) and a cProfile; prints only (GPU)")
    parser.add_argument("--only", metavar="REGEX", default=None, help="rows whose workload name matches")
    parser.add_argument("--out", default=None, help="results file (default bench/results/overhead.json; "
                                                    "overhead-ours-<backend>.json with --ours-backend)")
    parser.add_argument("--merge", action="store_true", help="keep the rows of an existing --out not run now")
    parser.add_argument("--calls", type=int, default=50,
                        help="calls per timed loop (default 50: a few hundred launches, within the GPU's queue)")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds; medians over them (default 20)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed calls per contestant (default 20)")
    parser.add_argument("--ours-backend", default=None, help="force a fusedattn backend (default: its selection)")
    parser.add_argument("--no-variants", dest="variants", action="store_false",
                        help="leave out ours with a score_mod or a bias (ours_softcap_flex, ... ours_bias)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: tests the script, not speed")
    parser.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default cuda (cpu with --smoke)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--calls and --rounds must be >= 1, --warmup >= 0")
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    args.suite = SUITE if args.ours_backend is None else f"{SUITE}-ours-{args.ours_backend}"
    args.out = args.out or str(common.RESULTS / f"{args.suite}.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.detail:
        detail()
        return 0
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_overhead: no CUDA device visible to torch (--smoke tests the script on CPU)", file=sys.stderr)
        return 2
    rows = [(shape, mode) for shape in (SMOKE_SHAPES if args.smoke else SHAPES) for mode in common.MODES
            if common.workload_matches(args.only, f"{shape.name}-{mode}")]
    header = {"suite": args.suite, "device": common.device_name(device), "date": common.today(),
              "versions": common.versions()}
    print(f"suite {args.suite} on {header['device']}; {len(rows)} rows -> {args.out}", flush=True)
    results = common.ResultsFile(args.out, header, merge=args.merge)
    cycles_per_us = common.spin_cycles_per_us() if device.type == "cuda" else None
    print_header()
    for shape, mode in rows:
        began = time.perf_counter()
        try:
            row = run_row(shape, mode, args, device, cycles_per_us)
        except Exception as error:  # a fault of the script: keep going, the row records it
            traceback.print_exc()
            row = common.harness_error_row(f"{shape.name}-{mode}", shape.params(mode), args.ours_backend or "default",
                                           error)
            row["peers"] = {PEER: {"error": "not run: the row failed"}}
        results.add(row)
        print_row(row, time.perf_counter() - began)
    return 0


if __name__ == "__main__":
    sys.exit(main())
