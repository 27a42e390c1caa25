"""What the native operator needs to run a padded or THD config: its sequence table and kernels.

The torch Python path builds each call's sequence table and fixes the rows cuDNN leaves with two
Triton kernels (backends/cudnn/sequences.py). The operator launches the same kernels itself
(torch_op.cc: SequencePlan, triton_launch.h): here each is compiled once per config with an explicit
signature, every pointer without an alignment assumption and every int as int64, so that one cubin
serves any tensor and any token count and C++ passes its arguments as 8-byte words in the kernel's
order. `values(cfg)` gives the table's shape and the rows each graph slot reads.
"""

from __future__ import annotations

from fusedattn.config import AttentionConfig

__all__ = ["KERNELS", "FORWARD_SEQUENCE_SLOTS", "BACKWARD_SEQUENCE_SLOTS", "values", "kernels", "kernel",
           "compile_kernel"]

# Graph tensors that read the table, in the slot order of torch_op.cc (after each graph's own slots).
FORWARD_SEQUENCE_SLOTS = ("seq_len_q", "seq_len_kv", "ro_q", "ro_k", "ro_v", "ro_o", "ro_stats", "sm_row_penalty",
                          "sm_col_penalty")
BACKWARD_SEQUENCE_SLOTS = (*FORWARD_SEQUENCE_SLOTS, "ro_dq", "ro_dk", "ro_dv")
KERNELS = ("table", "fix_forward", "fix_backward_q", "fix_backward_kv")  # enum SequenceKernel
_IO_TYPES = {"bfloat16": "*bf16", "float16": "*fp16"}
# Pointer arguments' element types (the fix-ups' X and Y take the call's dtype); every other is int64.
_POINTERS = {"CU_Q": "*i32", "CU_KV": "*i32", "STARTS_Q": "*i32", "STARTS_KV": "*i32", "TABLE": "*i32",
             "X": None, "Y": None, "LSE": "*fp32", "STATS": "*fp32", "SINK": "*fp32", "BSTATS": "*fp32"}
_FLOATS = frozenset({"gap_lse"})
# What the fix-ups may assume of the rows they write, as Triton's JIT would see it at a Python launch:
# without it each element is its own 2-byte store (the padded forward's fix-up took 288 us against 9 on
# the Python path, H100). The operator allocates every tensor a fix-up writes (16-byte aligned; strides
# and head dims multiples of the head dim, which cuDNN needs a multiple of 8) and checks this before each
# launch (torch_op.cc: fix_rows).
_FIX_DIVISIBILITY = {"X": 16, "Y": 16, **{name: 8 for name in ("sx_b", "sx_s", "sx_h", "sy_b", "sy_s", "sy_h",
                                                               "DIM_X", "DIM_Y")}}


def _layout(cfg: AttentionConfig):
    from fusedattn.backends.cudnn.sequence_layout import config_layout

    return config_layout(cfg)


def values(cfg: AttentionConfig) -> list[int]:
    """The sequence plan as fusedattn_torch_sequences takes it (torch_op.cc)."""
    from fusedattn.backends.cudnn.sequence_constants import ROWS_PER_PROGRAM, table_programs

    layout = _layout(cfg)
    rows = {"seq_len_q": 0, "seq_len_kv": 1}
    rows.update({"ro_" + name: 4 + index for index, (name, _) in enumerate(layout.offsets)})
    if layout.penalty_rows is not None:
        rows.update(zip(("sm_row_penalty", "sm_col_penalty"), layout.penalty_rows))
    units = [x for index, (_, unit) in enumerate(layout.offsets) for x in (unit, int(index >= layout.queries))]
    return [int(layout.ragged), int(cfg.padded_offsets), layout.batch, layout.width, layout.rows, layout.flag_row,
            *layout.limits, cfg.seqlen_q, cfg.seqlen_kv, ROWS_PER_PROGRAM, table_programs(layout),
            len(layout.offsets), *units,
            *(rows.get(name, -1) for name in FORWARD_SEQUENCE_SLOTS),
            *(rows.get(name, -1) for name in BACKWARD_SEQUENCE_SLOTS)]


def kernels(cfg: AttentionConfig, stats: bool, target=None) -> list:
    """The config's compiled kernels in KERNELS' order, each as (cubin, name, warps, shared bytes).
    stats: the forward graph writes the LSE (the forward fix-up writes the returned LSE from it).
    target: a triton GPUTarget; the current device's by default."""
    return [kernel(cfg, which, stats, target) for which in KERNELS]


def kernel(cfg: AttentionConfig, which: str, stats: bool, target=None, stats_apart: bool | None = None) -> tuple:
    """One of KERNELS, compiled as `kernels` does. stats_apart (fix_forward): the graph's stats are a tensor
    of their own, which the fix-up makes finite outside every sequence for the backward (the default: the
    operator's padded calls); False where the LSE is the stats, fixed in place."""
    from fusedattn.backends.cudnn import sequence_kernels
    from fusedattn.backends.cudnn.sequence_constants import fix_constants, table_constants

    layout = _layout(cfg)
    heads_kv, dim_qk, dim_v = cfg.heads_kv, cfg.head_dim_qk, cfg.head_dim_v
    fix = sequence_kernels.fix_rows
    if which == "table":
        return _compile(sequence_kernels.sequence_tables, cfg, target,
                        table_constants(layout, cfg.padded_offsets, cfg.padded_offsets))
    if which == "fix_forward":
        apart = stats and not layout.ragged if stats_apart is None else stats_apart
        constants = fix_constants(layout, "q", cfg.heads_q, dim_v, None, stats, apart, cfg.softmax,
                                  stats and layout.penalty_rows is not None and cfg.is_training)
    elif which == "fix_backward_q":
        constants = fix_constants(layout, "q", cfg.heads_q, dim_qk, None, False, False, cfg.softmax)
    elif which == "fix_backward_kv":
        constants = fix_constants(layout, "kv", heads_kv, dim_qk, dim_v, False, False, cfg.softmax)
    else:
        raise ValueError(f"no sequence kernel {which!r}; the kernels are {KERNELS}")
    return _compile(fix, cfg, target, constants, _FIX_DIVISIBILITY)


def _compile(function, cfg: AttentionConfig, target, constants: dict, divisible: dict | None = None) -> tuple:
    return compile_kernel(function, cfg.dtype, target, constants, _POINTERS, divisible)


def compile_kernel(function, dtype: str, target, constants: dict, pointers: dict,
                   divisible: dict | None = None) -> tuple:
    """(cubin, name, warps, shared bytes) of a Triton kernel for the operator's launch: `pointers` names
    its pointer arguments' element types (None: the call's dtype), every other argument is int64 but
    the float32 ones of _FLOATS. divisible: {argument: what every launch's value is a multiple of} (bytes
    for a pointer). target: a triton GPUTarget; the current device's when None."""
    import triton
    from triton.compiler import ASTSource

    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(function.arg_names):
        if function.params[index].is_constexpr:
            signature[name] = "constexpr"
            constexprs[(index,)] = constants[name]
        elif name in pointers:
            signature[name] = pointers[name] or _IO_TYPES[dtype]
        else:
            signature[name] = "fp32" if name in _FLOATS else "i64"
        if divisible and name in divisible:
            attrs[(index,)] = [["tt.divisibility", divisible[name]]]
    target = target or triton.runtime.driver.active.get_current_target()
    compiled = triton.compile(ASTSource(function, signature, constexprs, attrs), target=target)
    metadata = compiled.metadata
    if metadata.global_scratch_size or getattr(metadata, "profile_scratch_size", 0):
        raise RuntimeError(f"{function.__name__} needs scratch memory, which the operator's launch does not give")
    return bytes(compiled.asm["cubin"]), metadata.name, metadata.num_warps, metadata.shared
