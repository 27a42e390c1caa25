"""The one description of an attention call: `AttentionConfig` and its vocabulary.

Frontends turn tensors into a config; selection, probes and caches only ever
see the config. A config is frozen and hashable, so it can key every cache.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Hashable
from dataclasses import dataclass, field, fields, replace

from fusedattn.checks import check_probability, check_scale, check_window

__all__ = [
    "standard_alibi_slopes",
    "Layout",
    "Mask",
    "BiasType",
    "SoftmaxType",
    "AttentionConfig",
    "DTYPES",
    "UNBOUNDED",
]

UNBOUNDED = -1
DTYPES = ("float16", "bfloat16", "float32", "float64")
DEVICES = ("cpu", "cuda")
FRAMEWORKS = ("torch", "jax")


def standard_alibi_slopes(heads: int) -> list[float]:
    """The ALiBi paper's slopes for `heads` heads: 2^(-8/n), 2^(-16/n), ... for the largest power
    of two n <= heads, then every other slope of the 2n sequence for the remaining heads."""
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads: expected an int >= 1, got {heads!r}")
    n = 1 << (heads.bit_length() - 1)
    slopes = [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    extra = [2.0 ** (-8.0 * (i + 1) / (2 * n)) for i in range(2 * n)][0::2]
    return slopes + extra[: heads - n]


# Where an array given for a named choice belongs, by the choice's class.
_ARRAY_HINTS = {
    "Mask": ("; a mask tensor is not a mask name: pass an additive one as bias= (0 where kept, -inf where "
             "dropped), a condition as mask_mod=, or call the drop-in scaled_dot_product_attention(attn_mask=) "
             "(torch) or dot_product_attention(mask=) (JAX), which take boolean masks"),
}


class _Choice(str, enum.Enum):
    """A string enum whose `parse` names the argument and the accepted values on error."""

    @classmethod
    def parse(cls, value, argument: str):
        if isinstance(value, cls):
            return value
        # (a lookup: Dynamo reports cls(value)'s error as its own internal one, and 2.11 cannot iterate cls)
        member = cls._value2member_map_.get(value) if isinstance(value, str) else None
        if member is not None:
            return member
        accepted = ", ".join(repr(m.value) for m in cls)
        if hasattr(value, "shape") and hasattr(value, "dtype"):  # an array: its description, not its contents
            raise ValueError(f"{argument}: expected one of {accepted}, got an array of shape {tuple(value.shape)}, "
                             f"dtype {value.dtype}{_ARRAY_HINTS.get(cls.__name__, '')}")
        raise ValueError(f"{argument}: expected one of {accepted}, got {value!r}")

    def __str__(self) -> str:
        return self.value


class Layout(_Choice):
    BSHD = "bshd"
    SBHD = "sbhd"
    BHSD = "bhsd"
    THD = "thd"
    BS3HD = "bs3hd"
    SB3HD = "sb3hd"
    T3HD = "t3hd"
    BSHD_BS2HD = "bshd_bs2hd"
    SBHD_SB2HD = "sbhd_sb2hd"
    THD_T2HD = "thd_t2hd"

    @property
    def is_ragged(self) -> bool:
        """True for the packed variable-length (THD) family."""
        return self.value.startswith("t")


class Mask(_Choice):
    NONE = "none"
    CAUSAL = "causal"
    CAUSAL_BOTTOM_RIGHT = "causal_bottom_right"
    PADDING = "padding"
    PADDING_CAUSAL = "padding_causal"
    PADDING_CAUSAL_BOTTOM_RIGHT = "padding_causal_bottom_right"

    @property
    def is_padding(self) -> bool:
        return self.value.startswith("padding")

    @property
    def is_causal(self) -> bool:
        return "causal" in self.value

    @property
    def bottom_right(self) -> bool:
        """Whether the diagonal (causal limit, window, ALiBi distance) is bottom-right aligned.

        Non-causal masks align windows and ALiBi bottom-right, as FlashAttention does,
        so that a decode step (Sq=1) sees the keys nearest the end.
        """
        return self.value.endswith("bottom_right") or not self.is_causal

    def with_padding(self) -> Mask:
        return self if self.is_padding else Mask("padding" if self is Mask.NONE else "padding_" + self.value)


class BiasType(_Choice):
    NONE = "none"
    PRE_SCALE = "pre_scale"
    POST_SCALE = "post_scale"
    ALIBI = "alibi"


class SoftmaxType(_Choice):
    VANILLA = "vanilla"
    OFF_BY_ONE = "off_by_one"
    LEARNABLE = "learnable"


def _check_int(value, argument: str, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{argument}: expected an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Everything about one attention call that decides which backend can run it and how.

    Shape letters: B batch, Sq/Skv query/key sequence lengths (the maximum for THD),
    Hq/Hkv query/key-value heads, D query-key head dim, Dv value head dim.
    """

    dtype: str
    layout: Layout
    batch: int
    seqlen_q: int
    seqlen_kv: int
    heads_q: int
    heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    mask: Mask = Mask.NONE
    window: tuple[int, int] = (UNBOUNDED, UNBOUNDED)
    bias: BiasType = BiasType.NONE
    bias_shape: tuple[int, ...] | None = None
    bias_requires_grad: bool = False
    softmax: SoftmaxType = SoftmaxType.VANILLA
    dropout_p: float = 0.0
    scale: float | None = None
    is_training: bool = False
    deterministic: bool = False
    return_lse: bool = False
    return_max_logit: bool = False
    score_mod_key: Hashable | None = None
    # How to build the score_mod's graph (fusedattn.score_mods.GraphRecipe): callbacks and aux
    # descriptions, no values. Not compared: score_mod_key already says what it builds.
    score_mod_recipe: object = field(default=None, compare=False, repr=False)
    # Tensors the score_mod reads require grad beyond an added term (score * w[h]): only a backend whose
    # forward its framework's autodiff can differentiate (score_mod_gradient) gives them their gradient.
    score_mod_learns: bool = False
    padded_offsets: bool = False
    alibi_standard: bool = False  # the ALiBi slopes are the paper's geometric sequence for Hq heads
    device: str = "cpu"
    framework: str = "torch"
    k_dtype: str | None = None
    v_dtype: str | None = None
    out_dtype: str | None = None
    # Tensors (q, k, v as passed, bias, sink) whose address is not a multiple of 16 bytes, such as a
    # view that starts one element into its storage: backends that need aligned operands copy them.
    unaligned: tuple[str, ...] = ()
    # Strides of q, k, v as passed (in the layout's own axis order) where they are not those of
    # contiguous tensors: views into wider memory, such as head slices of one fused projection.
    # Backends that read strided memory use them instead of copying; None: contiguous.
    strides: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        set_("layout", Layout.parse(self.layout, "layout"))
        set_("mask", Mask.parse(self.mask, "mask"))
        set_("bias", BiasType.parse(self.bias, "bias"))
        set_("softmax", SoftmaxType.parse(self.softmax, "softmax"))
        for name in ("dtype", "k_dtype", "v_dtype", "out_dtype"):
            value = getattr(self, name)
            if value is None and name != "dtype":
                set_(name, self.dtype)
            elif value not in DTYPES:
                raise ValueError(f"{name}: expected one of {', '.join(DTYPES)}, got {value!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.framework not in FRAMEWORKS:
            raise ValueError(f"framework: expected one of {', '.join(FRAMEWORKS)}, got {self.framework!r}")
        _check_int(self.batch, "batch", 0)  # (an empty batch runs on the reference: Backend.runs_empty_batch)
        for name in ("seqlen_q", "seqlen_kv"):
            _check_int(getattr(self, name), name, 0)
        for name in ("heads_q", "heads_kv", "head_dim_qk", "head_dim_v"):
            _check_int(getattr(self, name), name, 1)
        if self.heads_q % self.heads_kv:
            raise ValueError(
                f"heads: Hq={self.heads_q} must be a multiple of Hkv={self.heads_kv} (GQA/MQA)"
            )
        self._check_window()
        self._check_bias_and_softmax()
        set_("dropout_p", check_probability(self.dropout_p))
        scale = check_scale(self.scale)
        set_("scale", 1.0 / math.sqrt(self.head_dim_qk) if scale is None else scale)
        if self.layout.is_ragged and not self.mask.is_padding:
            raise ValueError(
                f"mask: layout {self.layout.value!r} is packed variable-length and needs a padding "
                f"mask, got {self.mask.value!r}; use {self.mask.with_padding().value!r}"
            )
        if self.padded_offsets and not self.layout.is_ragged:
            raise ValueError(f"padded_offsets: only for THD layouts, got layout {self.layout.value!r}")
        if self.layout.value in ("bs3hd", "sb3hd", "t3hd"):
            same = (self.heads_q == self.heads_kv and self.head_dim_qk == self.head_dim_v
                    and self.seqlen_q == self.seqlen_kv)
            if not same:
                raise ValueError(f"layout {self.layout.value!r} packs q, k and v together: "
                                 "Hq == Hkv, D == Dv and Sq == Skv are required, got "
                                 f"Hq={self.heads_q} Hkv={self.heads_kv} D={self.head_dim_qk} Dv={self.head_dim_v} "
                                 f"Sq={self.seqlen_q} Skv={self.seqlen_kv}")
        if not isinstance(self.unaligned, tuple) or not all(isinstance(n, str) for n in self.unaligned):
            raise ValueError(f"unaligned: expected a tuple of tensor names, got {self.unaligned!r}")
        if self.strides is not None and not (
                isinstance(self.strides, tuple) and len(self.strides) == 3
                and all(isinstance(s, tuple) and len(s) == 4 and all(isinstance(n, int) and n >= 0 for n in s)
                        for s in self.strides)):
            raise ValueError(f"strides: expected None or three 4-tuples of non-negative ints (q, k, v), "
                             f"got {self.strides!r}")
        if self.alibi_standard and self.bias is not BiasType.ALIBI:
            raise ValueError("alibi_standard: only with bias='alibi'")
        for name in ("is_training", "deterministic", "return_lse", "return_max_logit",
                     "bias_requires_grad", "padded_offsets", "alibi_standard", "score_mod_learns"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    def _check_window(self) -> None:
        left, right = check_window(self.window, accepted=(tuple,)) or (UNBOUNDED, UNBOUNDED)
        # A side wider than any query-key distance bounds nothing: stored as unbounded, so no backend's int32
        # index arithmetic (diagonal +- side) meets a number past its range (a window of 2**32 wrapped).
        reach = self.seqlen_q + self.seqlen_kv
        left, right = (UNBOUNDED if side > reach else side for side in (left, right))
        object.__setattr__(self, "window", (left, right))
        if self.mask.is_causal:
            if right not in (UNBOUNDED, 0):
                raise ValueError(
                    f"window: right={right} looks ahead of the diagonal, which mask "
                    f"{self.mask.value!r} forbids; use right=0 or -1 with a causal mask, "
                    f"or mask 'none'/'padding' for a two-sided window"
                )
            # A causal mask is a window with right=0: store one spelling only.
            object.__setattr__(self, "window", (left, 0))

    def _check_bias_and_softmax(self) -> None:
        if self.bias is BiasType.NONE:
            if self.bias_shape is not None:
                raise ValueError(f"bias_shape: must be None when bias='none', got {self.bias_shape!r}")
        elif self.bias is BiasType.ALIBI:
            valid = (self.bias_shape in ((self.heads_q,), (self.batch, self.heads_q)))
            if not valid:
                raise ValueError(
                    f"alibi_slopes: expected shape (Hq,)=({self.heads_q},) or (B, Hq)="
                    f"({self.batch}, {self.heads_q}), got {self.bias_shape!r}"
                )
        else:
            shape = self.bias_shape
            full = (self.batch, self.heads_q, self.seqlen_q, self.seqlen_kv)
            if (not isinstance(shape, tuple) or len(shape) != 4
                    or any(s not in (1, f) for s, f in zip(shape, full))):
                raise ValueError(
                    f"bias: expected a shape broadcastable to [B|1, Hq|1, Sq|1, Skv|1] = "
                    f"{list(full)}, got {list(shape) if isinstance(shape, tuple) else shape!r}"
                )
            if self.layout.is_ragged:
                raise ValueError("bias: a bias tensor is not defined for THD layouts; "
                                 "use a padded layout (bshd with mask='padding') or alibi")

    # Derived facts backends ask about.
    @property
    def diagonal_bottom_right(self) -> bool:
        return self.mask.bottom_right

    @property
    def has_window(self) -> bool:
        """A sliding window beyond what the mask itself implies (causal masks store right=0)."""
        left, right = self.window
        return left != UNBOUNDED or (right != UNBOUNDED and not self.mask.is_causal)

    @property
    def has_sequence_lengths(self) -> bool:
        """Per-sequence lengths from cu_seqlens: a padding mask, which every THD layout has (checked above)."""
        return self.mask.is_padding

    @property
    def stats_dtype(self) -> str:
        """dtype of the LSE and max_logit: float64 for float64 inputs (their reference is float64),
        float32 otherwise."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def gqa_group(self) -> int:
        return self.heads_q // self.heads_kv

    def replace(self, **changes) -> AttentionConfig:
        return replace(self, **changes)

    # Configs key many caches, several per call: the hash of their thirty fields is computed once. It
    # stays out of pickles (a string's hash differs between processes).
    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    def summary(self) -> str:
        """One line of the attributes that matter for selection, in the public vocabulary."""
        parts = [
            f"layout={self.layout.value}", f"dtype={self.dtype}",
            f"B={self.batch}", f"Sq={self.seqlen_q}", f"Skv={self.seqlen_kv}",
            f"Hq={self.heads_q}", f"Hkv={self.heads_kv}", f"D={self.head_dim_qk}", f"Dv={self.head_dim_v}",
            f"mask={self.mask.value}",
        ]
        if self.has_window:
            parts.append(f"window={self.window}")
        if self.bias is not BiasType.NONE:
            parts.append(f"bias={self.bias.value}{list(self.bias_shape)}")
        if self.softmax is not SoftmaxType.VANILLA:
            parts.append(f"softmax={self.softmax.value}")
        if self.dropout_p:
            parts.append(f"dropout_p={self.dropout_p}")
        parts.append(f"scale={self.scale:.6g}")
        parts.append(f"training={self.is_training}")
        for flag in ("deterministic", "return_lse", "return_max_logit", "padded_offsets"):
            if getattr(self, flag):
                parts.append(flag)
        if self.score_mod_key is not None:
            parts.append("score_mod (learning)" if self.score_mod_learns else "score_mod")
        if self.unaligned:
            parts.append(f"unaligned={','.join(self.unaligned)}")
        if self.strides is not None:
            parts.append("strides=" + "/".join(",".join(map(str, s)) for s in self.strides))
        parts.append(f"device={self.device}")
        parts.append(f"framework={self.framework}")
        return " ".join(parts)
