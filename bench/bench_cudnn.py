"""cudnn suite: fusedattn's cudnn backend against torch's attention kernels, on the same inputs, in one process.

ours            fusedattn.torch.attention(q, k, v, layout="bshd", mask=..., backend="cudnn")
sdpa_cudnn      torch SDPA under sdpa_kernel([SDPBackend.CUDNN_ATTENTION])   (q, k, v as (B, H, S, D) views)
sdpa_flash      torch SDPA under sdpa_kernel([SDPBackend.FLASH_ATTENTION])
sdpa_efficient  torch SDPA under sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION])
flex_compiled   torch.compile(flex_attention) with a causal block mask (built outside the timed region)
eager           softmax(q k^T * scale + mask) v in bf16 (only S <= 4096: it materialises B*H*S*S scores)
varlen_attn     torch.nn.attention.varlen.varlen_attn (THD case only)

Workloads: B=4, H=16, bf16, S in {1024, 4096, 16384}, D in {64, 128}, causal and not, modes fwd and
fwd+bwd; at S=1024 and 4096, a GQA case (Hq=16, Hkv=4, D=128, causal) and a THD case (packed sequences
of S, 3S/4, S/2 and S/4 tokens, H=16, D=128, causal). "fwd" times the forward of inputs that require
grad (the training forward, as FlashAttention's benchmarks do; --fwd-no-grad for inference);
"fwd+bwd" times the forward plus torch.autograd.grad of (q, k, v) with a fixed random output gradient.

Timing: CUDA events around each call, median of --repeats calls after --warmup calls, L2 not
flushed. Big rows cap repeats and warm-up so one entry's timed calls take about --max-ms-per-entry
(estimated at 250 TFLOP/s); the counts used are in each row's params. Rows faster than 2 ms a call,
where the host's time per call decides, then time every contestant again in --rounds interleaved rounds
(order reversed every other round) and keep the median of the rounds' medians, so a slow spell of the
host does not land on one contestant alone. FLOPs: 4*B*H*Sq*Skv*D
forward (halved for causal), fwd+bwd = 3.5x forward. ratio_vs_best_peer = best peer ms / ours ms.
Every failure of ours or of a peer becomes an {"error": ...} entry. The JSON
(bench/results/cudnn.json by default) is rewritten after every row, so a killed run keeps its
rows; --time-limit stops cleanly and prints the command that runs (and --merge's) the rest.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

try:  # python -m bench.bench_cudnn
    from . import common
except ImportError:  # python bench/bench_cudnn.py
    import common

SUITE = "cudnn"
OURS = "ours"  # fusedattn among the contestants timed in rounds
OURS_BACKEND = "cudnn"
DTYPE = torch.bfloat16
SDPA_PEERS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
PEERS = (*SDPA_PEERS, "flex_compiled", "eager", "varlen_attn")
# The peer our output is checked against: the first of these that runs.
REFERENCES = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "varlen_attn")
EAGER_MAX_S = 4096
EAGER_SKIPPED = "skipped: materialises B*H*S*S scores"
ASSUMED_TFLOPS = 250.0  # for sizing repeats of big rows only
MIN_REPEATS, MIN_WARMUP = 5, 2
FLEX_RECOMPILE_LIMIT = 64  # one compiled flex per (S, D, mask, GQA); dynamo's default limit is 8
SEED = 1234


# --- workloads ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One input shape; each case runs in every mode."""

    kind: str  # "dense" (bshd), "gqa" (bshd, Hkv < Hq) or "thd" (packed variable-length)
    B: int
    Hq: int
    Hkv: int
    S: int  # sequence length (Sq = Skv); for THD the longest sequence
    D: int
    causal: bool
    seqlens: tuple[int, ...] = field(default=())  # THD only: one length per sequence

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "none"

    @property
    def name(self) -> str:
        if self.kind == "gqa":
            return f"gqa-b{self.B}-hq{self.Hq}-hkv{self.Hkv}-s{self.S}-d{self.D}-{self.mask}"
        if self.kind == "thd":
            return f"thd-b{self.B}-h{self.Hq}-smax{self.S}-d{self.D}-{self.mask}"
        return f"bshd-b{self.B}-h{self.Hq}-s{self.S}-d{self.D}-{self.mask}"

    def flops(self, mode: str) -> float:
        lengths = self.seqlens if self.kind == "thd" else (self.S,) * self.B
        return sum(common.attention_flops(1, self.Hq, s, s, self.D, causal=self.causal, mode=mode) for s in lengths)

    def params(self, mode: str) -> dict:
        params = {"layout": "thd" if self.kind == "thd" else "bshd", "B": self.B, "Sq": self.S, "Skv": self.S,
                  "Hq": self.Hq, "Hkv": self.Hkv, "D": self.D, "dtype": "bfloat16", "mask": self.mask, "mode": mode}
        if self.kind == "thd":
            params.update(seqlens=list(self.seqlens), T=sum(self.seqlens))
        return params


def make_cases(seqlens: list[int], head_dims: list[int]) -> list[Case]:
    """Dense cases up to S=4096, then the GQA and THD cases (at S=1024 and 4096 where run, else at the
    longest S), then the long dense ones (a cut-off run keeps most)."""
    dense = [Case("dense", 4, 16, 16, s, d, causal) for s in seqlens for d in head_dims for causal in (True, False)]
    special_seqlens = [s for s in seqlens if s in (1024, 4096)] or [max(seqlens)]
    d_special = 128 if 128 in head_dims else max(head_dims)
    special = []
    for s in special_seqlens:
        special += [Case("gqa", 4, 16, 4, s, d_special, True),
                    Case("thd", 4, 16, 16, s, d_special, True, seqlens=(s, 3 * s // 4, s // 2, s // 4))]
    return ([c for c in dense if c.S <= 4096] + special + [c for c in dense if c.S > 4096])


# --- inputs ------------------------------------------------------------------------------------------------------

@dataclass
class Inputs:
    """Leaves in ours' layout (bshd, or thd), a fixed output gradient, and (B, H, S, D) leaf views for SDPA."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    grad_out: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    qt: torch.Tensor | None = None
    kt: torch.Tensor | None = None
    vt: torch.Tensor | None = None


def _bhsd_leaf(x: torch.Tensor) -> torch.Tensor:
    """A (B, H, S, D) view of x's storage that is its own autograd leaf (no copy, no transpose in backward)."""
    return x.detach().transpose(1, 2).requires_grad_()


def make_inputs(case: Case, device: torch.device) -> Inputs:
    generator = torch.Generator(device=device).manual_seed(SEED)
    randn = partial(torch.randn, device=device, dtype=DTYPE, generator=generator)
    if case.kind == "thd":
        total = sum(case.seqlens)
        q, k, v = (randn(total, h, case.D).requires_grad_() for h in (case.Hq, case.Hkv, case.Hkv))
        grad_out = randn(total, case.Hq, case.D)
        offsets = [0]
        for length in case.seqlens:
            offsets.append(offsets[-1] + length)
        cu_seqlens = torch.tensor(offsets, dtype=torch.int32, device=device)
        return Inputs(q, k, v, grad_out, cu_seqlens=cu_seqlens)
    q, k, v = (randn(case.B, case.S, h, case.D).requires_grad_() for h in (case.Hq, case.Hkv, case.Hkv))
    grad_out = randn(case.B, case.S, case.Hq, case.D)
    return Inputs(q, k, v, grad_out, qt=_bhsd_leaf(q), kt=_bhsd_leaf(k), vt=_bhsd_leaf(v))


def _to_bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


# --- implementations ---------------------------------------------------------------------------------------------

def ours(case: Case, x: Inputs, no_grad: bool, backend: str) -> common.Impl:
    import fusedattn.torch as fat

    if case.kind == "thd":
        call = partial(fat.attention, x.q, x.k, x.v, layout="thd", mask=case.mask, cu_seqlens_q=x.cu_seqlens,
                       cu_seqlens_kv=x.cu_seqlens, max_seqlen_q=case.S, max_seqlen_kv=case.S, backend=backend)
    else:
        call = partial(fat.attention, x.q, x.k, x.v, layout="bshd", mask=case.mask, backend=backend)
    return common.Impl("ours", call, (x.q, x.k, x.v), x.grad_out, forward_no_grad=no_grad)


def sdpa(name: str, case: Case, x: Inputs, no_grad: bool) -> common.Impl:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    backend = getattr(SDPBackend, SDPA_PEERS[name])
    kwargs = {"enable_gqa": True} if case.Hkv != case.Hq else {}
    call = partial(scaled_dot_product_attention, x.qt, x.kt, x.vt, is_causal=case.causal, **kwargs)
    return common.Impl(name, call, (x.qt, x.kt, x.vt), _to_bshd(x.grad_out), to_reference=_to_bshd,
                       context=partial(sdpa_kernel, [backend]), forward_no_grad=no_grad)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Flex:
    """torch.compile(flex_attention), compiled once per process; causal block masks cached per (S, device)."""

    def __init__(self):
        self._compiled = None
        self._block_masks = {}

    def compiled(self):
        if self._compiled is None:
            from torch.nn.attention.flex_attention import flex_attention

            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, limit, max(getattr(config, limit), FLEX_RECOMPILE_LIMIT))
            # dynamic=False: a kernel specialised to each shape, as a user with fixed shapes gets.
            self._compiled = torch.compile(flex_attention, dynamic=False)
        return self._compiled

    def block_mask(self, S: int, device: torch.device):
        key = (S, str(device))
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            self._block_masks[key] = create_block_mask(_causal, None, None, S, S, device=str(device))
        return self._block_masks[key]

    def impl(self, case: Case, x: Inputs, no_grad: bool) -> common.Impl:
        kwargs = {"enable_gqa": True} if case.Hkv != case.Hq else {}
        if case.causal:
            kwargs["block_mask"] = self.block_mask(case.S, x.q.device)  # outside the timed region
        call = partial(self.compiled(), x.qt, x.kt, x.vt, **kwargs)
        return common.Impl("flex_compiled", call, (x.qt, x.kt, x.vt), _to_bshd(x.grad_out), to_reference=_to_bshd,
                           forward_no_grad=no_grad)


def _eager_attention(q, k, v, *, scale: float, bias: torch.Tensor | None, groups: int):
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if bias is not None:
        scores = scores + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def eager(case: Case, x: Inputs, no_grad: bool) -> common.Impl | dict:
    if case.S > EAGER_MAX_S:
        return {"error": EAGER_SKIPPED}
    bias = None
    if case.causal:
        bias = torch.full((case.S, case.S), float("-inf"), dtype=DTYPE, device=x.q.device).triu(1)
    call = partial(_eager_attention, x.qt, x.kt, x.vt, scale=case.D ** -0.5, bias=bias, groups=case.Hq // case.Hkv)
    return common.Impl("eager", call, (x.qt, x.kt, x.vt), _to_bshd(x.grad_out), to_reference=_to_bshd,
                       forward_no_grad=no_grad)


def varlen(case: Case, x: Inputs, no_grad: bool) -> common.Impl | dict:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as error:
        return common.error_entry(f"torch.nn.attention.varlen unavailable in torch {torch.__version__}: {error}")
    parameters = inspect.signature(varlen_attn).parameters
    kwargs = {}
    if case.Hkv != case.Hq:
        kwargs["enable_gqa"] = True
    if case.causal:  # the keyword changed across torch versions
        if "window_size" in parameters:
            kwargs["window_size"] = (-1, 0)
        elif "is_causal" in parameters:
            kwargs["is_causal"] = True
        else:
            return {"error": f"varlen_attn{inspect.signature(varlen_attn)} takes neither window_size nor is_causal"}
    call = partial(varlen_attn, x.q, x.k, x.v, x.cu_seqlens, x.cu_seqlens, case.S, case.S, **kwargs)
    return common.Impl("varlen_attn", call, (x.q, x.k, x.v), x.grad_out, forward_no_grad=no_grad)


def peer_builders(case: Case, flex: Flex) -> dict[str, Callable[[Case, Inputs, bool], common.Impl | dict]]:
    if case.kind == "thd":  # SDPA, flex and eager take no cu_seqlens
        return {"varlen_attn": varlen}
    builders = {name: partial(sdpa, name) for name in SDPA_PEERS}
    builders.update(flex_compiled=flex.impl, eager=eager)
    return builders


# --- one row -----------------------------------------------------------------------------------------------------

def _sized(args, flops: float) -> tuple[int, int]:
    """(warmup, repeats), capped for big rows so an entry's timed calls take about --max-ms-per-entry."""
    if args.max_ms_per_entry <= 0:
        return args.warmup, args.repeats
    estimate_ms = flops / (ASSUMED_TFLOPS * 1e9)
    repeats = min(args.repeats, max(MIN_REPEATS, int(args.max_ms_per_entry / estimate_ms)))
    warmup = min(args.warmup, max(MIN_WARMUP, int(args.max_ms_per_entry / 3 / estimate_ms)))
    return warmup, repeats


def _with_value(entry: dict, flops: float) -> dict:
    if "ms" not in entry:
        return entry
    return {"ms": round(entry["ms"], 4), "value": round(common.tflops(flops, entry["ms"]), 2)}


def run_row(case: Case, mode: str, args, device: torch.device, flex: Flex) -> dict:
    flops = case.flops(mode)
    warmup, repeats = _sized(args, flops)
    params = case.params(mode)
    params.update(flops=int(flops), warmup=warmup, repeats=repeats, l2_flushed=False)
    if mode == common.FWD:
        params["fwd_under_no_grad"] = args.fwd_no_grad  # False: the training forward (inputs require grad)
    timing = dict(mode=mode, warmup=warmup, repeats=repeats, device=device)
    x = make_inputs(case, device)

    measured = {}  # contestant -> (impl, entry) of those that ran: timed again in rounds where the host decides
    try:
        impl = ours(case, x, args.fwd_no_grad, args.ours_backend)
    except Exception as error:  # e.g. fusedattn not importable
        entry, our_outputs = common.error_entry(error), None
    else:
        entry, our_outputs = common.measure(impl, keep_outputs=True, **timing)
        measured[OURS] = impl, entry
    ours_entry = {"backend": args.ours_backend, **_with_value(entry, flops)}

    peers, reference = {}, None
    for name, build in peer_builders(case, flex).items():
        if name not in args.peers:
            continue
        try:
            impl = build(case, x, args.fwd_no_grad)
        except Exception as error:
            impl = common.error_entry(error)
        if isinstance(impl, dict):
            peers[name] = impl
            continue
        check = our_outputs is not None and reference is None and name in REFERENCES
        entry, outputs = common.measure(impl, keep_outputs=check, **timing)
        peers[name] = _with_value(entry, flops)
        measured[name] = impl, entry
        if outputs is not None:
            reference = name
            try:
                params["max_abs_diff_vs_sdpa"] = common.max_abs_diff(our_outputs[:1], outputs[:1])
                if mode == common.FWD_BWD:
                    params["max_abs_grad_diff_vs_sdpa"] = common.max_abs_diff(our_outputs[1:], outputs[1:])
            except Exception as error:
                params["max_abs_diff_vs_sdpa"] = common.error_entry(error)["error"]
            params["max_abs_diff_ref"] = name
            del outputs
    if reference is None:
        params["max_abs_diff_vs_sdpa"] = None
        params["max_abs_diff_ref"] = None
    del our_outputs
    timed = {name: impl for name, (impl, entry) in measured.items() if "ms" in entry}
    if args.rounds > 1 and timed and min(measured[name][1]["ms"] for name in timed) < common.ROUNDS_BELOW_MS:
        params["rounds"] = args.rounds
        for name, ms in common.interleaved_ms(timed, rounds=args.rounds, **timing).items():
            entry = _with_value({"ms": ms}, flops)
            if name == OURS:
                ours_entry.update(entry)
            else:
                peers[name].update(entry)
    del measured, timed, x
    common.release_memory(device)

    ratio = common.best_peer_ratio(ours_entry, peers)
    return {"workload": f"{case.name}-{mode}", "params": params, "metric": "tflops", "ours": ours_entry,
            "peers": peers, "ratio_vs_best_peer": None if ratio is None else round(ratio, 4)}


# --- command line ------------------------------------------------------------------------------------------------

def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1024,4096, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench_cudnn.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python bench/bench_cudnn.py --quick\n"
               "  python bench/bench_cudnn.py --only 's16384' --merge     # add rows to an existing file\n"
               "  python bench/bench_cudnn.py --only 'fwd+bwd' --peers sdpa_cudnn,sdpa_flash\n"
               "  python bench/bench_cudnn.py --time-limit 300   # then run the printed command for the rest\n"
               "  python bench/bench_cudnn.py --list\n"
               "  python bench/bench_cudnn.py --device cpu --seqlens 128 --head-dims 64 --out /tmp/smoke.json"
               "   # smoke test")
    parser.add_argument("--quick", action="store_true", help="only S in {1024, 4096} and D = 128")
    common.add_run_arguments(parser, SUITE)
    parser.add_argument("--peers", type=common.choice_list(PEERS), default=list(PEERS),
                        help=f"comma-separated peers to run (default all: {','.join(PEERS)})")
    parser.add_argument("--max-ms-per-entry", type=float, default=1000.0,
                        help="cap repeats/warm-up of big rows so an entry's timed calls take about this long "
                             "(estimated at 250 TFLOP/s; 0 = no cap; default 1000)")
    parser.add_argument("--rounds", type=int, default=7,
                        help=f"rows faster than {common.ROUNDS_BELOW_MS:g} ms a call: interleaved rounds of every "
                             "contestant, the median of the rounds' medians kept (default 7; 1: no rounds)")
    parser.add_argument("--fwd-no-grad", action="store_true",
                        help="time 'fwd' under torch.no_grad() (inference) instead of the training forward; "
                             "compiles flex once more per shape")
    parser.add_argument("--time-limit", type=float, default=0.0, metavar="SECONDS",
                        help="start no new row after this many seconds; print the --only/--merge command that "
                             "runs the rest (default 0 = no limit)")
    parser.add_argument("--seqlens", type=_int_list, default=None, help="override S (comma-separated)")
    parser.add_argument("--head-dims", type=_int_list, default=None, help="override D (comma-separated)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default); cpu only smoke-tests the script (no cuDNN, wall-clock timing)")
    parser.add_argument("--ours-backend", default=OURS_BACKEND,
                        help="fusedattn backend forced for ours (default cudnn; e.g. reference to smoke-test on cpu); "
                             "another one names the suite cudnn-ours-<backend>")
    return common.parse_suite_args(parser, argv, SUITE, OURS_BACKEND)


def _print_rest(rows: list[tuple[Case, str]], args) -> None:
    """The command that runs the rows a --time-limit left out and merges them into the same file."""
    names = [f"{case.name}-{mode}" for case, mode in rows]
    pattern = "^(" + "|".join(name.replace("+", r"\+") for name in names) + ")$"
    options = [f"--merge --out {args.out} --only '{pattern}'"]
    defaults = parse_args([])
    for option in ("repeats", "warmup", "max_ms_per_entry", "device", "ours_backend"):
        if getattr(args, option) != getattr(defaults, option):
            options.append(f"--{option.replace('_', '-')} {getattr(args, option)}")
    for option in ("seqlens", "head_dims", "peers"):
        if getattr(args, option) and getattr(args, option) != getattr(defaults, option):
            options.append(f"--{option.replace('_', '-')} {','.join(map(str, getattr(args, option)))}")
    if args.fwd_no_grad:
        options.append("--fwd-no-grad")
    print(f"time limit of {args.time_limit:g} s reached; {len(names)} rows not run. To run them and add them to "
          f"{args.out}:\n  python bench/bench_cudnn.py {' '.join(options)}", flush=True)


def shape_grid(args) -> tuple[list[int], list[int]]:
    """(seqlens, head_dims) of a run: --seqlens/--head-dims, else the standard grid (--quick: its
    S=1024/4096, D=128 corner). Shared by the suites that measure the torch benchmarks' shapes."""
    seqlens = args.seqlens or ([1024, 4096] if args.quick else [1024, 4096, 16384])
    head_dims = args.head_dims or ([128] if args.quick else [64, 128])
    return seqlens, head_dims


def main(argv=None) -> int:
    args = parse_args(argv)
    seqlens, head_dims = shape_grid(args)
    rows = [(case, mode) for case in make_cases(seqlens, head_dims) for mode in common.MODES
            if common.workload_matches(args.only, f"{case.name}-{mode}")]
    flex = Flex()
    return common.run_suite(
        "bench_cudnn", args, rows, lambda case, mode, device: run_row(case, mode, args, device, flex),
        [p for p in PEERS if p in args.peers],
        harness_row=lambda case, mode, error: common.harness_error_row(
            f"{case.name}-{mode}", case.params(mode), args.ours_backend, error),
        cpu_hint="or --device cpu to smoke-test the script",
        notes=[f"CUDA-event median of up to {args.repeats} calls after up to {args.warmup} warm-up calls, "
               "L2 not flushed"],
        time_limit=args.time_limit, on_time_limit=lambda rest: _print_rest(rest, args))


if __name__ == "__main__":
    sys.exit(main())
