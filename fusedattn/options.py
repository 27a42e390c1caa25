"""The keywords of `attention`, written once.

Everything that names them derives from OPTIONS: both frontends' signatures, their check of unknown
keywords and their docstrings' argument lists; the settings a call hands to the config (and hashes
into its plan-cache signature); the compiled path; the nn and Flax modules' pass-through. A new
option is a row here, a field of the config, and code in the backends that run it.
"""

from __future__ import annotations

import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

__all__ = ["Option", "OPTIONS", "TENSORS", "SETTINGS", "SCORE_MOD_NAMES", "DROPOUT_NAMES", "names", "settings",
           "check_keywords", "signature", "document", "describe_arguments"]

# Groups: what a frontend does with an option.
TENSOR = "tensor"        # an array beside q, k, v (described, validated, handed to the backend)
SETTING = "setting"      # a plain value that fixes the config (and the call's plan-cache signature)
SELECTION = "selection"  # which backend runs the call
DROPOUT = "dropout"      # the state a dropout mask is drawn from (runtime values, never in the config)
SCORE_MOD = "score_mod"  # the score_mod callbacks and their tensors
PACKING = "packing"      # JAX only: sequences as segment ids, and how inputs are sharded

BOTH, JAX = ("torch", "jax"), ("jax",)


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    group: str
    doc: str  # "{array}" reads "tensor" for torch, "array" for JAX; "{framework}" torch or jax.numpy
    frameworks: tuple[str, ...] = BOTH


OPTIONS: tuple[Option, ...] = (
    Option("layout", "bshd", SETTING,
           "one of bshd, sbhd, bhsd, thd, bs3hd, sb3hd, t3hd, bshd_bs2hd, sbhd_sb2hd, thd_t2hd. Packed layouts "
           "take fewer {array}s: bs3hd/sb3hd/t3hd one qkv {array} as q; bshd_bs2hd/sbhd_sb2hd/thd_t2hd q and a "
           "packed kv as k. Shapes: bshd (B, S, H, D), sbhd (S, B, H, D), bhsd (B, H, S, D), thd (T, H, D) with "
           "T packed tokens; k and v may have fewer heads (GQA/MQA) and v its own head dim Dv."),
    Option("mask", "none", SETTING,
           "none, causal (top-left diagonal), causal_bottom_right, padding, padding_causal, "
           "padding_causal_bottom_right. Padding masks take per-sequence lengths from cu_seqlens_q/kv; THD "
           "layouts always mask padding ('causal' means 'padding_causal')."),
    Option("window", None, SETTING,
           "(left, right) keys visible before/after the diagonal, -1 = unbounded. The diagonal is top-left "
           "for causal and padding_causal, bottom-right otherwise."),
    Option("bias", None, TENSOR,
           "{array} broadcastable to (B|1, Hq|1, Sq|1, Skv|1) (lower ranks align right), added after scaling "
           "(bias_type 'post_scale', the default) or before ('pre_scale'); has a gradient. Of q's dtype."),
    Option("bias_type", None, SETTING, "'post_scale' (default with a bias) or 'pre_scale'."),
    Option("alibi_slopes", None, TENSOR,
           "(Hq,) or (B, Hq) ALiBi slopes: adds -slope * |i - j| (diagonal-aligned); an {array}, or a "
           "list/tuple/NumPy array such as fusedattn.standard_alibi_slopes(Hq)."),
    Option("softmax_type", "vanilla", SETTING,
           "'vanilla', 'off_by_one' (an extra zero logit in the denominator) or 'learnable' (per-head `sink` "
           "logits)."),
    Option("sink", None, TENSOR, "(Hq,) sink logits for softmax_type 'learnable'; has a gradient."),
    Option("dropout_p", 0.0, SETTING, "probability of dropping an attention weight."),
    Option("dropout_rng", None, DROPOUT,
           "a jax.random key the dropout mask is drawn from (or give dropout_seed/dropout_offset).", JAX),
    Option("dropout_seed", None, DROPOUT,
           "with dropout_offset, what the dropout mask is drawn from: the same pair gives the same mask in "
           "forward and backward. An int or a one-element integer {array}. torch draws a missing seed from "
           "its global generator."),
    Option("dropout_offset", 0, DROPOUT, "see dropout_seed."),
    Option("scale", None, SETTING, "multiplies q k^T; default 1/sqrt(D)."),
    Option("cu_seqlens_q", None, TENSOR,
           "(B+1,) int32/int64 cumulative sequence lengths of the queries (THD layouts and padding masks). "
           "Their values are checked (one host read) unless they cannot be read (traced, compiled) or are on "
           "the GPU with both max_seqlen_q and max_seqlen_kv given: then they are checked on the device, and a "
           "broken one gives NaN results."),
    Option("cu_seqlens_kv", None, TENSOR, "the same for keys and values."),
    Option("cu_seqlens_q_padded", None, TENSOR,
           "(B+1,) start offsets of each query sequence in the packed {array} when sequences are stored with "
           "gaps (THD only)."),
    Option("cu_seqlens_kv_padded", None, TENSOR, "the same for keys and values."),
    Option("max_seqlen_q", None, SETTING,
           "longest query sequence (THD); computed from cu_seqlens_q when omitted and readable."),
    Option("max_seqlen_kv", None, SETTING, "the same for keys and values."),
    Option("deterministic", False, SETTING, "ask for a bitwise-reproducible backward."),
    Option("return_lse", False, SETTING,
           "return an AttentionResult(out, lse, max_logit) holding the log-sum-exp of the scaled scores "
           "(float32; float64 for float64 inputs), (B, Hq, Sq) or (Tq, Hq) for THD; it unpacks as "
           "`out, lse, max_logit`."),
    Option("return_max_logit", False, SETTING,
           "return an AttentionResult holding the largest visible score per head, (Hq,) in the LSE's dtype."),
    Option("backend", None, SELECTION,
           "force one backend by name; its reasons raise if it cannot run the call."),
    Option("score_mod", None, SCORE_MOD,
           "rewrites the scaled scores inside the kernel: score_mod(score, b, h, q_idx, kv_idx) -> score "
           "written in {framework} (as for FlexAttention; traced once, its derivative derived), a built-in "
           "from fusedattn.score_mods (softcap, alibi, ...), or a cuDNN-native callback score_mod(graph, "
           "score, tensors) -> tensor that builds cuDNN graph ops on score (B, Hq, Sq, Skv). It runs before a "
           "post-scale bias and ALiBi are added and before the masks. Masked scores (-inf, or "
           "score_mods.MASKED) get no weight; a row with no visible key gives 0."),
    Option("score_mod_bprop", None, SCORE_MOD,
           "callback (graph, dscore, tensors) -> tensor: the derivative of score_mod applied to dLoss/d(its "
           "output). Omit it only when score_mod adds terms or masks (derivative 1)."),
    Option("score_mod_tensors", None, SCORE_MOD,
           "{{name: {array} | number}} for the callbacks (one dict for both). {array}s broadcast to (B, Hq, Sq, "
           "Skv) and live on q's device; numbers are passed by value, so changing one never rebuilds a graph."),
    Option("score_mod_bprop_tensors", None, SCORE_MOD, "more values for score_mod_bprop, as score_mod_tensors."),
    Option("mask_mod", None, SCORE_MOD,
           "mask_mod(b, h, q_idx, kv_idx) -> bool written in {framework} (as for FlexAttention): keys where it "
           "is False are masked; combined with a flex-style score_mod, which runs first."),
    Option("segment_ids_q", None, PACKING,
           "THD sequences as (T,) non-decreasing ids in [0, num_sequences) instead of cu_seqlens (larger ids "
           "mark trailing padding), with a static num_sequences.", JAX),
    Option("segment_ids_kv", None, PACKING, "the same for keys and values.", JAX),
    Option("num_sequences", None, PACKING, "the number of sequences segment ids describe (a static int).", JAX),
    Option("shard_axes", None, PACKING,
           "{{'batch': mesh axis, 'heads': mesh axis}}: how inputs are sharded when it cannot be read from "
           "them (jit with in_shardings); see Sharding above.", JAX),
)

_BY_NAME = {option.name: option for option in OPTIONS}


def _of(group: str) -> tuple[str, ...]:
    return tuple(option.name for option in OPTIONS if option.group == group)


TENSORS = _of(TENSOR)  # in the order backends receive them (AttentionInputs)
SETTINGS = _of(SETTING)
SCORE_MOD_NAMES = _of(SCORE_MOD)
DROPOUT_NAMES = _of(DROPOUT)
_NAMES = {framework: frozenset(o.name for o in OPTIONS if framework in o.frameworks) for framework in BOTH}
_SETTING_DEFAULTS = {name: _BY_NAME[name].default for name in SETTINGS}


def names(framework: str) -> frozenset[str]:
    """Every keyword `attention` takes in that framework."""
    return _NAMES[framework]


def settings(options: dict) -> dict:
    """The call's settings (given or default): what the config is built from, besides tensors."""
    return {name: options.get(name, default) for name, default in _SETTING_DEFAULTS.items()}


# Keywords of the calls users come from, and where they belong here.
_ELSEWHERE = {
    "is_causal": "mask='causal' (or the drop-in scaled_dot_product_attention / dot_product_attention, which take "
                 "is_causal)",
    "attn_mask": "bias= for an additive mask, mask= for causal/padding (or the drop-in "
                 "scaled_dot_product_attention, which takes attn_mask)",
    "enable_gqa": "nothing: k and v may simply have fewer heads",
    "dropout": "dropout_p=",
    "softmax_scale": "scale=",
    "causal": "mask='causal'",
    "window_size": "window=",
    "local_window_size": "window= (or the drop-in dot_product_attention, which takes local_window_size)",
    "implementation": "backend=",
}


def check_keywords(api: str, given, framework: str) -> None:
    """TypeError for keywords `attention` does not take in `framework`, naming the closest and the accepted."""
    unknown = [name for name in given if name not in _NAMES[framework]]
    if not unknown:
        return
    name = unknown[0]
    accepted = [o.name for o in OPTIONS if framework in o.frameworks]
    if name in _ELSEWHERE:
        hint = f"; use {_ELSEWHERE[name]}"
    elif name in _NAMES["jax" if framework == "torch" else "torch"]:
        hint = f"; {name} is for the {'JAX' if framework == 'torch' else 'torch'} frontend only"
    else:
        close = _closest(name, accepted)
        hint = f"; did you mean {close!r}?" if close else ""
    raise TypeError(f"{api}() got an unexpected keyword argument {name!r}{hint}. Its keywords: "
                    f"{', '.join(accepted)}")


def _closest(name: str, accepted: list) -> str | None:
    """The accepted name nearest `name` by edits (insert, delete, replace a letter), if at most half of
    the longer name's letters differ. (Plain loops, no difflib: torch.compile traces this in a compiled
    call, where difflib fails its trace and the user saw Dynamo's error instead of ours.)"""
    best, best_edits = None, None
    for candidate in accepted:
        row = list(range(len(candidate) + 1))
        for i, letter in enumerate(name, 1):
            diagonal, row[0] = row[0], i
            for j, other in enumerate(candidate, 1):
                diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (letter != other))
        if best_edits is None or row[-1] < best_edits:
            best, best_edits = candidate, row[-1]
    return best if best_edits is not None and 2 * best_edits <= max(len(name), len(best)) else None


def signature(framework: str, required: tuple[str, ...] = ("q",), optional: tuple[str, ...] = ("k", "v"),
              exclude: tuple[str, ...] = (), overrides: dict | None = None) -> inspect.Signature:
    """The signature `inspect` and `help` show for a function taking `required` and then `optional`
    (default None) positionally, and then the options as keywords (`overrides`: other defaults)."""
    overrides = overrides or {}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    positional = [inspect.Parameter(name, kind) for name in required]
    positional += [inspect.Parameter(name, kind, default=None) for name in optional]
    keywords = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=overrides.get(o.name, o.default))
                for o in OPTIONS if framework in o.frameworks and o.name not in exclude]
    return inspect.Signature(positional + keywords)


def document(framework: str, exclude: tuple[str, ...] = (), indent: str = "        ") -> str:
    """The options' part of a docstring's Args section."""
    array = "tensor" if framework == "torch" else "array"
    written_in = "torch" if framework == "torch" else "jax.numpy"
    lines = []
    for option in OPTIONS:
        if framework in option.frameworks and option.name not in exclude:
            text = f"{option.name}: {option.doc.format(array=array, framework=written_in)}"
            lines.append(textwrap.fill(text, 110, initial_indent=indent, subsequent_indent=indent + "    "))
    return "\n".join(lines)


def describe_arguments(function, framework: str, required: tuple[str, ...] = ("q",),
                       optional: tuple[str, ...] = ("k", "v"), exclude: tuple[str, ...] = (),
                       overrides: dict | None = None):
    """Give `function` (which takes **options) the signature and the documented keywords of the table:
    its docstring's "{options}" becomes their argument list."""
    function.__signature__ = signature(framework, required, optional, exclude, overrides)
    if function.__doc__ and "{options}" in function.__doc__:
        function.__doc__ = function.__doc__.replace("{options}", document(framework, exclude).lstrip())
    return function
