"""score_mod suite: fusedattn's cudnn backend with a score_mod against torch.compile'd FlexAttention doing the same.

ours           fusedattn.torch.attention(q, k, v, layout="bshd", mask="none", backend="cudnn", score_mod=<mod>)
flex_compiled  torch.compile(flex_attention) on (B, H, S, D) views of the same inputs, in the form users run:
               a score_mod for softcap, alibi and relpos; a BlockMask from a mask_mod (built outside the timed
               region, so flex skips fully masked blocks) for causal and document
cudnn_plain    the same cudnn call without score_mod (mask="causal" on the causal rows, "none" otherwise):
               what the modification costs; params.ours_ms_over_cudnn_plain = ours ms / its ms

Modifications, applied to the scaled scores (scale = 1/sqrt(D)):
  softcap   20 * tanh(s / 20)  (a cap low enough to change bf16 outputs)
  alibi     s - slope[h] * |q_idx - kv_idx| with fusedattn.standard_alibi_slopes(16), not causal
  relpos    s + table[h, clip(kv_idx - q_idx, -128, 128) + 128] for a (16, 257) bf16 table
  causal    keys after the query masked, written as a score_mod (ours: mask="none" plus causal())
  document  4 contiguous documents of seeded random lengths per batch row; queries see their own document only
  <mod>_flex  ours given FlexAttention's own function for softcap, alibi or relpos (traced by fusedattn, its
            derivative derived): the portable path against the hand-written built-in above

Workloads: B=4, H=16, bf16, S in {1024, 4096, 16384}, D in {64, 128}, modes fwd (the training forward:
inputs require grad) and fwd+bwd (plus torch.autograd.grad of (q, k, v) with a fixed output gradient).

FLOPs: 4*B*H*S*S*D forward, fwd+bwd = 3.5x forward, counted the same for ours and flex so ratios compare
times: halved for causal (attention_flops(causal=True)); for document scaled by the exact fraction of
visible (q, kv) pairs, sum over documents of length^2 / (B*S^2) (params.visible_fraction). cudnn_plain's
TFLOP/s count the work of its own call (dense, or causal). ratio_vs_best_peer = flex_compiled ms / ours ms
(> 1: ours faster; cudnn_plain is a baseline, not a peer, so it is left out: params.ratio_peers).

Checks: max_abs_diff_vs_sdpa / max_abs_grad_diff_vs_sdpa hold max |ours - flex_compiled| over the output
and the gradients (the keys of bench_cudnn's rows; max_abs_diff_ref names the reference); the _vs_cudnn_plain
keys hold the same against the unmodified call, ~0 on causal rows and clearly > 0 on the others (0 there
would mean the modification was ignored).

Timing, sizing of big rows and error entries as in bench_cudnn. The JSON (bench/results/score_mod.json by
default) is rewritten after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

try:  # python -m bench.bench_score_mod
    from . import bench_cudnn, common
except ImportError:  # python bench/bench_score_mod.py
    import bench_cudnn
    import common

SUITE = "score_mod"
OURS_BACKEND = "cudnn"
DTYPE = bench_cudnn.DTYPE
BATCH, HEADS = 4, 16
# "<mod>_flex": ours runs FlexAttention's own function (the same object flex gets), traced by fusedattn.
MODS = ("softcap", "alibi", "relpos", "causal", "document", "softcap_flex", "alibi_flex", "relpos_flex")
PEERS = ("flex_compiled", "cudnn_plain")
RATIO_PEERS = ("flex_compiled",)  # the ratio compares implementations of the modification only
SOFTCAP = 20.0
RELPOS_REACH = 128  # M: the table has 2M + 1 columns
DOCUMENTS = 4  # per batch row
SEED = bench_cudnn.SEED


# --- workloads ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One modification at one shape; each case runs in every mode."""

    mod: str
    S: int
    D: int

    @property
    def name(self) -> str:
        return f"{self.mod}-b{BATCH}-h{HEADS}-s{self.S}-d{self.D}"

    def dense(self, causal: bool = False) -> bench_cudnn.Case:
        """bench_cudnn's case of this shape: inputs, params and the plain call come from it."""
        return bench_cudnn.Case("dense", BATCH, HEADS, HEADS, self.S, self.D, causal)


def make_cases(seqlens: list[int], head_dims: list[int], mods: list[str]) -> list[Case]:
    """Short sequences first, so a cut-off run keeps most rows."""
    return [Case(mod, s, d) for s in sorted(seqlens) for d in head_dims for mod in mods]


# --- the modifications, both ways --------------------------------------------------------------------------------

# FlexAttention forms, written as its users write them: functions closing over their tensors.

def flex_softcap(cap: float):
    return lambda score, b, h, q_idx, kv_idx: cap * torch.tanh(score / cap)


def flex_alibi(slopes: torch.Tensor):
    return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx).abs()


def flex_relpos(table: torch.Tensor, reach: int):
    return lambda score, b, h, q_idx, kv_idx: score + table[h, (kv_idx - q_idx).clamp(-reach, reach) + reach]


def flex_document(segment_ids: torch.Tensor):
    return lambda b, h, q_idx, kv_idx: segment_ids[b, q_idx] == segment_ids[b, kv_idx]


def document_lengths(S: int) -> list[list[int]]:
    """DOCUMENTS contiguous documents per batch row, at seeded random cut points (each at least one token)."""
    generator = torch.Generator().manual_seed(SEED + S)
    rows = []
    for _ in range(BATCH):
        cuts = sorted((torch.randperm(S - 1, generator=generator)[: DOCUMENTS - 1] + 1).tolist())
        bounds = [0, *cuts, S]
        rows.append([end - start for start, end in zip(bounds, bounds[1:])])
    return rows


def segment_ids(lengths: list[list[int]], device: torch.device) -> torch.Tensor:
    """(B, S) int32 document numbers."""
    rows = [torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths]
    return torch.stack(rows).to(device=device, dtype=torch.int32)


@dataclass
class Modification:
    """One case's modification for ours and for flex; made before anything is timed."""

    ours: object  # a fusedattn ScoreMod
    flex: Callable[[], dict]  # -> flex_attention keywords (score_mod= or block_mask=)
    flex_form: str  # "score_mod" or "block_mask"
    fraction: float = 1.0  # share of the dense FLOPs counted for ours and flex
    plain_causal: bool = False  # cudnn_plain runs mask="causal"
    params: dict = field(default_factory=dict)


class Modifications:
    """Builds each case's Modification.

    Tensors that do not depend on S, and the flex functions over them, are made once: every
    row passes flex the same function object, so it compiles once per shape.
    """

    def __init__(self, device: torch.device, flex: bench_cudnn.Flex):
        import fusedattn

        self.device, self.flex = device, flex
        generator = torch.Generator(device=device).manual_seed(SEED)
        self.slopes = torch.tensor(fusedattn.standard_alibi_slopes(HEADS), dtype=torch.float32, device=device)
        self.table = torch.randn(HEADS, 2 * RELPOS_REACH + 1, generator=generator, dtype=DTYPE, device=device) * 0.5
        self.flex_score_mods = {"softcap": flex_softcap(SOFTCAP), "alibi": flex_alibi(self.slopes),
                                "relpos": flex_relpos(self.table, RELPOS_REACH)}

    def build(self, case: Case) -> Modification:
        from fusedattn import score_mods

        if case.mod.endswith("_flex"):  # the flex function itself: traced, derivative derived
            base = case.mod.removesuffix("_flex")
            return self._scored(base, self.flex_score_mods[base],
                                **({"relpos_reach": RELPOS_REACH} if base == "relpos" else {}))
        if case.mod == "softcap":
            return self._scored("softcap", score_mods.softcap(SOFTCAP))
        if case.mod == "alibi":
            return self._scored("alibi", score_mods.alibi(self.slopes))
        if case.mod == "relpos":
            return self._scored("relpos", score_mods.relative_position_bias(self.table), relpos_reach=RELPOS_REACH)
        if case.mod == "causal":
            return Modification(score_mods.causal(), lambda: {"block_mask": self.flex.block_mask(case.S, self.device)},
                                "block_mask", fraction=0.5, plain_causal=True)
        return self._document(case, score_mods)

    def _scored(self, mod: str, ours, **params) -> Modification:
        kwargs = {"score_mod": self.flex_score_mods[mod]}
        return Modification(ours, lambda: kwargs, "score_mod", params=params)

    def _document(self, case: Case, score_mods) -> Modification:
        lengths = document_lengths(case.S)
        ids = segment_ids(lengths, self.device)
        visible = sum(n * n for row in lengths for n in row) / (BATCH * case.S * case.S)

        def flex_kwargs():
            from torch.nn.attention.flex_attention import create_block_mask

            mask = create_block_mask(flex_document(ids), BATCH, None, case.S, case.S, device=str(self.device))
            return {"block_mask": mask}

        return Modification(score_mods.document_mask(ids), flex_kwargs, "block_mask", fraction=visible,
                            params={"documents": lengths, "visible_fraction": round(visible, 6)})


# --- implementations ---------------------------------------------------------------------------------------------

def ours(x: bench_cudnn.Inputs, score_mod, backend: str) -> common.Impl:
    import fusedattn.torch as fat

    call = partial(fat.attention, x.q, x.k, x.v, layout="bshd", mask="none", backend=backend, score_mod=score_mod)
    return common.Impl("ours", call, (x.q, x.k, x.v), x.grad_out)


def flex_compiled(flex: bench_cudnn.Flex, x: bench_cudnn.Inputs, kwargs: Callable[[], dict]) -> common.Impl:
    call = partial(flex.compiled(), x.qt, x.kt, x.vt, **kwargs())
    return common.Impl("flex_compiled", call, (x.qt, x.kt, x.vt), bench_cudnn._to_bshd(x.grad_out),
                       to_reference=bench_cudnn._to_bshd)


def cudnn_plain(case: Case, x: bench_cudnn.Inputs, causal: bool, backend: str) -> common.Impl:
    return dataclasses.replace(bench_cudnn.ours(case.dense(causal), x, False, backend), name="cudnn_plain")


# --- one row -----------------------------------------------------------------------------------------------------

def _measure(build: Callable[[], common.Impl], keep_outputs: bool, timing: dict):
    """common.measure of what build() makes; a failing build becomes the entry."""
    try:
        impl = build()
    except Exception as error:
        return common.error_entry(error), None
    return common.measure(impl, keep_outputs=keep_outputs, **timing)


def _record_diff(params: dict, suffix: str, ours_out: list, theirs: list, mode: str) -> None:
    try:
        params[f"max_abs_diff_{suffix}"] = common.max_abs_diff(ours_out[:1], theirs[:1])
        if mode == common.FWD_BWD:
            params[f"max_abs_grad_diff_{suffix}"] = common.max_abs_diff(ours_out[1:], theirs[1:])
    except Exception as error:
        params[f"max_abs_diff_{suffix}"] = common.error_entry(error)["error"]


def _row_params(case: Case, mode: str, mod: Modification, flops: float, warmup: int, repeats: int) -> dict:
    params = case.dense().params(mode)  # mask "none": ours always runs the modification as a score_mod
    name = getattr(mod.ours, "name", "flex function (traced)")
    params.update(score_mod=name, flex_form=mod.flex_form, **mod.params, flops=int(flops), warmup=warmup,
                  repeats=repeats, l2_flushed=False, ratio_peers=list(RATIO_PEERS),
                  max_abs_diff_vs_sdpa=None, max_abs_diff_ref=None)
    if mode == common.FWD:
        params["fwd_under_no_grad"] = False  # the training forward (inputs require grad)
    return params


def run_row(case: Case, mode: str, args, device: torch.device, mods: Modifications) -> dict:
    mod = mods.build(case)
    flops = case.dense().flops(mode) * mod.fraction
    plain_flops = case.dense(mod.plain_causal).flops(mode)
    warmup, repeats = bench_cudnn._sized(args, flops)
    params = _row_params(case, mode, mod, flops, warmup, repeats)
    timing = dict(mode=mode, warmup=warmup, repeats=repeats, device=device)
    x = bench_cudnn.make_inputs(case.dense(), device)

    entry, reference = _measure(partial(ours, x, mod.ours, args.ours_backend), True, timing)
    ours_entry = {"backend": args.ours_backend, **bench_cudnn._with_value(entry, flops)}
    peers = {}
    for name, build, peer_flops, suffix in (
            ("flex_compiled", partial(flex_compiled, mods.flex, x, mod.flex), flops, "vs_sdpa"),
            ("cudnn_plain", partial(cudnn_plain, case, x, mod.plain_causal, args.ours_backend), plain_flops,
             "vs_cudnn_plain")):
        entry, outputs = _measure(build, reference is not None, timing)
        peers[name] = bench_cudnn._with_value(entry, peer_flops)
        if outputs is not None:
            _record_diff(params, suffix, reference, outputs, mode)
            if name == "flex_compiled":
                params["max_abs_diff_ref"] = name
        del outputs
    del reference, x, mod
    common.release_memory(device)

    if "ms" in ours_entry and "ms" in peers["cudnn_plain"]:
        params["ours_ms_over_cudnn_plain"] = round(ours_entry["ms"] / peers["cudnn_plain"]["ms"], 4)
    ratio = common.best_peer_ratio(ours_entry, {name: peers[name] for name in RATIO_PEERS})
    return {"workload": f"{case.name}-{mode}", "params": params, "metric": "tflops", "ours": ours_entry,
            "peers": peers, "ratio_vs_best_peer": None if ratio is None else round(ratio, 4)}


# --- command line ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="bench_score_mod.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
               "  python bench/bench_score_mod.py --quick\n"
               "  python bench/bench_score_mod.py --mods softcap,document --modes fwd\n"
               "  python bench/bench_score_mod.py --seqlens 16384 --merge     # add rows to an existing file\n"
               "  python bench/bench_score_mod.py --device cpu --ours-backend reference --seqlens 256 "
               "--head-dims 64 --out /tmp/smoke.json   # smoke test")
    parser.add_argument("--quick", action="store_true", help="only S in {1024, 4096} and D = 128")
    parser.add_argument("--seqlens", type=bench_cudnn._int_list, default=None,
                        help="S, comma-separated (default 1024,4096,16384)")
    parser.add_argument("--head-dims", type=bench_cudnn._int_list, default=None,
                        help="D, comma-separated (default 64,128)")
    parser.add_argument("--mods", type=common.choice_list(MODS), default=list(MODS),
                        help=f"modifications, comma-separated (default all: {','.join(MODS)})")
    parser.add_argument("--modes", type=common.choice_list(common.MODES), default=list(common.MODES),
                        help=f"modes, comma-separated (default {','.join(common.MODES)})")
    common.add_run_arguments(parser, SUITE)
    parser.add_argument("--max-ms-per-entry", type=float, default=1000.0,
                        help="cap repeats/warm-up of big rows so an entry's timed calls take about this long "
                             "(estimated at 250 TFLOP/s; 0 = no cap; default 1000)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default); cpu only smoke-tests the script (no cuDNN, wall-clock timing)")
    parser.add_argument("--ours-backend", default=OURS_BACKEND,
                        help="fusedattn backend forced for ours and cudnn_plain (default cudnn; reference to "
                             "smoke-test on cpu); another one names the suite score_mod-ours-<backend>")
    return common.parse_suite_args(parser, argv, SUITE, OURS_BACKEND)


def main(argv=None) -> int:
    args = parse_args(argv)
    seqlens, head_dims = bench_cudnn.shape_grid(args)
    rows = [(case, mode) for case in make_cases(seqlens, head_dims, args.mods) for mode in args.modes
            if common.workload_matches(args.only, f"{case.name}-{mode}")]
    state = {}

    def run_one(case, mode, device):
        if "mods" not in state:  # compiles nothing until a row runs
            state["mods"] = Modifications(device, bench_cudnn.Flex())
        return run_row(case, mode, args, device, state["mods"])

    return common.run_suite(
        "bench_score_mod", args, rows, run_one, PEERS,
        harness_row=lambda case, mode, error: common.harness_error_row(
            f"{case.name}-{mode}", case.dense().params(mode), args.ours_backend, error),
        cpu_hint="or --device cpu --ours-backend reference to smoke-test the script")


if __name__ == "__main__":
    sys.exit(main())
