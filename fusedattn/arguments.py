"""Turning a frontend call's arguments into an AttentionConfig, with precise errors.

Shared by the torch and JAX frontends: they describe each tensor as a
`TensorMeta` (shape, dtype, device), and everything about shapes, dtypes,
devices and option combinations is checked here, once.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from fusedattn.config import DTYPES, AttentionConfig, BiasType, Layout, Mask, SoftmaxType
from fusedattn.layout import check_cu_seqlens, contiguous_strides, layout_spec

__all__ = ["TensorMeta", "CallArguments", "build_config", "check_offset_tensors", "infer_max_seqlens",
           "clamp_max_seqlens", "bucket_max_seqlens", "ENV_THD_BUCKET", "check_sequence_values", "host_slopes"]

INDEX_DTYPES = ("int32", "int64")
RAGGED_LAYOUTS = frozenset(layout.value for layout in Layout if layout.is_ragged)


@dataclass(frozen=True)
class TensorMeta:
    """What the checks need to know of a tensor, without the framework."""

    shape: tuple[int, ...]
    dtype: str
    device: str  # e.g. "cuda:0", "cpu", "TFRT_CPU_0"; "" when not known (a JAX tracer)
    device_kind: str  # "cpu" or "cuda"

    def line(self, name: str) -> str:
        return f"{name}: shape {self.shape}, dtype {self.dtype}, device {self.device or self.device_kind}"


def host_slopes(argument: str, value, q_dtype="float64"):
    """ALiBi slopes given as a list, tuple or NumPy array, as a NumPy array (Hq,) or (B, Hq): float64 for
    a float64 call (q_dtype: q's dtype, of any framework, or None when q is not an array yet; the default
    keeps every digit), float32 otherwise, the precision the kernels read slopes in.

    None for anything else (None, a framework tensor): the frontend describes and checks those.
    Frontends turn the result into their own array on q's device, so
    `alibi_slopes=fusedattn.standard_alibi_slopes(Hq)` works as written.
    """
    dtype = np.float64 if str(q_dtype).endswith("float64") else np.float32
    if isinstance(value, (list, tuple)):
        rows, batched = python_slopes(argument, value)
        return np.asarray(rows if batched else rows[0], dtype=dtype)
    if not isinstance(value, np.ndarray):
        return None
    try:
        array = np.asarray(value, dtype=dtype)
    except (TypeError, ValueError):
        raise ValueError(f"{argument}: expected (Hq,) or (B, Hq) real numbers, got {value!r}") from None
    if array.ndim not in (1, 2) or array.size == 0:
        raise ValueError(f"{argument}: expected (Hq,) or (B, Hq) real numbers, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError(f"{argument}: expected finite slopes, got {value!r}")
    return array


def python_slopes(argument: str, value: list | tuple) -> tuple[tuple[tuple[float, ...], ...], bool]:
    """Slopes given as a list or tuple, checked in plain Python (no NumPy: under torch.compile Dynamo would
    trace its checks as data-dependent branches): (rows of floats, whether batched (B, Hq))."""
    shape = _nested_shape(value)
    if len(shape) not in (1, 2) or 0 in shape:
        raise ValueError(f"{argument}: expected (Hq,) or (B, Hq) real numbers, got shape {shape}")
    rows = value if len(shape) == 2 else [value]
    for row in rows:
        for x in row:
            if isinstance(x, bool) or not isinstance(x, numbers.Real):
                raise ValueError(f"{argument}: expected (Hq,) or (B, Hq) real numbers, got {value!r}")
            if not x == x or x in (float("inf"), float("-inf")):
                raise ValueError(f"{argument}: expected finite slopes, got {value!r}")
    return tuple(tuple(float(x) for x in row) for row in rows), len(shape) == 2


def _nested_shape(value) -> tuple:
    """The shape of nested lists, tuples and arrays, as far as every item at a depth has the same length
    (a ragged list stops there)."""
    shape, level = [], [value]
    while all(isinstance(x, (list, tuple, np.ndarray)) for x in level):
        lengths = {len(x) for x in level}
        if len(lengths) != 1:
            break
        shape.append(lengths.pop())
        level = [item for x in level for item in x]
        if not level:
            break
    return tuple(shape)


def _other_device(a: str, b: str) -> bool:
    """True when both placements are known and differ."""
    return bool(a) and bool(b) and a != b


@dataclass
class CallArguments:
    """The arguments of one attention call, as metadata plus plain options."""

    api: str
    framework: str
    layout: str
    tensors: tuple[TensorMeta | None, ...]  # as passed: (q, k, v) positions
    mask: str = "none"
    window: tuple[int, int] | None = None
    bias: TensorMeta | None = None
    bias_type: str | None = None
    bias_requires_grad: bool = False
    alibi_slopes: TensorMeta | None = None
    softmax_type: str = "vanilla"
    sink: TensorMeta | None = None
    dropout_p: float = 0.0
    scale: float | None = None
    cu_seqlens_q: TensorMeta | None = None
    cu_seqlens_kv: TensorMeta | None = None
    cu_seqlens_q_padded: TensorMeta | None = None
    cu_seqlens_kv_padded: TensorMeta | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    deterministic: bool = False
    return_lse: bool = False
    return_max_logit: bool = False
    is_training: bool = False
    score_mod: Any = None  # a fusedattn.score_mods.ScoreMod (bound to its tensors by prepare_call)
    alibi_standard: bool = False  # set by the frontend when it has seen the slopes' values
    unaligned: tuple[str, ...] = ()  # tensors whose address is not 16-byte aligned (set by the torch frontend)
    strides: tuple | None = None  # q, k, v strides as passed (set by the torch frontend; None: contiguous)

    def error(self, argument: str, expected: str, got, hint: str = "") -> ValueError:
        message = f"{self.api}: {argument}: expected {expected}, got {got}"
        return ValueError(message + (f"; {hint}" if hint else ""))

    def call_lines(self) -> list[str]:
        """One line per tensor argument, for "no backend" errors."""
        spec = layout_spec(self.layout)
        lines = [meta.line(name) for (name, _), meta in zip(spec.tensors, self.tensors) if meta is not None]
        for name in ("bias", "alibi_slopes", "sink", "cu_seqlens_q", "cu_seqlens_kv",
                     "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            meta = getattr(self, name)
            if meta is not None:
                lines.append(meta.line(name))
        return lines


def _dims(args: CallArguments, name: str, axes: str, meta: TensorMeta) -> dict[str, int]:
    if len(meta.shape) != len(axes):
        readable = ", ".join(axes)
        raise args.error(name, f"a {len(axes)}-D tensor ({readable}) for layout {args.layout!r}",
                         f"shape {meta.shape}")
    return dict(zip(axes, meta.shape))


def _agree(args: CallArguments, what: str, values: dict[str, int]) -> int:
    distinct = set(values.values())
    if len(distinct) != 1:
        detail = ", ".join(f"{k} has {v}" for k, v in values.items())
        raise args.error(what, "the same size in every tensor", detail)
    return distinct.pop()


def _layout_tensors(args: CallArguments):
    """Check the tensors a layout takes; return per-role dims {q: {...}, k: {...}, v: {...}}."""
    spec = layout_spec(args.layout)
    given = list(args.tensors)
    names = spec.names
    for position, name in enumerate(("q", "k", "v")):
        expected = position < len(names)
        if expected and given[position] is None:
            label = names[position]
            raise args.error(label, f"a tensor for layout {args.layout!r} (takes {', '.join(names)})", "None")
        if not expected and given[position] is not None:
            raise args.error(
                name, f"None for packed layout {args.layout!r}, which takes {', '.join(names)}",
                "a tensor", hint=f"pass the packed tensor{'s' if len(names) > 1 else ''} only",
            )
    for (name, axes), meta in zip(spec.tensors, given):
        # The H and D axes by their letters: for bhsd the last two axes are S and D, and S may be 0.
        heads_and_dims = [size for axis, size in zip(axes, meta.shape) if axis in "HD"]
        if any(size < 0 for size in meta.shape) or any(size == 0 for size in heads_and_dims):
            raise args.error(name, "heads (H) and head dim (D) of at least 1", f"shape {meta.shape}")
    roles: dict[str, dict[str, int]] = {}
    metas: dict[str, TensorMeta] = {}
    for (name, axes), meta in zip(spec.tensors, given):
        dims = _dims(args, name, axes, meta)
        pack = "3" if "3" in axes else "2" if "2" in axes else None
        if pack is not None and dims[pack] != int(pack):
            raise args.error(name, f"size {pack} at the packing axis of {axes}", f"shape {meta.shape}")
        for role in name:  # "qkv" -> q, k, v; "kv" -> k, v
            roles[role] = dims
            metas[role] = meta
    return roles, metas


def _check_metas(args: CallArguments, metas: dict[str, TensorMeta]) -> str:
    q = metas["q"]
    for role, meta in metas.items():
        if meta.dtype not in DTYPES:
            raise args.error(role, f"a floating dtype ({', '.join(DTYPES)})", meta.dtype)
        if meta.dtype != q.dtype:
            raise args.error(role, f"dtype {q.dtype} like q", meta.dtype, hint="cast q, k and v to one dtype")
        if _other_device(meta.device, q.device):
            raise args.error(role, f"device {q.device} like q", meta.device)
    return q.dtype


def _check_index(args: CallArguments, name: str, meta: TensorMeta | None, batch: int | None,
                 device: str) -> int | None:
    """Check a (B+1,) integer offsets tensor; return B."""
    if meta is None:
        return None
    if meta.dtype not in INDEX_DTYPES:
        raise args.error(name, "an int32 or int64 tensor", f"dtype {meta.dtype}")
    if len(meta.shape) != 1 or meta.shape[0] < 1:
        raise args.error(name, "a 1-D tensor of B+1 offsets (B >= 0)", f"shape {meta.shape}")
    if _other_device(meta.device, device):
        raise args.error(name, f"device {device} like q", meta.device)
    if batch is not None and meta.shape[0] != batch + 1:
        raise args.error(name, f"B+1 = {batch + 1} offsets", f"shape {meta.shape}")
    return meta.shape[0] - 1


def check_offset_tensors(args: CallArguments) -> None:
    """Dtype, rank and device of the cu_seqlens tensors, checked before their values are read."""
    q = args.tensors[0]
    for name in ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
        _check_index(args, name, getattr(args, name), None, q.device if q is not None else "")


def build_config(args: CallArguments) -> AttentionConfig:
    """Validate the call and describe it as an AttentionConfig; raise ValueError on bad input."""
    try:
        layout = Layout.parse(args.layout, "layout")
        mask = Mask.parse(args.mask, "mask")
        softmax = SoftmaxType.parse(args.softmax_type, "softmax_type")
    except ValueError as error:
        raise ValueError(f"{args.api}: {error}") from None
    roles, metas = _layout_tensors(args)
    dtype = _check_metas(args, metas)
    device = metas["q"].device
    q, k, v = roles["q"], roles["k"], roles["v"]

    heads_q = q["H"]
    heads_kv = _agree(args, "heads of k and v (H)", {"k": k["H"], "v": v["H"]})
    head_dim_qk = _agree(args, "head dim of q and k (D)", {"q": q["D"], "k": k["D"]})
    head_dim_v = v["D"]
    if heads_q % heads_kv:
        raise args.error("heads", "Hq a multiple of Hkv (GQA/MQA)", f"Hq={heads_q}, Hkv={heads_kv}")

    if layout.is_ragged:
        mask = mask.with_padding()  # packed sequences always mask their padding
        for name in ("cu_seqlens_q", "cu_seqlens_kv"):
            if getattr(args, name) is None:
                raise args.error(name, f"a (B+1,) offsets tensor for layout {layout.value!r}", "None")
        _agree(args, "tokens of k and v (T)", {"k": k["T"], "v": v["T"]})
        batch = _check_index(args, "cu_seqlens_q", args.cu_seqlens_q, None, device)
        _check_index(args, "cu_seqlens_kv", args.cu_seqlens_kv, batch, device)
        for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            _check_index(args, name, getattr(args, name), batch, device)
        if (args.cu_seqlens_q_padded is None) != (args.cu_seqlens_kv_padded is None):
            raise args.error("cu_seqlens_q_padded/cu_seqlens_kv_padded", "both or neither", "only one")
        _check_max_seqlens(args, optional=False)
        seqlen_q, seqlen_kv = args.max_seqlen_q, args.max_seqlen_kv
    else:
        batch = _agree(args, "batch (B)", {r: roles[r]["B"] for r in ("q", "k", "v")})
        seqlen_q = q["S"]
        seqlen_kv = _agree(args, "key/value sequence length (Skv)", {"k": k["S"], "v": v["S"]})
        for name in ("cu_seqlens_q_padded", "cu_seqlens_kv_padded"):
            if getattr(args, name) is not None:
                raise args.error(name, "None: padded offsets are for THD layouts", "a tensor")
        if mask.is_padding:
            for name in ("cu_seqlens_q", "cu_seqlens_kv"):
                if getattr(args, name) is None:
                    raise args.error(name, f"a (B+1,) offsets tensor giving each sequence's length, "
                                           f"for mask {mask.value!r}", "None")
                _check_index(args, name, getattr(args, name), batch, device)
            _check_max_seqlens(args, optional=True)  # (a padded call's bound is the tensors' S: not read)
        elif args.cu_seqlens_q is not None or args.cu_seqlens_kv is not None:
            raise args.error("mask", "a padding mask when cu_seqlens are given", repr(mask.value),
                             hint=f"use {mask.with_padding().value!r} or drop cu_seqlens")
        else:  # nothing to bound: a length here would be ignored, not applied
            for name in ("max_seqlen_q", "max_seqlen_kv"):
                if getattr(args, name) is not None:
                    raise args.error(name, "None without cu_seqlens (the longest sequence of a THD or padding-mask "
                                           "call)", repr(getattr(args, name)),
                                     hint="to attend to fewer positions, pass cu_seqlens with a padding mask")

    bias_type, bias_shape = _bias(args, heads_q, batch, dtype, device)
    if softmax is SoftmaxType.LEARNABLE:
        if args.sink is None:
            raise args.error("sink", "a (Hq,) tensor of sink logits for softmax_type 'learnable'", "None")
        if args.sink.shape != (heads_q,):
            raise args.error("sink", f"shape (Hq,) = ({heads_q},)", f"shape {args.sink.shape}")
        if args.sink.dtype not in DTYPES or _other_device(args.sink.device, device):
            raise args.error("sink", f"a floating tensor on {device}", f"{args.sink.dtype} on {args.sink.device}")
    elif args.sink is not None:
        raise args.error("sink", f"None for softmax_type {softmax.value!r}", "a tensor",
                         hint="use softmax_type='learnable' for per-head sink logits")
    window = args.window if args.window is not None else (-1, -1)
    if isinstance(window, list):
        window = tuple(window)
    try:
        return AttentionConfig(
            dtype=dtype, layout=layout, batch=batch, seqlen_q=seqlen_q, seqlen_kv=seqlen_kv,
            heads_q=heads_q, heads_kv=heads_kv, head_dim_qk=head_dim_qk, head_dim_v=head_dim_v,
            mask=mask, window=window, bias=bias_type, bias_shape=bias_shape,
            bias_requires_grad=bool(args.bias_requires_grad), softmax=softmax,
            dropout_p=args.dropout_p, scale=args.scale, is_training=bool(args.is_training),
            deterministic=args.deterministic, return_lse=args.return_lse,
            return_max_logit=args.return_max_logit,
            score_mod_key=None,  # set by the caller once the score_mod is bound (score_mods.bind)
            padded_offsets=args.cu_seqlens_q_padded is not None,
            alibi_standard=bool(args.alibi_standard and bias_type is BiasType.ALIBI),
            unaligned=tuple(args.unaligned), strides=_view_strides(args, layout, metas),
            device=metas["q"].device_kind, framework=args.framework,
        )
    except ValueError as error:
        raise ValueError(f"{args.api}: {error}") from None


def _view_strides(args: CallArguments, layout: Layout, metas: dict) -> tuple | None:
    """The q, k, v strides for the config: None when the layout packs them (its own strides say how) or
    they are contiguous. Axes of size 1 count as contiguous, whatever their stride."""
    if args.strides is None or layout.is_ragged or layout_spec(layout.value).base is not layout:
        return None
    normalized, contiguous = [], True
    for role, strides in zip(("q", "k", "v"), args.strides):
        shape = metas[role].shape
        dense = contiguous_strides(shape)
        normalized.append(tuple(int(d) if n == 1 else int(s) for n, s, d in zip(shape, strides, dense)))
        contiguous = contiguous and normalized[-1] == dense
    return None if contiguous else tuple(normalized)


def _bias(args: CallArguments, heads_q: int, batch: int, dtype: str, device: str):
    """(BiasType, shape) from bias / bias_type / alibi_slopes."""
    if args.bias is not None and args.alibi_slopes is not None:
        raise args.error("alibi_slopes", "None when a bias tensor is given", "a tensor",
                         hint="add the ALiBi term to your bias tensor, or drop bias")
    if args.alibi_slopes is not None:
        if args.bias_type not in (None, "alibi"):
            raise args.error("bias_type", "'alibi' (or None) with alibi_slopes", repr(args.bias_type))
        meta = args.alibi_slopes
        if meta.dtype not in DTYPES or _other_device(meta.device, device):
            raise args.error("alibi_slopes", f"a floating tensor on {device}", f"{meta.dtype} on {meta.device}")
        return BiasType.ALIBI, meta.shape
    if args.bias is None:
        if args.bias_type not in (None, "none"):
            raise args.error("bias", f"a tensor for bias_type {args.bias_type!r}", "None")
        return BiasType.NONE, None
    try:
        bias_type = BiasType.parse(args.bias_type or "post_scale", "bias_type")
    except ValueError as error:
        raise ValueError(f"{args.api}: {error}") from None
    if bias_type not in (BiasType.PRE_SCALE, BiasType.POST_SCALE):
        raise args.error("bias_type", "'pre_scale' or 'post_scale' with a bias tensor", repr(bias_type.value))
    meta = args.bias
    if meta.dtype not in DTYPES:
        raise args.error("bias", f"a floating tensor ({', '.join(DTYPES)})", f"dtype {meta.dtype}")
    if meta.dtype != dtype:  # as SDPA: a silent cast would change the sum's precision behind the user's back
        raise args.error("bias", f"dtype {dtype} like q", f"dtype {meta.dtype}",
                         hint=f"cast it once (bias.to({dtype}) / bias.astype({dtype}))")
    if _other_device(meta.device, device):
        raise args.error("bias", f"device {device} like q", meta.device)
    shape = tuple(meta.shape)
    if len(shape) < 4:
        shape = (1,) * (4 - len(shape)) + shape  # broadcasting from the right, as arrays do
    return bias_type, shape


def _check_max_seqlens(args: CallArguments, optional: bool) -> None:
    """max_seqlen_q/kv: ints >= 0 (a NumPy int made a Python one); None too where optional."""
    for name in ("max_seqlen_q", "max_seqlen_kv"):
        value = getattr(args, name)
        if value is None and optional:
            continue
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)  # a NumPy int (np.int64(5)): the same number
            setattr(args, name, value)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise args.error(name, "an int >= 0 (the longest sequence)", repr(value))


def infer_max_seqlens(args: CallArguments, host: dict[str, np.ndarray], traced: set[str]) -> None:
    """Fill a THD call's missing max_seqlen_q/kv from host copies of its offsets."""
    if str(getattr(args.layout, "value", args.layout)) not in RAGGED_LAYOUTS:
        return
    for side in ("q", "kv"):
        name = f"cu_seqlens_{side}"
        if getattr(args, f"max_seqlen_{side}") is not None:
            continue
        if name in traced:
            raise args.error(f"max_seqlen_{side}", f"a static int when {name} is traced (under jit; offsets made "
                             f"from segment_ids_{side} that are traced are too)", "None")
        if name in host:
            lengths = np.diff(np.asarray(host[name]).astype(np.int64))
            setattr(args, f"max_seqlen_{side}", int(lengths.max(initial=0)))


def clamp_max_seqlens(args: CallArguments) -> None:
    """Lower a THD call's max_seqlen_q/kv past its tokens to the token count: no sequence is longer, and
    every backend sizes its work by the bound (the reference pads each sequence to it; a max_seqlen of
    100000 over 8 tokens asked for 160 GB). Before bucketing, so buckets stay shared. Not below 1 (a call
    with no tokens keeps its one-query shape), nor with a score_mod, whose tensors are sized by the bound
    the caller gave ((B, Hq, max_seqlen_q, max_seqlen_kv))."""
    if str(getattr(args.layout, "value", args.layout)) not in RAGGED_LAYOUTS or args.score_mod is not None:
        return
    q, k = args.tensors[0], args.tensors[1] or args.tensors[0]  # (packed layouts: k in q's tensor)
    for side, meta in (("q", q), ("kv", k)):
        value = getattr(args, f"max_seqlen_{side}")
        tokens = max(meta.shape[0], 1) if meta is not None and meta.shape else None
        if isinstance(value, int) and not isinstance(value, bool) and tokens is not None and value > tokens:
            setattr(args, f"max_seqlen_{side}", tokens)


ENV_THD_BUCKET = "FUSEDATTN_THD_BUCKET"


def bucket_max_seqlens(args: CallArguments, setting: str | None) -> None:
    """Round a THD call's max_seqlen_q/kv up to a bucket, so packed batches of varying longest
    sequence share one config (and one built graph). setting: None/"off", "pow2", or an int
    multiple. Correct for any bucket: positions past each sequence's length are masked."""
    if not setting or setting == "off" or str(getattr(args.layout, "value", args.layout)) not in RAGGED_LAYOUTS:
        return
    if setting == "pow2":
        round_up = lambda n: 1 << max(n - 1, 0).bit_length() if n > 0 else 0  # noqa: E731
    else:
        try:
            multiple = int(setting)
            if multiple < 1:
                raise ValueError
        except ValueError:
            raise ValueError(f"{ENV_THD_BUCKET}: expected 'off', 'pow2' or an int >= 1, got {setting!r}") from None
        round_up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    for side in ("q", "kv"):
        value = getattr(args, f"max_seqlen_{side}")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            setattr(args, f"max_seqlen_{side}", round_up(value))


def check_sequence_values(args: CallArguments, cfg: AttentionConfig, host: dict[str, np.ndarray],
                          total_q: int | None, total_kv: int | None) -> None:
    """Check the values of cu_seqlens (host copies) against the tensors and max_seqlen."""
    for side, total, limit in (("q", total_q, cfg.seqlen_q), ("kv", total_kv, cfg.seqlen_kv)):
        name = f"cu_seqlens_{side}"
        if name not in host:
            continue
        padded_name = f"{name}_padded"
        longest = check_cu_seqlens(f"{args.api}: {name}", host[name],
                                   total if total is not None else int(np.max(host[name])),
                                   host.get(padded_name), f"{args.api}: {padded_name}")
        if longest > limit:
            what = f"max_seqlen_{side}" if cfg.layout.is_ragged else f"the tensor's S{side}"
            raise ValueError(f"{args.api}: {name}: a sequence of {longest} tokens exceeds {what}={limit}")
