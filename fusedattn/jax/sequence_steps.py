"""A padded or THD call's own kernels around its native cuDNN graph, as the torch operator runs them:
the sequence table before the graph (lengths and ragged offsets, which the graph reads by address, and
the offsets' check), the fix-ups of the rows cuDNN leaves after it (zero output and gradients outside
every sequence, the LSE there and of queries without keys). The same Triton kernels, compiled once per
config; the custom call (backends/cudnn/native/jax_call.cc) launches them from their cubins, so no XLA
kernel reads or rewrites a whole output around the call.

Each launch's arguments are 8-byte words in the kernel's order (taken from the kernel itself): a
number, or a buffer of the call (by name) and a byte offset. `plan` turns them into the call's
attributes; `jax/native.py` owns how they are encoded.
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

from fusedattn.backends.cudnn.sequence_constants import fix_programs, table_programs
from fusedattn.backends.cudnn.sequence_layout import config_layout
from fusedattn.backends.cudnn.spec import sdpa_spec
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig, Layout, SoftmaxType

__all__ = ["OFFSET_NAMES", "TABLE", "Launch", "SequenceSteps", "unsupported", "arguments", "forward",
           "backward"]

# The call's extra operands (int32 (B + 1,) offsets), and the table result; none is a graph tensor.
OFFSET_NAMES = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded")
TABLE = "sequence_table"
BEFORE, AFTER = 0, 1  # a launch's phase: before the graph, after it


class Launch(NamedTuple):
    phase: int
    kernel: int  # index into SequenceSteps.kernels
    blocks: int
    words: tuple  # per argument: an int (the word), or (buffer name, byte offset)


class SequenceSteps(NamedTuple):
    """What a pass adds to its custom call: kernels (cubin, name, warps, shared bytes), launches, the
    graph's table slots ({graph tensor name: byte offset into the table}), the table's shape, a digest."""
    kernels: tuple
    launches: tuple
    table_slots: dict
    table_shape: tuple
    key: int


def unsupported(cfg: AttentionConfig) -> str | None:
    """Why cfg's padded or THD pass keeps its fixes in jax.numpy (None: the call runs them itself)."""
    if cfg.score_mod_key is not None:
        return "a score_mod's padding penalties"
    if cfg.return_max_logit:
        return "return_max_logit"
    if cfg.head_dim_qk % 8 or cfg.head_dim_v % 8:
        return "head dims that are not multiples of 8"  # the fix-ups store 16 bytes at once
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return f"triton is not importable ({error})"
    return None


def _float_word(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _row_strides(cfg: AttentionConfig, shape: tuple) -> tuple:
    """(b, s, h) element strides of a dense array of `shape` in the call's layout, as fix_rows reads it
    ((B, S, H, D)-strided; THD (T, H, D) has no batch stride)."""
    if cfg.layout.is_ragged:
        _, h, d = shape
        return 0, h * d, d
    if cfg.layout is Layout.BSHD:
        _, s, h, d = shape
        return s * h * d, h * d, d
    if cfg.layout is Layout.SBHD:
        s, b, h, d = shape
        return h * d, b * h * d, d
    b, h, s, d = shape  # BHSD
    return h * s * d, d, s * d


def _lse_strides(cfg: AttentionConfig, shape: tuple) -> tuple:
    """(b, s, h) strides of the LSE: (B, H, S), or THD's (T, H)."""
    if cfg.layout.is_ragged:
        return 0, shape[1], 1
    _, h, s = shape
    return h * s, 1, s


def arguments(function) -> tuple:
    """A Triton kernel's arguments in its order, constexprs left out (a JIT or interpreted function)."""
    import inspect

    parameters = inspect.signature(function.fn).parameters.values()
    return tuple(p.name for p in parameters if "constexpr" not in str(p.annotation))


def _words(function, named: dict) -> tuple:
    """The kernel's arguments in its order (constexprs left out), from {argument name: word}."""
    return tuple(named[name] for name in arguments(function))


def _target(device: int):
    """The Triton target of JAX's GPU `device` (Triton's own driver asks torch, which may be absent)."""
    import jax
    from triton.backends.compiler import GPUTarget

    major, minor = str(jax.devices("gpu")[device].compute_capability).split(".")
    return GPUTarget("cuda", int(major) * 10 + int(minor), 32)


# (cfg, kernel name, stats, capability) -> (cubin, name, warps, shared bytes)
_compiled: LRUCache = register("jax.sequence_kernels", LRUCache(256))


def _kernel(cfg: AttentionConfig, which: str, stats: bool, device: int) -> tuple:
    from fusedattn.backends.cudnn.native import sequence_plans

    target = _target(device)
    return _compiled.get_or_build((cfg, which, stats, target.arch), lambda: sequence_plans.kernel(
        cfg, which, stats, target, stats_apart=False))


def _table_launch(cfg: AttentionConfig, layout, tokens: tuple) -> tuple:
    from fusedattn.backends.cudnn import sequence_kernels

    padded = cfg.padded_offsets
    words = {"CU_Q": ("cu_seqlens_q", 0), "CU_KV": ("cu_seqlens_kv", 0),
             "STARTS_Q": ("cu_seqlens_q_padded" if padded else "cu_seqlens_q", 0),
             "STARTS_KV": ("cu_seqlens_kv_padded" if padded else "cu_seqlens_kv", 0), "TABLE": (TABLE, 0),
             "B": layout.batch, "LIMIT_Q": layout.limits[0], "LIMIT_KV": layout.limits[1],
             "TOTAL_Q": tokens[0], "TOTAL_KV": tokens[1], "WIDTH": layout.width}
    return _words(sequence_kernels.sequence_tables, words)


def _fix_launch(cfg: AttentionConfig, layout, side: str, x: tuple, y: tuple | None, lse: tuple | None,
                sink: str | None) -> tuple:
    """(blocks, words) of fix_rows over one side. x, y: (buffer name, shape); lse: (buffer name, shape)."""
    from fusedattn.backends.cudnn import sequence_kernels

    ragged = cfg.layout.is_ragged
    x_name, x_shape = x
    y_name, y_shape = y or x
    if ragged:
        rows = x_shape[0]
    else:  # B * S, whichever axes hold them
        rows = x_shape[0] * (x_shape[2] if cfg.layout is Layout.BHSD else x_shape[1])
    seqlen = cfg.seqlen_q if side == "q" else cfg.seqlen_kv
    heads = cfg.heads_q if side == "q" else cfg.heads_kv
    sx, sy = _row_strides(cfg, x_shape), _row_strides(cfg, y_shape)
    sl = _lse_strides(cfg, lse[1]) if lse is not None else (0, 0, 0)
    lse_word = (lse[0], 0) if lse is not None else (x_name, 0)
    words = {"X": (x_name, 0), "Y": (y_name, 0), "LSE": lse_word, "STATS": lse_word,
             "SINK": (sink, 0) if sink else (x_name, 0), "BSTATS": (x_name, 0), "TABLE": (TABLE, 0),
             "WIDTH": layout.width, "B": layout.batch, "ROWS": rows, "SEQ": 1 if ragged else seqlen,
             "HEADS": heads, "DIM_X": x_shape[-1], "DIM_Y": y_shape[-1],
             "gap_lse": _float_word(0.0 if ragged else float("-inf")),
             "sx_b": sx[0], "sx_s": sx[1], "sx_h": sx[2], "sy_b": sy[0], "sy_s": sy[1], "sy_h": sy[2],
             "sl_b": sl[0], "sl_s": sl[1], "sl_h": sl[2]}
    return fix_programs(rows), _words(sequence_kernels.fix_rows, words)


def _table_slots(layout) -> dict:
    """{graph tensor name: byte offset of its table row} (sequences.SequenceTable's rows)."""
    step = layout.width * 4
    slots = {"seq_len_q": 0, "seq_len_kv": step}
    slots.update({"ro_" + name: row * step for row, (name, _) in enumerate(layout.offsets, start=4)})
    return slots


def _steps(cfg: AttentionConfig, kernels: list, launches: list) -> SequenceSteps:
    layout = config_layout(cfg)
    digest = hashlib.sha256(repr((cfg, launches)).encode() + b"".join(k[0] for k in kernels)).digest()
    key = int.from_bytes(digest[:8], "little", signed=True)
    return SequenceSteps(tuple(kernels), tuple(Launch(*launch) for launch in launches), _table_slots(layout),
                         (layout.rows, layout.width), key)


def _sink_name(cfg: AttentionConfig) -> str | None:
    return "sink" if cfg.softmax is SoftmaxType.LEARNABLE else None


def forward(cfg: AttentionConfig, device: int, shapes: dict) -> SequenceSteps:
    """The forward's steps. shapes: {"q", "k", "o", "stats": shape} (stats: the LSE's, (B, H, S) or (T, H))."""
    layout = config_layout(cfg)
    stats = sdpa_spec(cfg).stats_output
    tokens = (shapes["q"][0], shapes["k"][0]) if layout.ragged else (0, 0)
    fix_blocks, fix_words = _fix_launch(cfg, layout, "q", ("o", shapes["o"]), None,
                                        ("stats", shapes["stats"]) if stats else None, _sink_name(cfg))
    kernels = [_kernel(cfg, "table", stats, device), _kernel(cfg, "fix_forward", stats, device)]
    launches = [(BEFORE, 0, table_programs(layout), _table_launch(cfg, layout, tokens)),
                (AFTER, 1, fix_blocks, fix_words)]
    return _steps(cfg, kernels, launches)


def backward(cfg: AttentionConfig, device: int, shapes: dict) -> SequenceSteps:
    """The backward's steps. shapes: {"q", "k", "v": shape} (dq, dk, dv have them)."""
    layout = config_layout(cfg)
    tokens = (shapes["q"][0], shapes["k"][0]) if layout.ragged else (0, 0)
    q_blocks, q_words = _fix_launch(cfg, layout, "q", ("dq", shapes["q"]), None, None, None)
    kv_blocks, kv_words = _fix_launch(cfg, layout, "kv", ("dk", shapes["k"]), ("dv", shapes["v"]), None, None)
    kernels = [_kernel(cfg, which, False, device) for which in ("table", "fix_backward_q", "fix_backward_kv")]
    launches = [(BEFORE, 0, table_programs(layout), _table_launch(cfg, layout, tokens)),
                (AFTER, 1, q_blocks, q_words), (AFTER, 2, kv_blocks, kv_words)]
    return _steps(cfg, kernels, launches)
