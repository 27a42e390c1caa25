"""What the cuDNN graphs of a config look like, as plain data (no cudnn import).

Keeping the description separate from the cudnn calls lets CPU tests check the
mapping from our vocabulary (layouts, windows, alignment, bias) to cuDNN's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fusedattn.config import UNBOUNDED, AttentionConfig, BiasType, Layout, Mask, SoftmaxType
from fusedattn.layout import contiguous_strides
from fusedattn.score_mods.core import EAGER_ONLY_KEY

MAX_BATCH = 65535  # one grid dimension per sequence in cuDNN 9.19's attention kernels
ALIGNMENT = 16  # bytes: cuDNN refuses to launch with an operand whose address is not a multiple

__all__ = ["ALIGNMENT", "TensorSpec", "dense", "SdpaSpec", "sdpa_spec", "unsupported", "layout_strides",
           "gradient_spec", "short_reason", "graph_key", "rows_without_keys", "rows_with_keys_config"]


@dataclass(frozen=True)
class TensorSpec:
    """A graph tensor in cuDNN's (B, H, S, D) dim order with the strides of its memory."""

    dim: tuple[int, ...]
    stride: tuple[int, ...]


def dense(dim: tuple[int, ...]) -> TensorSpec:
    """A contiguous tensor of these dims."""
    return TensorSpec(tuple(dim), contiguous_strides(dim))


# For each base layout: the memory order of (B, H, S, D) as the permutation that takes
# the memory shape to BHSD.
_MEMORY = {Layout.BSHD: "BSHD", Layout.SBHD: "SBHD", Layout.BHSD: "BHSD"}
_RAGGED_AS_PADDED = {"thd": "bshd", "t3hd": "bs3hd", "thd_t2hd": "bshd_bs2hd"}


def layout_strides(cfg: AttentionConfig, role: str) -> TensorSpec:
    """Dims (B, H, S, D) and strides of q/k/v/o as a contiguous tensor of cfg's layout would have them,
    or as the call's views have them (cfg.strides) where cuDNN reads those in place.

    Packed layouts interleave q, k, v (or k, v) along their packing axis, so each slice
    strides over the whole pack.
    """
    heads = cfg.heads_q if role in ("q", "o") else cfg.heads_kv
    seqlen = cfg.seqlen_q if role in ("q", "o") else cfg.seqlen_kv
    head_dim = cfg.head_dim_v if role in ("v", "o") else cfg.head_dim_qk
    sizes = {"B": cfg.batch, "S": seqlen, "H": heads, "D": head_dim}
    # A THD tensor is a BSHD tensor whose sequences start at ragged offsets.
    name = _RAGGED_AS_PADDED.get(cfg.layout.value, cfg.layout.value)
    packed_qkv = name in ("bs3hd", "sb3hd")
    packed_kv = name in ("bshd_bs2hd", "sbhd_sb2hd") and role in ("k", "v")
    base = "BSHD" if name.startswith("bs") else "SBHD" if name.startswith("sb") else _MEMORY[cfg.layout]
    view = cfg.strides["qkv".index(role)] if role != "o" and cfg.strides is not None else None
    if view is not None and _reads_in_place(view):
        strides = dict(zip(base, view))
    elif role != "o" and (packed_qkv or packed_kv):
        count = 3 if packed_qkv else 2
        memory = base[:2] + "P" + base[2:]  # e.g. B S P H D with P the pack of 3 or 2
        shape = tuple(count if a == "P" else sizes[a] for a in memory)
        strides = dict(zip(memory, contiguous_strides(shape)))
    else:
        strides = dict(zip(base, contiguous_strides(tuple(sizes[a] for a in base))))
    return TensorSpec(tuple(sizes[a] for a in "BHSD"), tuple(strides[a] for a in "BHSD"))


def _reads_in_place(strides: tuple[int, ...]) -> bool:
    """Whether cuDNN reads a view with these strides (in its layout's axis order, head dim last) where
    it lies: elements of a head contiguous, every other stride 16-byte aligned (8 elements of 16 bits).
    Other views are copied into the contiguous layout before each launch."""
    return strides[-1] == 1 and all(stride % 8 == 0 for stride in strides[:-1])


def gradient_spec(spec: TensorSpec) -> TensorSpec:
    """A dense tensor with spec's axis order: gradients of packed inputs are not packed."""
    order = sorted(range(len(spec.dim)), key=lambda axis: -spec.stride[axis])  # outermost first
    strides, step = [0] * len(spec.dim), 1
    for axis in reversed(order):
        strides[axis] = step
        step *= max(spec.dim[axis], 1)
    return TensorSpec(spec.dim, tuple(strides))


@dataclass(frozen=True)
class SdpaSpec:
    """The sdpa / sdpa_backward attributes for a config, in cuDNN's terms."""

    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    o: TensorSpec
    stats: TensorSpec
    bias: TensorSpec | None
    top_left: bool
    right_bound: int | None  # diagonal_band_right_bound: keys j <= i + R stay
    left_bound: int | None  # diagonal_band_left_bound: keys j <= i - L are masked
    sink: bool
    dropout: bool
    max_logit: bool
    alibi: bool
    padding: bool  # per-sequence lengths (seq_len_q/kv tensors)
    ragged: bool  # THD: q/k/v/o/stats start each sequence at a ragged offset
    score_mod: bool = False  # a score_mod callback; masks are then written inside it
    # The forward writes the LSE ("stats"): for a backward, a caller that asked for it, or the
    # empty-row fix of score_mod calls. Inference without it lets cuDNN pick its inference kernels.
    stats_output: bool = True

    def token_stride(self, role: str) -> int:
        """Elements between consecutive tokens of one sequence: the ragged offset's unit."""
        return getattr(self, role).stride[2]


def sdpa_spec(cfg: AttentionConfig) -> SdpaSpec:
    """cuDNN's description of a call."""
    left, right = cfg.window
    # With Sq == Skv both diagonals coincide; top-left is the form cuDNN supports most widely.
    top_left = not cfg.diagonal_bottom_right or (cfg.seqlen_q == cfg.seqlen_kv and not cfg.mask.is_padding)
    bias = None
    if cfg.bias in (BiasType.PRE_SCALE, BiasType.POST_SCALE):
        b, h, sq, skv = cfg.bias_shape
        full = (b, h, cfg.seqlen_q, cfg.seqlen_kv)
        strides = contiguous_strides((b, h, sq, skv))
        # Broadcast sequence axes read the same element again: stride 0.
        stride = tuple(0 if size == 1 and want > 1 else s for size, want, s in zip((b, h, sq, skv), full, strides))
        bias = TensorSpec(full, stride)
    stats_dim = (cfg.batch, cfg.heads_q, cfg.seqlen_q, 1)
    ragged = cfg.layout.is_ragged
    if ragged:  # token-major (T, Hq) like the LSE this library returns for THD
        stats = TensorSpec(stats_dim, (cfg.seqlen_q * cfg.heads_q, 1, cfg.heads_q, 1))
    else:
        stats = dense(stats_dim)
    return SdpaSpec(
        q=layout_strides(cfg, "q"), k=layout_strides(cfg, "k"), v=layout_strides(cfg, "v"),
        o=layout_strides(cfg, "o"), stats=stats, bias=bias,
        top_left=top_left,
        right_bound=None if right == UNBOUNDED else right,
        left_bound=None if left == UNBOUNDED else left + 1,
        sink=cfg.softmax is not SoftmaxType.VANILLA,
        dropout=cfg.dropout_p > 0.0,
        max_logit=cfg.return_max_logit,
        alibi=cfg.bias is BiasType.ALIBI,
        padding=cfg.mask.is_padding,
        ragged=ragged,
        score_mod=cfg.score_mod_key is not None,
        stats_output=not cfg.return_max_logit and (cfg.is_training or cfg.return_lse
                                                   or cfg.score_mod_key is not None),
    )


def unsupported(cfg: AttentionConfig) -> list[str]:
    """Rules this backend knows without building: features it does not map to cuDNN (yet)."""
    reasons = []
    if cfg.layout.is_ragged and cfg.return_max_logit:
        reasons.append("return_max_logit with a THD layout is not wired to cuDNN in this version")
    if cfg.bias is BiasType.ALIBI:
        if not cfg.alibi_standard:
            reasons.append("alibi: cuDNN's built-in ALiBi has the paper's slopes (fusedattn.standard_alibi_slopes); "
                           "these slopes differ, or their values were not seen (traced)")
        if cfg.mask not in (Mask.CAUSAL, Mask.PADDING_CAUSAL) or cfg.window[0] != UNBOUNDED:
            reasons.append(f"alibi: cuDNN's built-in ALiBi needs mask 'causal' or 'padding_causal' without a "
                           f"left window, got mask {cfg.mask.value!r} window {cfg.window}")
        if cfg.dropout_p > 0.0:
            reasons.append("alibi with dropout: not combined in this version")
    if cfg.score_mod_key is not None:
        reasons.extend(_score_mod_reasons(cfg))
    if cfg.seqlen_q == 0 or cfg.seqlen_kv == 0:
        reasons.append(f"Sq={cfg.seqlen_q}, Skv={cfg.seqlen_kv}: empty sequences")
    if cfg.batch > MAX_BATCH:  # graphs build, then the kernel launch fails (measured at B=65536, H200)
        reasons.append(f"B={cfg.batch} > {MAX_BATCH}: cuDNN 9.19's kernels cannot launch that many sequences")
    return reasons


def _score_mod_reasons(cfg: AttentionConfig) -> list[str]:
    key = cfg.score_mod_key
    if key[:1] == EAGER_ONLY_KEY or cfg.score_mod_recipe is None:
        if len(key) > 1:  # a flex-style callback we could not trace or lower: why
            return [f"score_mod: {key[1]}"]
        return ["score_mod: an eager-only score_mod (score_mods.eager: a Python function of the score matrix) "
                "runs on the reference only; write it as score_mod(graph, score, tensors) for cuDNN"]
    reasons = []
    issue = getattr(cfg.score_mod_recipe, "derivative_issue", None)
    if cfg.is_training and issue is not None:
        reasons.append(f"score_mod without score_mod_bprop: {issue}; cuDNN would use derivative 1 and give wrong "
                       "gradients: pass score_mod_bprop(graph, dscore, tensors), its derivative")
    if cfg.is_training and cfg.bias_requires_grad and cfg.score_mod_recipe.bprop is not None:
        reasons.append("score_mod with a derivative (score_mod_bprop, or a traced one that is not 1) and a bias that "
                       "requires grad: cuDNN 9.19 returned dBias multiplied by the score_mod's derivative in our "
                       "tests; detach the bias, or use backend='reference'")
    if cfg.bias is BiasType.PRE_SCALE:
        reasons.append("score_mod with a pre_scale bias: cuDNN adds bias after the score_mod; use bias_type "
                       "'post_scale' or add the term inside the score_mod")
    if cfg.bias is BiasType.ALIBI:
        reasons.append("score_mod with alibi_slopes: cuDNN's ALiBi cannot be combined with a score_mod; "
                       "use score_mods.compose(score_mods.alibi(slopes), ...)")
    if cfg.return_max_logit:
        reasons.append("score_mod with return_max_logit: not wired in this version")
    if cfg.mask.is_padding and cfg.diagonal_bottom_right and cfg.window != (UNBOUNDED, UNBOUNDED):
        reasons.append(f"score_mod with mask {cfg.mask.value!r} and window {cfg.window}: a diagonal that moves "
                       "with each sequence's lengths gave wrong gradients on cuDNN 9.19 in our tests")
    return reasons


def short_reason(error: Exception) -> str:
    """cuDNN's own words for a decline, without the list of Python engines that also declined."""
    text = " ".join(str(error).split())
    marker = "the backend declined:"
    if marker in text:
        text = text.split(marker, 1)[1].split("; python engines declined", 1)[0].strip(" ;)")
    return f"{type(error).__name__}: {text[:400]}"


def graph_key(cfg: AttentionConfig, direction: str, device: int) -> tuple:
    """Cache key of a built graph: the whole config, the pass, and the GPU it was built for."""
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction: expected 'forward' or 'backward', got {direction!r}")
    aligned = cfg.replace(unaligned=()) if cfg.unaligned else cfg  # an aligned copy runs the same graph
    return (aligned, direction, int(device))


def rows_without_keys(cfg: AttentionConfig) -> int:
    """Leading query rows that see no key at all: bottom-right causal with Sq > Skv.

    cuDNN refuses that mask when Sq > Skv; those rows are simply empty (output 0, lse -inf),
    so the backend runs the last Skv rows, where bottom-right and top-left coincide.
    """
    if cfg.mask is Mask.CAUSAL_BOTTOM_RIGHT and cfg.seqlen_q > cfg.seqlen_kv and cfg.score_mod_key is None:
        return cfg.seqlen_q - cfg.seqlen_kv
    return 0


def lse_without_keys(cfg: AttentionConfig, sink, like):
    """(Hq,) float32 in like's framework and device: the LSE of a row that sees no key, the log of its sink
    term alone (the learnable logits, 0 for off_by_one, -inf without a sink)."""
    from fusedattn.xp import namespace

    ops = namespace(like)
    if cfg.softmax is SoftmaxType.LEARNABLE:
        return ops.astype(ops.reshape(sink, (cfg.heads_q,)), "float32")
    value = 0.0 if cfg.softmax is SoftmaxType.OFF_BY_ONE else float("-inf")
    return ops.full((cfg.heads_q,), value, like, "float32")


_ROWS_AXIS = {Layout.BSHD: 1, Layout.SBHD: 0, Layout.BHSD: 2}  # the sequence axis of q and out, by base layout


def rows_axis(cfg: AttentionConfig) -> int:
    """The axis of q (and out) along which rows_without_keys counts, in the config's (dense) layout."""
    from fusedattn.layout import layout_spec

    return _ROWS_AXIS[layout_spec(cfg.layout).base]


def rows_with_keys_bias(cfg: AttentionConfig, bias):
    """The bias (torch or JAX, in its own shape) of the rows that see keys: its last rows where it has a
    row per query, else itself."""
    if bias is None or rows_with_keys_config(cfg).bias_shape == cfg.bias_shape:
        return bias
    return bias.reshape(cfg.bias_shape)[:, :, rows_without_keys(cfg):]


def rows_with_keys_config(cfg: AttentionConfig) -> AttentionConfig:
    """The config of the rows that see keys (see rows_without_keys); cfg itself when all do."""
    if not rows_without_keys(cfg):
        return cfg
    bias_shape = cfg.bias_shape
    if cfg.bias in (BiasType.PRE_SCALE, BiasType.POST_SCALE) and bias_shape[2] != 1:
        bias_shape = (bias_shape[0], bias_shape[1], cfg.seqlen_kv, bias_shape[3])
    return cfg.replace(seqlen_q=cfg.seqlen_kv, bias_shape=bias_shape)
