"""score_mod suite: fusedattn's cudnn backend with a score_mod against torch.compile'd FlexAttention doing the same.

ours           fusedattn.torch.attention(q, k, v, layout="bshd", mask="none", backend="cudnn", score_mod=<mod>)
               (the mask_mod rows pass mask_mod=<fn> too, or instead; softcap_jax runs fusedattn.jax, see below)
flex_compiled  torch.compile(flex_attention) on (B, H, S, D) views of the same inputs, in the form users run:
               a score_mod for softcap, alibi and relpos; a BlockMask from a mask_mod (built outside the timed
               region, so flex skips fully masked blocks) for causal and document, and for the mask_mod rows
               the BlockMask of the very function ours gets
cudnn_plain    the same cudnn call without score_mod (mask="causal" on the causal and window rows, "none" otherwise):
               what the modification costs; params.ours_ms_over_cudnn_plain = ours ms / its ms

Modifications, applied to the scaled scores (scale = 1/sqrt(D)):
  softcap   20 * tanh(s / 20)  (a cap low enough to change bf16 outputs)
  alibi     s - slope[h] * |q_idx - kv_idx| with fusedattn.standard_alibi_slopes(16), not causal
  relpos    s + table[h, clip(kv_idx - q_idx, -128, 128) + 128] for a (16, 257) bf16 table
  causal    keys after the query masked: ours score_mods.causal() (a flex-form built-in: runs as mask="causal")
  document  4 contiguous documents of seeded random lengths per batch row; queries see their own document only
  The built-ins (score_mods.softcap, alibi, relative_position_bias, causal, document_mask) are written in
  flex form themselves: traced, derivative derived.
  <mod>_flex  ours given FlexAttention's own function for softcap, alibi or relpos (traced by fusedattn, its
            derivative derived)
  softcap_native  the softcap as cuDNN graph callbacks with a hand-written derivative (examples/native_softcap.py,
            the expert path): what the traced forms are measured against
FlexAttention's mask_mod given to ours as it is (mask_mod=; fusedattn maps its conditions onto cuDNN's own masks,
so masked tiles are skipped; params.mask_mod_native records what it ran as):
  causal_flex          q_idx >= kv_idx (flex_causal)
  window_flex          (q_idx - kv_idx <= 256) & (q_idx >= kv_idx): causal sliding window of 256 keys back
  document_flex        doc[b, q_idx] == doc[b, kv_idx] over the document row's ids (flex_document; runs as THD)
  softcap_causal_flex  softcap_flex's score_mod and causal_flex's mask_mod together
softcap_jax  the softcap as one portable function, 20 * fusedattn.score_mods.tanh(s / 20), through
             fusedattn.jax.attention under jax.jit on the same arrays (shared with torch by DLPack); fwd is the jit
             of the forward, fwd+bwd the jit of jax.vjp's output and (dq, dk, dv) for the same output gradient.
             Timed by wall clock: median of 3 loops of `repeats` back-to-back calls, each loop ended by one
             jax.block_until_ready (CUDA events on torch's stream do not see JAX's). Flex and cudnn_plain as for
             softcap. No JAX: the row's ours is an error entry. JAX allocates on demand (no preallocation)

Workloads: B=4, H=16, bf16, S in {1024, 4096, 16384}, D in {64, 128}, modes fwd (the training forward:
inputs require grad) and fwd+bwd (plus torch.autograd.grad of (q, k, v) with a fixed output gradient).

FLOPs: 4*B*H*S*S*D forward, fwd+bwd = 3.5x forward, counted the same for ours and flex so ratios compare
times: halved for causal (attention_flops(causal=True)); for document scaled by the exact fraction of
visible (q, kv) pairs, sum over documents of length^2 / (B*S^2) (params.visible_fraction), for window_flex
by sum over rows i of (min(i, 256) + 1) / S^2. cudnn_plain's
TFLOP/s count the work of its own call (dense, or causal). ratio_vs_best_peer = flex_compiled ms / ours ms
(> 1: ours faster; cudnn_plain is a baseline, not a peer, so it is left out: params.ratio_peers).

Checks: max_abs_diff_vs_sdpa / max_abs_grad_diff_vs_sdpa hold max |ours - flex_compiled| over the output
and the gradients (the keys of bench_cudnn's rows; max_abs_diff_ref names the reference); the _vs_cudnn_plain
keys hold the same against the unmodified call, ~0 on causal_flex and causal rows and clearly > 0 on the others
(0 there would mean the modification was ignored).

Host time (torch rows at S <= 1024): ours' and cudnn_plain's host_us, the host's enqueue time per call with
the GPU held by a spin kernel (common.interleaved_host_us: median of --host-rounds interleaved rounds of 60
calls, every thread on one core: common.one_core), and params.host_extra_us, what the modification adds to
the host's work: the median over rounds of ours' minus cudnn_plain's of the same round (common.paired_median;
a slow spell of the host touches a round's two turns alike, so it cancels, where two medians would keep it).

Timing, sizing of big rows and error entries as in bench_cudnn. The JSON (bench/results/score_mod.json by
default) is rewritten after every row.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from native_softcap import native_softcap  # noqa: E402 (the expert path's softcap, beside the traced ones)

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
# "<x>_flex" mask_mod rows (MASK_MODS): ours runs FlexAttention's mask_mod, flex the BlockMask of that same function.
MASK_MODS = ("causal_flex", "window_flex", "document_flex", "softcap_causal_flex")
MODS = ("softcap", "alibi", "relpos", "causal", "document", "softcap_flex", "alibi_flex", "relpos_flex",
        *MASK_MODS, "softcap_jax", "softcap_native")
PEERS = ("flex_compiled", "cudnn_plain")
RATIO_PEERS = ("flex_compiled",)  # the ratio compares implementations of the modification only
SOFTCAP = 20.0
RELPOS_REACH = 128  # M: the table has 2M + 1 columns
DOCUMENTS = 4  # per batch row
SEED = bench_cudnn.SEED
WINDOW = 256  # window_flex: keys back from the query (causal)
JAX_LOOPS = 3  # softcap_jax: timed loops of `repeats` calls, median taken
HOST_TIME_MAX_S = 1024  # rows at this S or below also time the host's enqueue per call, ours and cudnn_plain
HOST_CALLS = 60  # calls per host-time loop

# softcap_jax runs JAX beside torch on one GPU: JAX takes memory as it needs it, not a preallocated pool.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


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
    def same_document(b, h, q_idx, kv_idx):  # named: the rows record mask_mods by __name__
        return segment_ids[b, q_idx] == segment_ids[b, kv_idx]
    return same_document


def flex_causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def flex_window(window: int):
    def sliding_window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)
    return sliding_window


def portable_softcap(cap: float):
    """The softcap once for torch and JAX alike: fusedattn's portable tanh dispatches on its argument."""
    from fusedattn import score_mods

    return lambda score, b, h, q_idx, kv_idx: cap * score_mods.tanh(score / cap)


def window_fraction(S: int, window: int) -> float:
    """Visible share of the (q, kv) pairs under a causal window: query i sees min(i, window) + 1 keys."""
    return sum(min(i, window) + 1 for i in range(S)) / (S * S)


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

    ours: object  # a fusedattn ScoreMod or a flex-style score_mod; None on mask_mod-only rows
    flex: Callable[[], dict]  # -> flex_attention keywords (score_mod= and/or block_mask=)
    flex_form: str  # "score_mod", "block_mask" or "score_mod+block_mask"
    fraction: float = 1.0  # share of the dense FLOPs counted for ours and flex
    plain_causal: bool = False  # cudnn_plain runs mask="causal"
    ours_mask: Callable | None = None  # a flex-style mask_mod for ours (fusedattn maps it onto cuDNN's masks)
    framework: str = "torch"  # "jax": ours runs through fusedattn.jax under jax.jit (ours_jax)
    params: dict = field(default_factory=dict)


class Modifications:
    """Builds each case's Modification.

    Tensors that do not depend on S, and the flex functions over them, are made once: every
    row passes flex the same function object, so it compiles once per shape. The document ids,
    their mask_mod and the BlockMasks are made once per S, shared by the rows that use them.
    """

    def __init__(self, device: torch.device, flex: bench_cudnn.Flex):
        import fusedattn

        self.device, self.flex = device, flex
        generator = torch.Generator(device=device).manual_seed(SEED)
        self.slopes = torch.tensor(fusedattn.standard_alibi_slopes(HEADS), dtype=torch.float32, device=device)
        self.table = torch.randn(HEADS, 2 * RELPOS_REACH + 1, generator=generator, dtype=DTYPE, device=device) * 0.5
        self.flex_score_mods = {"softcap": flex_softcap(SOFTCAP), "alibi": flex_alibi(self.slopes),
                                "relpos": flex_relpos(self.table, RELPOS_REACH)}
        self.window_mask = flex_window(WINDOW)
        self.portable_softcap = portable_softcap(SOFTCAP)
        self._block_masks, self._documents = {}, {}

    def build(self, case: Case) -> Modification:
        from fusedattn import score_mods

        if case.mod in MASK_MODS:
            return self._mask_mod(case)
        if case.mod == "softcap_jax":
            return self._scored("softcap", self.portable_softcap, framework="jax",
                                ours_call="fusedattn.jax.attention under jax.jit (arrays shared by DLPack)",
                                ours_timing=f"wall clock: median of {JAX_LOOPS} loops of `repeats` back-to-back "
                                            "calls, each ended by jax.block_until_ready")
        if case.mod.endswith("_flex"):  # the flex function itself: traced, derivative derived
            base = case.mod.removesuffix("_flex")
            return self._scored(base, self.flex_score_mods[base],
                                **({"relpos_reach": RELPOS_REACH} if base == "relpos" else {}))
        if case.mod == "softcap":
            return self._scored("softcap", score_mods.softcap(SOFTCAP))
        if case.mod == "softcap_native":
            return self._scored("softcap", native_softcap(SOFTCAP))
        if case.mod == "alibi":
            return self._scored("alibi", score_mods.alibi(self.slopes))
        if case.mod == "relpos":
            return self._scored("relpos", score_mods.relative_position_bias(self.table), relpos_reach=RELPOS_REACH)
        if case.mod == "causal":
            return Modification(score_mods.causal(), lambda: {"block_mask": self.flex.block_mask(case.S, self.device)},
                                "block_mask", fraction=0.5, plain_causal=True)
        return self._document(case, score_mods)

    def _scored(self, mod: str, ours, framework: str = "torch", **params) -> Modification:
        kwargs = {"score_mod": self.flex_score_mods[mod]}
        return Modification(ours, lambda: kwargs, "score_mod", framework=framework, params=params)

    def _mask_mod(self, case: Case) -> Modification:
        """The MASK_MODS rows: ours gets FlexAttention's mask_mod (and score_mod) as they are."""
        if case.mod == "window_flex":
            visible = window_fraction(case.S, WINDOW)
            return self._masked(case, self.window_mask, fraction=visible, plain_causal=True,
                                params={"window": WINDOW, "visible_fraction": round(visible, 6)})
        if case.mod == "document_flex":
            _, mask_mod, fields = self._document_mask(case.S)
            return self._masked(case, mask_mod, BATCH, **fields)
        score_mod = self.flex_score_mods["softcap"] if case.mod == "softcap_causal_flex" else None
        return self._masked(case, flex_causal, score_mod=score_mod, fraction=0.5, plain_causal=True)

    def _masked(self, case: Case, mask_mod, batch: int | None = None, *, score_mod=None, builtin=None,
                **fields) -> Modification:
        """Flex: the BlockMask of mask_mod (plus score_mod). Ours: the same mask_mod and score_mod, or the
        built-in ScoreMod given as builtin in their place."""
        def flex_kwargs():  # made when flex's Impl is: outside the timed region, a failure is flex's entry
            kwargs = {"block_mask": self._block_mask(mask_mod, case.S, batch)}
            return kwargs if score_mod is None else {**kwargs, "score_mod": score_mod}

        form = "block_mask" if score_mod is None else "score_mod+block_mask"
        if builtin is not None:
            return Modification(builtin, flex_kwargs, form, **fields)
        return Modification(score_mod, flex_kwargs, form, ours_mask=mask_mod, **fields)

    def _block_mask(self, mask_mod, S: int, batch: int | None):
        """create_block_mask of mask_mod at S, made once (mask_mod is the key, so it must live as long)."""
        key = (mask_mod, S, batch)
        if key not in self._block_masks:
            from torch.nn.attention.flex_attention import create_block_mask

            self._block_masks[key] = create_block_mask(mask_mod, batch, None, S, S, device=str(self.device))
        return self._block_masks[key]

    def _document_mask(self, S: int) -> tuple[torch.Tensor, Callable, dict]:
        """(ids, flex_document over them, the rows' fraction= and params=) for S, made once per S: both
        document rows get the same ids and mask_mod object."""
        if S not in self._documents:
            lengths = document_lengths(S)
            ids = segment_ids(lengths, self.device)
            visible = sum(n * n for row in lengths for n in row) / (BATCH * S * S)
            self._documents[S] = (ids, flex_document(ids), {
                "fraction": visible, "params": {"documents": lengths, "visible_fraction": round(visible, 6)}})
        return self._documents[S]

    def _document(self, case: Case, score_mods) -> Modification:
        ids, mask_mod, fields = self._document_mask(case.S)
        return self._masked(case, mask_mod, BATCH, builtin=score_mods.document_mask(ids), **fields)


# --- implementations ---------------------------------------------------------------------------------------------

def ours(x: bench_cudnn.Inputs, mod: Modification, backend: str) -> common.Impl:
    import fusedattn.torch as fat

    mask_mod = {} if mod.ours_mask is None else {"mask_mod": mod.ours_mask}
    call = partial(fat.attention, x.q, x.k, x.v, layout="bshd", mask="none", backend=backend, score_mod=mod.ours,
                   **mask_mod)
    return common.Impl("ours", call, (x.q, x.k, x.v), x.grad_out)


def _bench_jax():
    """bench_jax (which imports jax), imported when a JAX row runs: without JAX only that row fails."""
    import jax  # noqa: F401  (first, so a missing JAX is what the error entry names)

    try:
        from . import bench_jax
    except ImportError:
        import bench_jax
    return bench_jax


def ours_jax(x: bench_cudnn.Inputs, score_mod, backend: str, *, mode: str, warmup: int, repeats: int,
             device: torch.device) -> tuple[dict, list[torch.Tensor] | None]:
    """common.measure's (entry, outputs) for fusedattn.jax.attention under jax.jit on x's arrays.

    Wall-clock timed (bench_jax.timed_ms): CUDA events on torch's stream would not wait for JAX's.
    Never raises: a failure (JAX missing included) becomes the entry.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            bench_jax = _bench_jax()  # first: without JAX, the entry says so
            jax = bench_jax.jax

            import fusedattn.jax as faj

            if device.type == "cuda":
                torch.cuda.synchronize(device)  # x is made on torch's stream; JAX reads it on its own
            leaves = (x.q, x.k, x.v, x.grad_out) if mode == common.FWD_BWD else (x.q, x.k, x.v)
            inputs = [jax.dlpack.from_dlpack(t.detach()) for t in leaves]
            attention = partial(faj.attention, layout="bshd", mask="none", backend=backend, score_mod=score_mod)
            step = bench_jax.jitted(attention, mode)
            outputs = jax.block_until_ready(step(*inputs))  # compiles; (out,) or (out, dq, dk, dv)
            for _ in range(warmup):
                jax.block_until_ready(step(*inputs))
            ms = bench_jax.timed_ms(step, inputs, JAX_LOOPS, repeats)
            return {"ms": ms}, [torch.from_dlpack(t) for t in outputs]
        except Exception as error:  # as common.measure: any failure of ours becomes its entry
            return common.error_entry(error, caught), None


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


def _record_host_time(params: dict, ours_entry: dict, plain_entry: dict, impls: dict, **timing) -> None:
    """host_us on ours' and cudnn_plain's entries (the host's enqueue time per call, the GPU held) and
    params.host_extra_us: what the modification adds to the host's work per call."""
    rounds = common.interleaved_host_us(impls, calls=HOST_CALLS, **timing)
    host = common.medians(rounds)
    for name, entry in (("ours", ours_entry), ("cudnn_plain", plain_entry)):
        if name in host:
            entry["host_us"] = round(host[name], 2)
    extra = common.paired_median(rounds, "ours", "cudnn_plain")
    if extra is not None:
        params["host_extra_us"] = round(extra, 2)


def native_masks(mask_mod, S: int, device: torch.device, document_ok: bool) -> dict | str:
    """What fusedattn.torch runs mask_mod as at (BATCH, S, S): cuDNN's own masks (tiles skipped), documents as
    THD, and how many conditions stay selects in the score_mod graph; the error text if it cannot say."""
    try:
        from fusedattn.score_mods.flex import trace_mask
        from fusedattn.score_mods.mask_rewrite import native_mask

        chosen = native_mask(mask_mod, trace_mask("torch", mask_mod, device), BATCH, S, S, document_ok)
    except Exception as error:
        return common.error_entry(error)["error"]
    return {"mask": chosen.mask, "window": chosen.window, "padding": bool(chosen.lengths),
            "document_as_thd": chosen.document is not None, "conditions_in_graph": len(chosen.kept)}


def _row_params(case: Case, mode: str, mod: Modification, flops: float, warmup: int, repeats: int,
                device: torch.device) -> dict:
    params = case.dense().params(mode)  # mask "none": ours runs the modification as a score_mod and/or mask_mod
    name = None if mod.ours is None else getattr(mod.ours, "name", "flex function (traced)")
    params.update(score_mod=name, flex_form=mod.flex_form, **mod.params, flops=int(flops), warmup=warmup,
                  repeats=repeats, l2_flushed=False, ratio_peers=list(RATIO_PEERS),
                  max_abs_diff_vs_sdpa=None, max_abs_diff_ref=None)
    if mod.ours_mask is not None:
        params["mask_mod"] = f"flex function {mod.ours_mask.__name__} (traced)"
        params["mask_mod_native"] = native_masks(mod.ours_mask, case.S, device, document_ok=mod.ours is None)
    if mode == common.FWD:
        # the training forward (inputs require grad); JAX has none: its fwd is the jit of the forward alone
        params["fwd_under_no_grad"] = False if mod.framework == "torch" else None
    return params


def run_row(case: Case, mode: str, args, device: torch.device, mods: Modifications) -> dict:
    mod = mods.build(case)
    flops = case.dense().flops(mode) * mod.fraction
    plain_flops = case.dense(mod.plain_causal).flops(mode)
    warmup, repeats = bench_cudnn._sized(args, flops)
    params = _row_params(case, mode, mod, flops, warmup, repeats, device)
    timing = dict(mode=mode, warmup=warmup, repeats=repeats, device=device)
    x = bench_cudnn.make_inputs(case.dense(), device)

    if mod.framework == "jax":
        entry, reference = ours_jax(x, mod.ours, args.ours_backend, **timing)
    else:
        entry, reference = _measure(partial(ours, x, mod, args.ours_backend), True, timing)
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
    if "ms" in ours_entry and "ms" in peers["cudnn_plain"]:
        params["ours_ms_over_cudnn_plain"] = round(ours_entry["ms"] / peers["cudnn_plain"]["ms"], 4)
        if mod.framework == "torch" and case.S <= HOST_TIME_MAX_S and args.host_rounds > 0:
            _record_host_time(params, ours_entry, peers["cudnn_plain"], {
                "ours": ours(x, mod, args.ours_backend),
                "cudnn_plain": cudnn_plain(case, x, mod.plain_causal, args.ours_backend)},
                mode=mode, rounds=args.host_rounds, device=device)
    del reference, x, mod
    common.release_memory(device)
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
               "  python bench/bench_score_mod.py --mods causal_flex,window_flex,document_flex,softcap_causal_flex,"
               "softcap_jax --merge\n"
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
    parser.add_argument("--host-rounds", type=int, default=21,
                        help=f"rows at S <= {HOST_TIME_MAX_S} (torch): interleaved rounds of {HOST_CALLS} calls "
                             "timing the host's enqueue per call of ours and cudnn_plain with the GPU held "
                             "(host_us, params.host_extra_us; 0 = none; default 21)")
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
