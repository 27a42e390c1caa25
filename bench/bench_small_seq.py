"""small_seq suite: one query per sequence against a few keys, at huge batch; memory-bound, so in GB/s.

ours             fusedattn.torch.attention(q, k, v, layout="bshd", backend="small_seq")
                 (what fusedattn.torch.small_seq_attention runs); q (B, 1, Hq, D), k and v (B, Skv, Hkv, D)
fusedattn_cudnn  the same call with backend="cudnn" (it declines some shapes: its reasons are the entry)
sdpa_cudnn       torch SDPA under sdpa_kernel([SDPBackend.CUDNN_ATTENTION]) on (B, Hq, 1, D) / (B, Hkv, Skv, D)
sdpa_flash       ... FLASH_ATTENTION      views of the same tensors; enable_gqa=True when Hkv < Hq
sdpa_efficient   ... EFFICIENT_ATTENTION
sdpa_math        ... MATH (upcasts bf16 to float32 and expands the kv heads: skipped when too large)
flex_compiled    torch.compile(flex_attention) on the same views, no mask, compiled once per shape
eager            softmax(q k^T * scale) v with the query heads of each kv head grouped (no copies of
                 k, v per query head), bf16 matmuls, float32 only for the (B, Hq, 1, Skv) scores

Every sequence has all Skv keys (padded bshd without padding mask), so every peer sees the same inputs.

Workloads (bf16, Sq = 1, no mask), named sq1-b<B>-h<Hq>-hkv<Hkv>-skv<Skv>-d<D>-<mode>:
  default   B=30720, Hq=16, Hkv in {16, 1}, Skv in {2, 4, 8, 16}, D in {128, 256, 512} (the acceptance
            family), plus the "1M tokens" batch at D=128
  --full    B in {30720, 1M tokens}, Hq in {8, 16}, Hkv in {Hq, 1}, Skv in {2, 4, 8, 16}, D in {128, 256, 512}
  --sweep   B=30720, Hq=Hkv=16, D=128, Skv in {16, 32, 64, 128}: where small_seq stops beating the others.
            The backend refuses Skv > 64 (> 16 with grouped heads or D > 128); the sweep raises that limit in this
            process (the kernels run up to 128) and records it as params.small_seq_max_seqlen_kv
  --quick   the acceptance row only: B=30720, Hq=Hkv=16, Skv=16, D=128
"1M tokens" is about a million key tokens: B = 2**20 // Skv sequences (--batch 1M; 512K etc. also work).
Modes: "fwd" times the training forward (inputs require grad; --fwd-no-grad for inference) and
"fwd+bwd" the forward plus torch.autograd.grad of (q, k, v) with a fixed output gradient (common.measure
has no backward-only mode). fwd+bwd rows also hold ours' backward alone, derived as ours fwd+bwd ms minus
ours fwd ms of the same run: params.ours_bwd_GBps_derived and ours_bwd_fraction_of_copy_derived.

Bytes (params.bytes, the minimum any implementation moves; 2 bytes an element, LSE float32):
  forward   read q, k, v, write out and LSE:   2*(2*B*Hq*D + 2*B*Skv*Hkv*D) + 4*B*Hq
  backward  read q, k, v, dO, LSE, write dq, dk, dv:   2*(3*B*Hq*D + 4*B*Skv*Hkv*D) + 4*B*Hq
  fwd+bwd   forward + backward
Each entry's value is bytes / time in GB/s (metric "gbps"); ratio_vs_best_peer = best peer ms / ours ms
over every peer. The device-to-device copy bandwidth (dst.copy_(src) of a --copy-gib bf16 tensor,
CUDA-event median of 20, 2x its size in bytes) is measured once per run: params.copy_GBps, and
params.fraction_of_copy = ours GB/s / copy_GBps. The acceptance: at B=30720, H=16, Skv=16, D=128,
forward >= 0.85 and backward >= 0.70 of the copy bandwidth, and >= 3x the best peer.

Checks: every peer's output (and in fwd+bwd its gradients) against ours, as params.max_abs_diff_vs_<peer>
and max_abs_grad_diff_vs_<peer>; max_abs_diff_vs_sdpa (the key the other suites use) repeats the first of
REFERENCES that ran, named by max_abs_diff_ref. Rows bigger than CHECK_BYTES a tensor compare evenly
spaced sequences, the first and the last included (params.checked_sequences).

Memory: sdpa_math and eager are skipped ("skipped: too large") when a rough estimate of what they
allocate beyond the inputs exceeds --peer-memory-gib. Timing and error entries as in bench_cudnn: CUDA
events, median of --repeats after --warmup, L2 not flushed (a row's tensors are far larger than L2).
The JSON (bench/results/small_seq.json by default) is rewritten after every row;
`python bench/plot_small_seq.py` draws it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple
from unittest import mock

import torch

try:  # python -m bench.bench_small_seq
    from . import bench_cudnn, bench_score_mod, common
except ImportError:  # python bench/bench_small_seq.py
    import bench_cudnn
    import bench_score_mod
    import common

SUITE = "small_seq"
OURS_BACKEND = "small_seq"
DTYPE = bench_cudnn.DTYPE
SEED = bench_cudnn.SEED
PEERS = ("fusedattn_cudnn", *bench_cudnn.SDPA_PEERS, "sdpa_math", "flex_compiled", "eager")
# The peer whose diff is repeated under max_abs_diff_vs_sdpa: the first of these that ran (math: float32 inside).
REFERENCES = ("sdpa_math", "sdpa_efficient", "sdpa_cudnn", "sdpa_flash", "eager", "flex_compiled")
BATCH = 30720  # sequences, as in the acceptance rows
CHECK_BYTES = 1 << 30  # largest checked slice of a tensor: ours and a peer both keep theirs while compared
COPY_WARMUP, COPY_REPEATS = 3, 20
CPU_COPY_GIB = 1 / 16  # the smoke test's copy: 4 GiB would only be slow on the CPU


# --- workloads ---------------------------------------------------------------------------------------------------

class Batch(NamedTuple):
    """A batch rule: `count` sequences, or (tokens) as many sequences as make `count` key tokens."""

    count: int
    tokens: bool = False

    def size(self, Skv: int) -> int:
        return max(1, self.count // Skv) if self.tokens else self.count

    @property
    def label(self) -> str:
        return f"{self.count} key tokens (B = {self.count} // Skv)" if self.tokens else f"{self.count} sequences"


@dataclass(frozen=True)
class Case:
    """One input shape (Sq = 1, no mask); each case runs in every mode."""

    batch: Batch
    Hq: int
    Hkv: int
    Skv: int
    D: int

    causal = False  # read by bench_cudnn's sdpa and Flex

    @property
    def B(self) -> int:
        return self.batch.size(self.Skv)

    @property
    def name(self) -> str:
        return f"sq1-b{self.B}-h{self.Hq}-hkv{self.Hkv}-skv{self.Skv}-d{self.D}"

    def elements(self) -> tuple[int, int]:
        """(elements of q, elements of k plus v)."""
        return self.B * self.Hq * self.D, 2 * self.B * self.Skv * self.Hkv * self.D

    def moved_bytes(self, mode: str) -> int:
        """The minimum bytes moved (see the module docstring)."""
        q, kv = self.elements()
        lse = 4 * self.B * self.Hq
        forward = 2 * (2 * q + kv) + lse
        backward = 2 * (3 * q + 2 * kv) + lse
        return forward + backward if mode == common.FWD_BWD else forward

    def params(self, mode: str) -> dict:
        return {"layout": "bshd", "B": self.B, "batch_rule": self.batch.label, "Sq": 1, "Skv": self.Skv,
                "Hq": self.Hq, "Hkv": self.Hkv, "D": self.D, "dtype": "bfloat16", "mask": "none", "mode": mode,
                "bytes": self.moved_bytes(mode)}


def grid(batches, heads, kv_heads, seqlens, dims) -> list[Case]:
    """Every combination; a kv_heads entry of None means Hkv = Hq."""
    return [Case(batch, hq, hq if hkv is None else hkv, s, d)
            for batch in batches for hq in heads for hkv in kv_heads for d in dims for s in seqlens]


def make_cases(args) -> list[Case]:
    """The chosen grid, each of --batch/--heads/--kv-heads/--seqlens-kv/--head-dims replacing its axis."""
    thirty, million = Batch(BATCH), Batch(1 << 20, tokens=True)
    if args.quick:
        parts = [([thirty], [16], [None], [16], [128])]
    elif args.sweep:
        parts = [([thirty], [16], [None], [16, 32, 64, 128], [128])]
    elif args.full:
        parts = [([thirty, million], [8, 16], [None, 1], [2, 4, 8, 16], [128, 256, 512])]
    else:
        parts = [([thirty], [16], [None, 1], [2, 4, 8, 16], [128, 256, 512]),
                 ([million], [16], [None, 1], [2, 4, 8, 16], [128])]
    overrides = (args.batch, args.heads, args.kv_heads, args.seqlens_kv, args.head_dims)
    cases = []
    for part in parts:
        cases += grid(*(given or default for given, default in zip(overrides, part)))
    return list(dict.fromkeys(cases))  # overrides can make two parts alike


# --- inputs and implementations ----------------------------------------------------------------------------------

def make_inputs(case: Case, device: torch.device) -> bench_cudnn.Inputs:
    """bshd leaves for fusedattn, (B, H, S, D) leaf views of the same storage for torch's peers."""
    generator = torch.Generator(device=device).manual_seed(SEED)
    randn = partial(torch.randn, device=device, dtype=DTYPE, generator=generator)
    q = randn(case.B, 1, case.Hq, case.D).requires_grad_()
    k, v = (randn(case.B, case.Skv, case.Hkv, case.D).requires_grad_() for _ in range(2))
    grad_out = randn(case.B, 1, case.Hq, case.D)
    leaf = bench_cudnn._bhsd_leaf
    return bench_cudnn.Inputs(q, k, v, grad_out, qt=leaf(q), kt=leaf(k), vt=leaf(v))


def fusedattn_impl(name: str, backend: str, x: bench_cudnn.Inputs, no_grad: bool) -> common.Impl:
    import fusedattn.torch as fat

    call = partial(fat.attention, x.q, x.k, x.v, layout="bshd", backend=backend)
    return common.Impl(name, call, (x.q, x.k, x.v), x.grad_out, forward_no_grad=no_grad)


def sdpa_math(case: Case, x: bench_cudnn.Inputs, no_grad: bool) -> common.Impl:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    impl = bench_cudnn.sdpa("sdpa_flash", case, x, no_grad)  # the same call; only the kernel choice differs
    return dataclasses.replace(impl, name="sdpa_math", context=partial(sdpa_kernel, [SDPBackend.MATH]))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Eager attention of (B, Hq, 1, D) queries: each kv head serves its group of query heads at once."""
    batch, heads_q, _, dim = q.shape
    grouped = q.reshape(batch, k.shape[1], heads_q // k.shape[1], dim)
    scores = torch.matmul(grouped, k.transpose(-2, -1)).float() * scale  # float32 only here: B*Hq*Skv values
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, heads_q, 1, dim)


def eager(case: Case, x: bench_cudnn.Inputs, no_grad: bool) -> common.Impl:
    call = partial(grouped_attention, x.qt, x.kt, x.vt, scale=case.D ** -0.5)
    return common.Impl("eager", call, (x.qt, x.kt, x.vt), bench_cudnn._to_bshd(x.grad_out),
                       to_reference=bench_cudnn._to_bshd, forward_no_grad=no_grad)


def peer_builders(flex: bench_cudnn.Flex) -> dict[str, Callable[[Case, bench_cudnn.Inputs, bool], common.Impl]]:
    builders = {"fusedattn_cudnn": lambda case, x, no_grad: fusedattn_impl("fusedattn_cudnn", "cudnn", x, no_grad)}
    builders.update({name: partial(bench_cudnn.sdpa, name) for name in bench_cudnn.SDPA_PEERS})
    builders.update(sdpa_math=sdpa_math, flex_compiled=flex.impl, eager=eager)
    return builders


def extra_bytes(name: str, case: Case, mode: str) -> int:
    """A rough estimate of what a peer allocates beyond the inputs (0: not estimated, never skipped)."""
    q, kv = case.elements()
    backward = mode == common.FWD_BWD
    if name == "sdpa_math":  # float32 k and v expanded to Hq heads (and a scaled k); their gradients too
        expanded = 4 * (kv // 2) * (case.Hq // case.Hkv)
        return expanded * (5 if backward else 3)
    if name == "eager":  # contiguous copies of k and v for the batched matmuls; their gradients too
        return 2 * kv * (2 if backward else 1)
    return 0


def too_large(name: str, case: Case, mode: str, limit_gib: float) -> dict | None:
    estimate = extra_bytes(name, case, mode)
    if estimate <= limit_gib * 2**30:
        return None
    return {"error": f"skipped: too large (would allocate about {estimate / 2**30:.1f} GiB beyond the inputs; "
                     f"--peer-memory-gib {limit_gib:g})"}


# --- checks ------------------------------------------------------------------------------------------------------

def check_index(case: Case, device: torch.device) -> torch.Tensor | None:
    """Evenly spaced sequences, first and last included, when whole tensors exceed CHECK_BYTES; else None."""
    per_sequence = 2 * case.Skv * case.Hkv * case.D
    count = max(2, CHECK_BYTES // per_sequence)
    if count >= case.B:
        return None
    return torch.linspace(0, case.B - 1, count, device=device).round().long()


def sampled(build: Callable[[], common.Impl], index: torch.Tensor | None) -> Callable[[], common.Impl]:
    """build, its impl's checked outputs kept to the sequences in index (dim 0 of the bshd reference layout)."""
    def build_sampled() -> common.Impl:
        impl = build()
        if index is None:
            return impl
        to_reference = impl.to_reference
        return dataclasses.replace(impl, to_reference=lambda t: to_reference(t).index_select(0, index))
    return build_sampled


def record_reference(params: dict, mode: str) -> None:
    """Repeat the first reference peer's diffs under the keys the other suites (and the live table) use."""
    ran = [name for name in REFERENCES if f"max_abs_diff_vs_{name}" in params]
    params["max_abs_diff_ref"] = ran[0] if ran else None
    params["max_abs_diff_vs_sdpa"] = params.get(f"max_abs_diff_vs_{ran[0]}") if ran else None
    if ran and mode == common.FWD_BWD:
        params["max_abs_grad_diff_vs_sdpa"] = params.get(f"max_abs_grad_diff_vs_{ran[0]}")


# --- bandwidth ---------------------------------------------------------------------------------------------------

def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e6)


def copy_bandwidth(device: torch.device, gib: float) -> float:
    """GB/s of dst.copy_(src) for a `gib` GiB bf16 tensor: it reads and writes its size."""
    count = int(gib * 2**30) // 2
    src = torch.empty(count, dtype=DTYPE, device=device)
    dst = torch.empty_like(src)
    times = common.time_ms(partial(dst.copy_, src), warmup=COPY_WARMUP, repeats=COPY_REPEATS, device=device)
    del src, dst
    common.release_memory(device)
    return gbps(2 * 2 * count, statistics.median(times))


def with_value(entry: dict, nbytes: int) -> dict:
    if "ms" not in entry:
        return entry
    return {"ms": round(entry["ms"], 4), "value": round(gbps(nbytes, entry["ms"]), 1)}


def record_bandwidth(params: dict, case: Case, mode: str, ours: dict, run: Run) -> None:
    """Ours as a fraction of the copy bandwidth; in fwd+bwd also ours' backward alone (fwd+bwd - fwd)."""
    params["copy_GBps"] = round(run.copy_GBps, 1)
    if "value" not in ours:
        return
    params["fraction_of_copy"] = round(ours["value"] / run.copy_GBps, 4)
    if mode == common.FWD:
        run.forward_ms[case.name] = ours["ms"]
        return
    forward = run.forward_ms.get(case.name)
    if forward is None or ours["ms"] <= forward:
        return
    backward_ms = ours["ms"] - forward
    backward = gbps(case.moved_bytes(common.FWD_BWD) - case.moved_bytes(common.FWD), backward_ms)
    params.update(ours_bwd_ms_derived=round(backward_ms, 4), ours_bwd_GBps_derived=round(backward, 1),
                  ours_bwd_fraction_of_copy_derived=round(backward / run.copy_GBps, 4))


# --- one row -----------------------------------------------------------------------------------------------------

class Run:
    """What the rows of one run share: flex (compiled once per shape), the copy bandwidth, ours' fwd times."""

    def __init__(self, args, device: torch.device, cases: int):
        self.flex = bench_cudnn.Flex()
        allow_recompiles(2 * cases + 8)  # a shape each, twice with --fwd-no-grad
        gib = args.copy_gib if args.copy_gib is not None else CPU_COPY_GIB if device.type == "cpu" else 4.0
        self.copy_GBps = copy_bandwidth(device, gib)
        self.forward_ms: dict[str, float] = {}
        print(f"copy bandwidth: {self.copy_GBps:.1f} GB/s (dst.copy_(src), {gib:g} GiB bf16, median of "
              f"{COPY_REPEATS})", flush=True)


def allow_recompiles(limit: int) -> None:
    """Raise dynamo's per-function recompile limit before Flex compiles (it keeps a higher value)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))


def row_params(case: Case, mode: str, args) -> dict:
    params = case.params(mode)
    params.update(warmup=args.warmup, repeats=args.repeats, l2_flushed=False)
    if mode == common.FWD:
        params["fwd_under_no_grad"] = args.fwd_no_grad
    if args.sweep:
        from fusedattn.backends import small_seq

        params["small_seq_max_seqlen_kv"] = small_seq.MAX_SEQLEN_KV
    return params


def run_row(case: Case, mode: str, args, device: torch.device, run: Run) -> dict:
    params = row_params(case, mode, args)
    nbytes = params["bytes"]
    timing = dict(mode=mode, warmup=args.warmup, repeats=args.repeats, device=device)
    x = make_inputs(case, device)
    index = check_index(case, device)
    params["checked_sequences"] = case.B if index is None else int(index.numel())

    build = partial(fusedattn_impl, "ours", args.ours_backend, x, args.fwd_no_grad)
    entry, ours_out = bench_score_mod._measure(sampled(build, index), True, timing)
    ours = {"backend": args.ours_backend, **with_value(entry, nbytes)}
    peers = {}
    for name, make in peer_builders(run.flex).items():
        if name not in args.peers:
            continue
        skipped = too_large(name, case, mode, args.peer_memory_gib)
        if skipped:
            peers[name] = skipped
            continue
        build = sampled(partial(make, case, x, args.fwd_no_grad), index)
        entry, outputs = bench_score_mod._measure(build, ours_out is not None, timing)
        peers[name] = with_value(entry, nbytes)
        if outputs is not None:
            bench_score_mod._record_diff(params, f"vs_{name}", ours_out, outputs, mode)
        del outputs
    del ours_out, x, index
    common.release_memory(device)

    record_reference(params, mode)
    record_bandwidth(params, case, mode, ours, run)
    ratio = common.best_peer_ratio(ours, peers)
    return {"workload": f"{case.name}-{mode}", "params": params, "metric": "gbps", "ours": ours, "peers": peers,
            "ratio_vs_best_peer": None if ratio is None else round(ratio, 4)}


# --- the live table ----------------------------------------------------------------------------------------------

def _printed(fn: Callable, *args) -> list[str]:
    """What fn(*args) prints, as lines."""
    with contextlib.redirect_stdout(io.StringIO()) as buffer:
        fn(*args)
    return buffer.getvalue().splitlines()


class GbpsTable(common.LiveTable):
    """common.LiveTable in GB/s, with ours' fraction of the copy bandwidth as a last column."""

    def __init__(self, peers):
        header = _printed(super().__init__, peers)[0]
        print(header.replace(f"{'ours TF':>8}", f"{'GB/s':>8}") + f" {'copy':>5}", flush=True)
        print("  (GB/s of the minimum bytes moved, peers too; ratio = best peer ms / ours ms, > 1: ours faster; "
              "maxdiff = max |ours - reference|; copy = ours GB/s / measured copy GB/s)", flush=True)

    def row(self, row: dict, seconds: float | None = None) -> None:
        first, *rest = _printed(super().row, row)
        fraction = row["params"].get("fraction_of_copy")
        cell = f"{fraction:5.2f}" if isinstance(fraction, float) else f"{'-':>5}"
        took = "" if seconds is None else f"  [{seconds:.1f} s]"
        print("\n".join([f"{first} {cell}{took}", *rest]), flush=True)


# --- command line ------------------------------------------------------------------------------------------------

def _batch_list(text: str) -> list[Batch]:
    """30720 (sequences) or 1M / 512K (key tokens: B = tokens // Skv), comma-separated."""
    batches = []
    for part in filter(None, (p.strip().upper() for p in text.split(","))):
        scale = {"M": 1 << 20, "K": 1 << 10}.get(part[-1])
        digits = part[:-1] if scale else part
        if not digits.isdigit() or int(digits) <= 0:
            raise argparse.ArgumentTypeError(f"expected sequences (30720) or key tokens (1M, 512K), got {part!r}")
        batches.append(Batch(int(digits) * scale, tokens=True) if scale else Batch(int(digits)))
    if not batches:
        raise argparse.ArgumentTypeError(f"expected at least one batch, got {text!r}")
    return batches


def _kv_heads_list(text: str) -> list[int | None]:
    """Hkv values, comma-separated; 'hq' means Hkv = Hq."""
    parts = [p.strip().lower() for p in text.split(",") if p.strip()]
    if not parts or not all(p == "hq" or (p.isdigit() and int(p) > 0) for p in parts):
        raise argparse.ArgumentTypeError(f"expected positive integers or hq, such as hq,1, got {text!r}")
    return [None if p == "hq" else int(p) for p in parts]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench_small_seq.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python bench/bench_small_seq.py --quick\n"
               "  python bench/bench_small_seq.py --sweep --merge     # add the Skv sweep to the file\n"
               "  python bench/bench_small_seq.py --full --only 'd512' --peers sdpa_math,eager\n"
               "  python bench/bench_small_seq.py --list\n"
               "  python bench/plot_small_seq.py     # the bandwidth plot (needs matplotlib)\n"
               "  TRITON_INTERPRET=1 FUSEDATTN_SMALL_SEQ_ON_CPU=1 python bench/bench_small_seq.py --device cpu "
               "--batch 64 --seqlens-kv 4 --head-dims 64 --out /tmp/smoke.json   # smoke test")
    grids = parser.add_mutually_exclusive_group()
    grids.add_argument("--quick", action="store_true", help="only the acceptance row (B=30720, H=16, Skv=16, D=128)")
    grids.add_argument("--full", action="store_true", help="the whole grid of the issue (192 rows)")
    grids.add_argument("--sweep", action="store_true",
                       help="Skv in {16, 32, 64, 128} at B=30720, H=16, D=128, small_seq's Skv limit raised")
    parser.add_argument("--batch", type=_batch_list, default=None,
                        help="override B: sequences (30720) or key tokens (1M = B of 2**20 // Skv), comma-separated")
    parser.add_argument("--heads", type=bench_cudnn._int_list, default=None, help="override Hq (comma-separated)")
    parser.add_argument("--kv-heads", type=_kv_heads_list, default=None,
                        help="override Hkv, comma-separated; 'hq' means Hkv = Hq (default hq,1)")
    parser.add_argument("--seqlens-kv", type=bench_cudnn._int_list, default=None,
                        help="override Skv (comma-separated; above 16 ours declines unless --sweep)")
    parser.add_argument("--head-dims", type=bench_cudnn._int_list, default=None, help="override D (comma-separated)")
    parser.add_argument("--modes", type=common.choice_list(common.MODES), default=list(common.MODES),
                        help=f"modes, comma-separated (default {','.join(common.MODES)})")
    parser.add_argument("--peers", type=common.choice_list(PEERS), default=list(PEERS),
                        help=f"comma-separated peers to run (default all: {','.join(PEERS)})")
    common.add_run_arguments(parser, SUITE)
    parser.add_argument("--fwd-no-grad", action="store_true",
                        help="time 'fwd' under torch.no_grad() (inference) instead of the training forward; "
                             "compiles flex once more per shape")
    parser.add_argument("--copy-gib", type=float, default=None,
                        help=f"size of the copy-bandwidth tensor in GiB (default 4; {CPU_COPY_GIB:g} on cpu)")
    parser.add_argument("--peer-memory-gib", type=float, default=40.0,
                        help="skip sdpa_math / eager when they would allocate more than this beyond the inputs "
                             "(default 40)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default); cpu only smoke-tests the script (ours needs TRITON_INTERPRET=1 and "
                             "FUSEDATTN_SMALL_SEQ_ON_CPU=1 set before python starts)")
    parser.add_argument("--ours-backend", default=OURS_BACKEND,
                        help="fusedattn backend forced for ours (default small_seq); another one names the suite "
                             "small_seq-ours-<backend>")
    return common.parse_suite_args(parser, argv, SUITE, OURS_BACKEND)


def raise_seqlen_limit(longest: int) -> None:
    """--sweep: let small_seq take Skv up to `longest` in this process (it reads the limit at each probe)."""
    from fusedattn import selection
    from fusedattn.backends import small_seq

    small_seq.MAX_SEQLEN_KV = max(small_seq.MAX_SEQLEN_KV, longest)
    small_seq.MAX_SEQLEN_KV_MHA = max(small_seq.MAX_SEQLEN_KV_MHA, longest)
    selection.clear_decisions()  # decisions taken under the old limit


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = make_cases(args)
    rows = [(case, mode) for case in cases for mode in args.modes
            if common.workload_matches(args.only, f"{case.name}-{mode}")]
    if args.sweep and rows and not args.list:
        raise_seqlen_limit(max(case.Skv for case, _ in rows))
    state = {}

    def run_one(case, mode, device):
        if "run" not in state:  # measures and compiles nothing before the first row
            state["run"] = Run(args, device, len(cases))
        return run_row(case, mode, args, device, state["run"])

    def harness_row(case, mode, error):
        row = common.harness_error_row(f"{case.name}-{mode}", case.params(mode), args.ours_backend, error)
        return {**row, "metric": "gbps"}

    with mock.patch.object(common, "LiveTable", GbpsTable):  # run_suite's table, in GB/s
        return common.run_suite(
            "bench_small_seq", args, rows, run_one, [p for p in PEERS if p in args.peers], harness_row=harness_row,
            cpu_hint="or --device cpu with TRITON_INTERPRET=1 FUSEDATTN_SMALL_SEQ_ON_CPU=1 to smoke-test the script",
            notes=[f"CUDA-event median of {args.repeats} calls after {args.warmup} warm-up calls, L2 not flushed; "
                   "GB/s of the minimum bytes moved (params.bytes)"])


if __name__ == "__main__":
    sys.exit(main())
