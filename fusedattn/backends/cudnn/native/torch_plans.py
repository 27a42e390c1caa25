"""The torch side of the native launch path: load the operator library, register plans for configs.

A config the operator runs (`reasons(cfg)` is empty) gets a torch plan once: its forward and
backward graphs (already built by the probe) serialized into the launch core, plus the shapes and
strides of the call's tensors. After that a call is `torch.ops.fusedattn_native.attention(plan, q,
k, v, sink, seed, offset, bias, aux, scalars, empty_rows)`: the operator allocates, launches and
records its C++ autograd node. A score_mod's aux tensors and numbers travel as `aux` and `scalars`
in the order `operands(cfg)` gives. Where Python's headers exist, the library is also a Python
module whose `attention` calls the same operator more cheaply (`entry`) and whose `tensor_key`
names a call's tensors for its plan-cache signature in one C call (`tensor_key`).
Configs it does not run keep the Python path (max_logit with sequence lengths); one with rows without keys
runs the config of its other rows (torch/rows_with_keys.py);
`unavailable()` says why the library cannot be used at all on this machine.
FUSEDATTN_TORCH_NATIVE=0 turns the operator off.
"""

from __future__ import annotations

import ctypes
import os
import threading

from fusedattn.backends.cudnn.native import build, core, sequence_plans
from fusedattn.backends.cudnn.score_mod_masks import Operands, operands
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig, BiasType, Layout, SoftmaxType

__all__ = ["ENV_SWITCH", "unavailable", "reasons", "plan_for", "forget", "plan_shape", "FORWARD_SLOTS",
           "BACKWARD_SLOTS", "registry_sizes", "Operands", "operands"]

ENV_SWITCH = "FUSEDATTN_TORCH_NATIVE"
# Graph tensor names in the slot orders of torch_op.cc (enum ForwardSlot / BackwardSlot).
FORWARD_SLOTS = ("q", "k", "v", "sink", "dropout_seed", "dropout_offset", "o", "stats", "bias", "row_max",
                 "sum_exp", *sequence_plans.FORWARD_SEQUENCE_SLOTS)
BACKWARD_SLOTS = ("q", "k", "v", "o", "dO", "stats", "sink", "dropout_seed", "dropout_offset", "dq", "dk", "dv",
                  "dsink", "bias", "dbias", *sequence_plans.BACKWARD_SEQUENCE_SLOTS)
_SINK_KINDS = {SoftmaxType.VANILLA: 0, SoftmaxType.OFF_BY_ONE: 1, SoftmaxType.LEARNABLE: 2}
_BIAS_KINDS = {BiasType.NONE: 0, BiasType.ALIBI: 0, BiasType.POST_SCALE: 1, BiasType.PRE_SCALE: 2}  # enum BiasKind
_SCALAR_TYPES = {"float16": 5, "bfloat16": 15}  # c10::ScalarType codes
_FROM_BHSD = {Layout.BSHD: (0, 2, 1, 3), Layout.SBHD: (2, 0, 1, 3), Layout.BHSD: (0, 1, 2, 3),
              Layout.THD: (0, 2, 1, 3)}  # THD: (B, S, H, D) order, of which the operator reads (H, D)
PLAN_CAPACITY = core.PLAN_CAPACITY  # torch plans the operator keeps; the Python cache below is smaller

NAME = build.NAMES["torch"].removesuffix(".so")  # the library's Python module name, where it is one
# The operator's Python entry, fusedattn_native.attention's arguments and outputs as a tuple, once loaded
# from a library built with it; None: torch.ops.fusedattn_native.attention.default is the way in.
entry = None
# The same module's tensor_key(*tensors): bytes naming their shapes, strides, dtypes, devices and
# requires_grad (a repeat call's plan-cache signature reads it); None where there is no entry.
tensor_key = None
# The same module's warm entries (native/warm_entries.h, torch/warm_entries.py): warm_call(q, k, v, keywords)
# answers a repeat call in C or gives None; warm_remember keeps an answer; None where there is no entry.
warm_call = warm_remember = warm_clear = warm_size = None
# tiling_offsets(cu_seqlens): offsets this library made (a document mask's), every sequence non-empty and
# together covering every token; THD calls given them skip the fix-up kernels. None without the module.
tiling_offsets = None

_lock = threading.Lock()
_state: dict = {}  # "library" (the operator, ctypes) or "reason" (str), once decided
_plans: LRUCache = LRUCache(PLAN_CAPACITY // 2)  # config -> torch plan id, or None (the operator declined)
register("cudnn.native.torch_plans", _plans)


def unavailable() -> str | None:
    """Why the operator cannot run here (None: it can). Loads (building once) the library on first call."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    with _lock:
        if not _state:
            try:
                _state["library"] = _load()
            except Exception as error:  # no compiler, headers or GPU torch: the Python path runs
                _state["reason"] = f"native torch operator unavailable: {type(error).__name__}: {error}"
    return _state.get("reason")


def reasons(cfg: AttentionConfig) -> list[str]:
    """Why the operator does not run this cuDNN config (the Python path does); empty when it does."""
    from fusedattn.backends.cudnn.spec import rows_without_keys

    found = []
    if cfg.return_max_logit and cfg.has_sequence_lengths:
        found.append("return_max_logit with sequence lengths (padding masks, THD)")
    if rows_without_keys(cfg):
        found.append("rows without keys (bottom-right causal with Sq > Skv)")
    return found


def _load() -> ctypes.CDLL:
    """The operator library, loaded into torch and (for its C functions) through ctypes, over the core."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device")
    core.library()
    path = build.library_path("torch")
    operator = load_operator(path)
    if operator.fusedattn_torch_init(str(core.path()).encode()) != 0:
        raise RuntimeError(operator.fusedattn_torch_last_error().decode())
    operator.fusedattn_torch_bounds(PLAN_CAPACITY)
    global entry, tensor_key, warm_call, warm_remember, warm_clear, warm_size, tiling_offsets
    module = python_module(path)
    if module is not None:
        from fusedattn.torch import warm_entries

        entry, tensor_key = module.attention, module.tensor_key
        tiling_offsets = getattr(module, "tiling_offsets", None)  # None in a library built before it
        if warm_entries.configure(module):
            warm_call, warm_remember, warm_clear, warm_size = (module.warm_call, module.warm_remember,
                                                               module.warm_clear, module.warm_size)
    return operator


def python_module(path):
    """The library as a Python module (torch_op.cc: `attention`, the operator's entry, and `tensor_key`),
    or None where it was built without Python's headers."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    try:
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(NAME, loader))
        loader.exec_module(module)
    except ImportError:  # no PyInit_ function: torch.ops calls the operator
        return None
    return module


def load_operator(path) -> ctypes.CDLL:
    """The operator library at `path`, loaded into torch (its ops) and through ctypes (its C functions,
    declared here), not yet joined to the core (fusedattn_torch_init)."""
    import torch

    torch.ops.load_library(str(path))
    operator = ctypes.CDLL(str(path))
    operator.fusedattn_torch_plan.restype = ctypes.c_int64
    operator.fusedattn_torch_plan.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                              ctypes.c_double]
    operator.fusedattn_torch_last_error.restype = ctypes.c_char_p
    operator.fusedattn_torch_init.argtypes = [ctypes.c_char_p]
    operator.fusedattn_torch_bounds.restype = ctypes.c_int64
    operator.fusedattn_torch_bounds.argtypes = [ctypes.c_int64]
    operator.fusedattn_torch_sequences.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    operator.fusedattn_torch_sequence_kernel.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_char_p,
                                                         ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64,
                                                         ctypes.c_int64]
    operator.fusedattn_torch_empty_rows_kernel.argtypes = [ctypes.c_int64, ctypes.c_char_p, ctypes.c_int64,
                                                           ctypes.c_char_p, ctypes.c_int64, ctypes.c_int64,
                                                           ctypes.c_int64]
    return operator


def registry_sizes() -> tuple[int, int]:
    """(core plans, torch plans) the libraries hold now (each at most PLAN_CAPACITY)."""
    if unavailable() is not None:
        return 0, 0
    return core.bounds(), _state["library"].fusedattn_torch_bounds(0)


def plan_for(cfg: AttentionConfig, device: int) -> int | None:
    """The torch plan id of a cuDNN config on `device` (registered once), or None when the Python path
    must run it: the operator does not run such configs, or cannot load, or cuDNN cannot rebuild a graph
    from its bytes (a plan served by the frontend's Python engines)."""
    if reasons(cfg) or unavailable() is not None:
        return None
    return _plans.get_or_build(cfg, lambda: _register(cfg, device))


def forget(cfg: AttentionConfig) -> None:
    """Drop a config's plan id (the library evicted it); the next call registers it again."""
    _plans.pop(cfg)


def _core_plan(built, names: tuple, device: int, values: tuple = ()) -> int | None:
    """The core plan of a built graph whose slots are `names`: device buffers but for `values`, which
    pass scalars by value (each slot stated, so its launches can replay)."""
    blob = bytes(built.graph.serialize(as_bytes=True))

    def uid(name: str) -> int:
        if name not in built.tensors:
            return core.UNBOUND
        found = built.tensors[name].get_uid()
        return core.value_slot(found) if name in values else core.buffer_slot(found)

    uids = tuple(map(uid, names))
    registered = core.register(blob, uids, device)
    if isinstance(registered, str):
        _warn(f"cuDNN could not rebuild a graph from its bytes ({registered}); this configuration keeps the "
              "Python launch path")
        return None
    return registered[0]


def _warn(message: str) -> None:
    import warnings

    warnings.warn(f"fusedattn native torch operator: {message}", RuntimeWarning, stacklevel=4)


def _register(cfg: AttentionConfig, device: int) -> int | None:
    from fusedattn.backends.cudnn.graph_cache import get_graph

    extra, values = operands(cfg).graph_names(), operands(cfg).value_names()
    forward = get_graph(cfg, "forward", device)
    forward_plan = _core_plan(forward, FORWARD_SLOTS + extra, device, values)
    backward_plan, bias_grad = -1, False
    if cfg.is_training:
        backward = get_graph(cfg, "backward", device)
        backward_plan = _core_plan(backward, BACKWARD_SLOTS + extra, device, values)
        bias_grad = "dbias" in backward.tensors
    if forward_plan is None or backward_plan is None:
        return None
    stats = "stats" in forward.tensors
    shape = plan_shape(cfg, stats, bias_grad)
    library = _state["library"]
    plan = library.fusedattn_torch_plan(forward_plan, backward_plan, (ctypes.c_int64 * len(shape))(*shape),
                                        len(shape), cfg.scale)
    if plan < 0:
        return None
    if cfg.has_sequence_lengths:
        return plan if _add_sequences(library, plan, cfg, stats) else None
    if cfg.score_mod_key is not None and stats:
        _add_empty_rows(library, plan, cfg)
    return plan


# Compiled empty-rows kernels by (dtype, head dim, training): a few per process.
_EMPTY_ROWS_KERNELS: LRUCache = register("torch.native.empty_rows_kernels", LRUCache(32))


def _empty_rows_kernel(dtype: str, dim: int, training: bool) -> tuple:
    from fusedattn.backends.cudnn import empty_rows_kernel

    return _EMPTY_ROWS_KERNELS.get_or_build((dtype, dim, training), lambda: sequence_plans.compile_kernel(
        empty_rows_kernel.clear_empty_rows, dtype, None, empty_rows_kernel.constants(dim, training),
        {"OUT": None, **empty_rows_kernel.POINTERS}))


def _add_empty_rows(library, plan: int, cfg: AttentionConfig) -> None:
    """Gives a score_mod plan its kernel for rows the mod leaves without keys; where it cannot be compiled
    the operator clears those rows with torch ops (correct, a few launches more)."""
    from fusedattn.backends.cudnn.empty_rows_kernel import ROWS_PER_PROGRAM

    try:
        image, name, warps, shared = _empty_rows_kernel(cfg.dtype, cfg.head_dim_v, cfg.is_training)
    except Exception:  # no Triton for this GPU: the torch ops stay
        return
    if library.fusedattn_torch_empty_rows_kernel(plan, image, len(image), name.encode(), warps, shared,
                                                 ROWS_PER_PROGRAM):
        raise RuntimeError(library.fusedattn_torch_last_error().decode())


def _add_sequences(library, plan: int, cfg: AttentionConfig, stats: bool) -> bool:
    """Makes `plan` a padded or THD plan: its sequence table's shape and its compiled kernels. False
    (the Python path runs the config) where a kernel cannot be compiled for the operator."""
    values = sequence_plans.values(cfg)
    try:
        compiled = sequence_plans.kernels(cfg, stats)
    except Exception as error:  # no Triton for this GPU, or a kernel the launch cannot give what it needs
        _warn(f"the sequence kernels could not be compiled ({type(error).__name__}: {error}); this "
              "configuration keeps the Python launch path")
        return False
    status = library.fusedattn_torch_sequences(plan, (ctypes.c_int64 * len(values))(*values), len(values))
    for which, (image, name, warps, shared) in enumerate(compiled):
        status = status or library.fusedattn_torch_sequence_kernel(plan, which, image, len(image), name.encode(),
                                                                  warps, shared)
    if status:
        raise RuntimeError(library.fusedattn_torch_last_error().decode())
    return True


def plan_shape(cfg: AttentionConfig, stats: bool, bias_grad: bool = False) -> list[int]:
    """The shapes and strides of a config's tensors as fusedattn_torch_plan takes them (torch_op.cc):
    dtype code, sink kind, Hq, stats, out sizes and strides, LSE sizes, then q, k, v sizes, strides and
    gradient strides, all in the caller's base layout (the graphs' BHSD order permuted back); then
    out's permutation to BHSD, the bias (kind, shape, the graph's dims, whether dBias is written),
    whether the forward writes row maxima for max_logit, and the score_mod operands (aux count, scalar
    count, scalar types)."""
    from fusedattn.backends.cudnn.spec import gradient_spec, sdpa_spec
    from fusedattn.layout import layout_spec

    spec = sdpa_spec(cfg)
    order = _FROM_BHSD[layout_spec(cfg.layout).base]
    user = lambda values: [values[axis] for axis in order]  # noqa: E731
    shape = [_SCALAR_TYPES[cfg.dtype], _SINK_KINDS[cfg.softmax], cfg.heads_q, int(stats),
             *user(spec.o.dim), *user(spec.o.stride), cfg.batch, cfg.heads_q, cfg.seqlen_q]
    for role in ("q", "k", "v"):
        tensor = getattr(spec, role)
        shape += [*user(tensor.dim), *user(tensor.stride), *user(gradient_spec(tensor).stride)]
    shape += [order.index(axis) for axis in range(4)]  # the inverse permutation: user layout -> BHSD
    bias = spec.bias is not None
    shape += [_BIAS_KINDS[cfg.bias], *(cfg.bias_shape if bias else (1, 1, 1, 1)),
              *(spec.bias.dim if bias else (1, 1, 1, 1)), int(bias_grad), int(spec.max_logit)]
    extra = operands(cfg)
    types = extra.types()
    return [*shape, len(extra.aux), len(types), *types]
