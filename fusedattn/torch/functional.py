"""fusedattn.torch.attention: validate, describe, select, run (no math here)."""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.overrides import has_torch_function

from fusedattn import settings
from fusedattn.arguments import ENV_THD_BUCKET, TensorMeta, host_slopes
from fusedattn.backends.cudnn.native import torch_plans
from fusedattn.backends.cudnn.spec import ALIGNMENT
from fusedattn.config import AttentionConfig
from fusedattn.frontend_common import (
    TENSOR_ARGUMENTS,
    AttentionResult,
    check_unread_offsets,
    guard_inputs,
    on_backend_only,
    pick_outputs,
    poisoned,
    prepare_call,
    slopes_are_standard,
)
from fusedattn.layout import split_packed
from fusedattn.score_mods.core import ScoreMod, as_score_mod, bind, needs_gradient
from fusedattn.selection import ENV_BACKEND, recall_call, remember_call
from fusedattn.torch.autograd import run_attention
from fusedattn.torch.ops import config_of, register_config
from fusedattn.xp.torch_ops import OPS

__all__ = ["attention", "explain"]

API = "fusedattn.torch.attention"


def _meta(x, name: str) -> TensorMeta | None:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{API}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    return TensorMeta(tuple(x.shape), OPS.dtype_name(x), str(x.device), x.device.type)


def _unaligned(**tensors) -> tuple[str, ...]:
    """Names of the GPU tensors whose address is not a multiple of ALIGNMENT bytes (cuDNN copies those)."""
    return tuple(name for name, x in tensors.items()
                 if isinstance(x, torch.Tensor) and x.is_cuda and x.data_ptr() % ALIGNMENT)


def _dropout_state(seed, offset, like: torch.Tensor):
    """(seed, offset) as int64 tensors on q's device; a missing seed is drawn from torch's RNG."""
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
    for name, value in (("dropout_seed", seed), ("dropout_offset", offset)):
        if not (isinstance(value, int) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                           and not value.is_floating_point())):
            raise ValueError(f"{API}: {name}: expected an int or a one-element integer tensor, got {value!r}")
    return _device_scalar(seed, like.device), _device_scalar(offset, like.device)


def _device_scalar(value, device: torch.device) -> torch.Tensor:
    """An int64 scalar tensor on `device`. A host value is filled in by a kernel, not copied: a copy from
    pageable memory would make the warm path wait for the device."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to(device=device, dtype=torch.int64).reshape(())
    return torch.full((), int(value), dtype=torch.int64, device=device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    layout: str = "bshd",
    mask: str = "none",
    window: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    bias_type: str | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softmax_type: str = "vanilla",
    sink: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | torch.Tensor | None = None,
    dropout_offset: int | torch.Tensor = 0,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    deterministic: bool = False,
    return_lse: bool = False,
    return_max_logit: bool = False,
    backend: str | None = None,
    score_mod: Callable | ScoreMod | None = None,
    score_mod_bprop: Callable | None = None,
    score_mod_tensors: dict | None = None,
    score_mod_bprop_tensors: dict | None = None,
):
    """Scaled-dot-product attention, forward and backward, on the best backend for the call.

    Args:
        q, k, v: tensors in `layout`. Packed layouts take fewer: `bs3hd`/`sb3hd`/`t3hd`
            take one qkv tensor as `q`; `bshd_bs2hd`/`sbhd_sb2hd`/`thd_t2hd` take q and a
            packed kv as `k`. Shapes: bshd (B, S, H, D), sbhd (S, B, H, D), bhsd (B, H, S, D),
            thd (T, H, D) with T packed tokens. k and v may have fewer heads (GQA/MQA)
            and v its own head dim Dv.
        layout: one of bshd, sbhd, bhsd, thd, bs3hd, sb3hd, t3hd, bshd_bs2hd, sbhd_sb2hd, thd_t2hd.
        mask: none, causal (top-left diagonal), causal_bottom_right, padding, padding_causal,
            padding_causal_bottom_right. Padding masks take per-sequence lengths from
            cu_seqlens_q/kv; THD layouts always mask padding ('causal' means 'padding_causal').
        window: (left, right) keys visible before/after the diagonal, -1 = unbounded.
            The diagonal is top-left for causal and padding_causal, bottom-right otherwise.
        bias: tensor broadcastable to (B|1, Hq|1, Sq, Skv), added after scaling
            (bias_type 'post_scale', the default) or before ('pre_scale'); has a gradient.
        alibi_slopes: (Hq,) or (B, Hq) ALiBi slopes: adds -slope * |i - j| (diagonal-aligned); a tensor, or a
            list/tuple/NumPy array such as fusedattn.standard_alibi_slopes(Hq).
        softmax_type: 'vanilla', 'off_by_one' (an extra zero logit in the denominator) or
            'learnable' (per-head `sink` logits of shape (Hq,), with gradient).
        dropout_p: probability of dropping an attention weight. The mask comes from
            (dropout_seed, dropout_offset); the same pair gives the same mask in forward and
            backward. A missing seed is drawn from torch's global generator.
        scale: multiplies q k^T; default 1/sqrt(D).
        cu_seqlens_q/kv: (B+1,) int32/int64 cumulative sequence lengths (THD and padding masks).
            Their values are checked (one host read) unless they are on the GPU and both
            max_seqlen_q and max_seqlen_kv are given: then they are trusted, as in FlashAttention.
        cu_seqlens_q/kv_padded: (B+1,) start offsets of each sequence in the packed tensor
            when sequences are stored with gaps (THD only).
        max_seqlen_q/kv: longest sequence (THD); computed from cu_seqlens when omitted.
        deterministic: ask for a bitwise-reproducible backward.
        return_lse, return_max_logit: return an AttentionResult(out, lse, max_logit).
        backend: force one backend by name; its reasons raise if it cannot run the call.
        score_mod: rewrites the scaled scores inside the kernel: a built-in from
            fusedattn.score_mods (softcap, alibi, ...) or a callback score_mod(graph, score,
            tensors) -> tensor that builds cuDNN graph ops on score (B, Hq, Sq, Skv). It runs
            before a post-scale bias and ALiBi are added and before the masks. Scores it sets to
            score_mods.MASKED are masked; a row with no visible key gives 0.
        score_mod_bprop: callback (graph, dscore, tensors) -> tensor: the derivative of
            score_mod applied to dLoss/d(its output). Omit it only when score_mod adds terms
            or masks (derivative 1); anything nonlinear in score needs one.
        score_mod_tensors, score_mod_bprop_tensors: {name: tensor | number} for the callbacks
            (one shared dict). Tensors broadcast to (B, Hq, Sq, Skv), live on q's device and get
            no gradient; numbers are passed by value, so changing one never rebuilds a graph.

    Returns:
        The output in q's layout (B, S, Hq, Dv) etc., or an AttentionResult.

    Example:
        >>> q = k = v = torch.randn(2, 128, 8, 64)
        >>> out = attention(q, k, v, mask="causal")
    """
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        # a list such as fusedattn.standard_alibi_slopes(Hq), or a NumPy array
        alibi_slopes = torch.as_tensor(host_slopes(f"{API}: alibi_slopes", alibi_slopes), device=q.device)
    compiling = torch.compiler.is_compiling()
    if score_mod is not None and compiling:
        return _score_mod_call_outside_graph(
            q, k, v, layout=layout, mask=mask, window=window, bias=bias, bias_type=bias_type,
            alibi_slopes=alibi_slopes, softmax_type=softmax_type, sink=sink, dropout_p=dropout_p,
            dropout_seed=dropout_seed, dropout_offset=dropout_offset, scale=scale, cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_kv=cu_seqlens_kv, cu_seqlens_q_padded=cu_seqlens_q_padded,
            cu_seqlens_kv_padded=cu_seqlens_kv_padded, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            deterministic=deterministic, return_lse=return_lse, return_max_logit=return_max_logit,
            backend=backend, score_mod=score_mod, score_mod_bprop=score_mod_bprop,
            score_mod_tensors=score_mod_tensors, score_mod_bprop_tensors=score_mod_bprop_tensors)
    mod = None
    if not (score_mod is None and score_mod_bprop is None and score_mod_tensors is None
            and score_mod_bprop_tensors is None):
        mod = as_score_mod(API, score_mod, score_mod_bprop, score_mod_tensors, score_mod_bprop_tensors)
    if compiling and mod is None:
        return _compiled_attention(
            (q, k, v, bias, alibi_slopes, sink, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
             cu_seqlens_kv_padded),
            dict(layout=layout, mask=mask, window=tuple(window) if window is not None else None, bias_type=bias_type,
                 softmax_type=softmax_type, dropout_p=dropout_p, scale=scale, max_seqlen_q=max_seqlen_q,
                 max_seqlen_kv=max_seqlen_kv, deterministic=deterministic, return_lse=return_lse,
                 return_max_logit=return_max_logit),
            backend, dropout_seed, dropout_offset)
    offsets = (cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded, cu_seqlens_kv_padded)
    # Offsets on a GPU with both max lengths given are trusted, as FlashAttention trusts them:
    # reading their values back would stall the GPU queue on every call.
    given = not (cu_seqlens_q is None and cu_seqlens_kv is None and cu_seqlens_q_padded is None
                 and cu_seqlens_kv_padded is None)
    trusted = given and (max_seqlen_q is not None and max_seqlen_kv is not None
                         and all(x is None or (isinstance(x, torch.Tensor) and x.is_cuda) for x in offsets))
    # ALiBi slopes decide the config (cuDNN's built-in ALiBi has the paper's slopes only), so
    # calls with slopes read their values every time and take the full path; so do offsets whose
    # values are checked.
    signature = None if alibi_slopes is not None or (given and not trusted) else _signature(
        (q, k, v, bias, sink, *offsets) if trusted else (q, k, v, bias, sink),
        (layout, mask, window, bias_type, softmax_type, dropout_p, scale, max_seqlen_q, max_seqlen_kv, deterministic,
         return_lse, return_max_logit, backend),
        None if mod is None else (id(score_mod), id(score_mod_bprop), tuple(score_mod_tensors or ()),
                                  tuple(score_mod_bprop_tensors or ())))
    planned = None
    if signature is not None and not _explaining.get():
        try:
            planned = recall_call(signature)
        except TypeError:  # unhashable options: the full path explains them
            signature = None
    bound = None
    if planned is not None and mod is not None:
        if needs_gradient(mod):  # tensors that learn take the full path (see prepare_call)
            planned = None
        else:
            # The signature only names the callbacks: bind this call's values and trust the
            # plan only if the callbacks still build what it was made for.
            bound = bind(API, mod, batch=planned[0].batch, heads_q=planned[0].heads_q,
                         seqlen_q=planned[0].seqlen_q, seqlen_kv=planned[0].seqlen_kv, device=str(q.device),
                         training=planned[0].is_training)
            if bound.key != planned[0].score_mod_key:
                planned = bound = None
    if planned is not None:  # seen before: already validated, configured and selected
        cfg, selection, native = planned
        if native is not None and mod is None:  # the warm path: one operator call, autograd in C++
            return _native_call(native, signature, planned, q, k, v, sink, dropout_seed, dropout_offset)
        arrays = (*split_packed(cfg.layout, [x for x in (q, k, v) if x is not None]), bias, alibi_slopes, sink,
                  *offsets)
    else:
        tensors = {"q": q, "k": k, "v": v, "bias": bias, "alibi_slopes": alibi_slopes, "sink": sink,
                   "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_kv": cu_seqlens_kv,
                   "cu_seqlens_q_padded": cu_seqlens_q_padded, "cu_seqlens_kv_padded": cu_seqlens_kv_padded}
        differentiable = [x for x in (q, k, v, bias, alibi_slopes, sink) if isinstance(x, torch.Tensor)]
        # One host read of the offsets checks their values and fills missing max lengths.
        call = prepare_call(
            API, "torch", tensors, describe=_meta, host_copy=(lambda x: None) if trusted else OPS.to_host,
            is_training=torch.is_grad_enabled() and (any(x.requires_grad for x in differentiable)
                                                     or (mod is not None and needs_gradient(mod))),
            bias_requires_grad=isinstance(bias, torch.Tensor) and bias.requires_grad, backend=backend,
            layout=layout, mask=mask, window=window, bias_type=bias_type, softmax_type=softmax_type,
            dropout_p=dropout_p, scale=scale, max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv,
            deterministic=deterministic, return_lse=return_lse, return_max_logit=return_max_logit,
            score_mod=mod, unaligned=_unaligned(q=q, k=k, v=v, bias=bias, sink=sink),
            alibi_standard=isinstance(alibi_slopes, torch.Tensor)
            and slopes_are_standard(OPS.to_host(alibi_slopes.float())),
        )
        cfg, selection, arrays, bound = call
        if _explaining.get():
            return _Configured(cfg)
        native = _native_plan(cfg, selection, q) if mod is None else None
        if signature is not None:
            remember_call(signature, (cfg, selection, native))
        if native is not None:
            return _native_call(native, signature, (cfg, selection, native), q, k, v, sink, dropout_seed,
                                dropout_offset)
    check = None
    if trusted:  # their values were not read: checked on the device
        passed = tuple(x for x in (q, k, v) if x is not None)
        check = check_unread_offsets(cfg, passed, dict(zip(TENSOR_ARGUMENTS[6:], offsets)))
        arrays = guard_inputs(cfg, passed, arrays, check)
    seed = offset = None
    if cfg.dropout_p > 0.0:
        seed, offset = _dropout_state(dropout_seed, dropout_offset, q)
    out, lse, max_logit = run_attention(cfg, selection.backend, bound, (*arrays, seed, offset))
    return pick_outputs(cfg, *(poisoned(check, x) for x in (out, lse, max_logit)))


# explain(): the call goes through attention's own cold path and stops once it is configured.
_explaining: contextvars.ContextVar = contextvars.ContextVar("fusedattn_torch_explaining", default=False)


class _Configured(NamedTuple):
    cfg: AttentionConfig


def explain(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, **kwargs) -> str:
    """The selection table for `attention(q, k, v, **kwargs)`: the call as selection sees it, the backend
    it would run on, and every other backend's reasons. Runs nothing; bad arguments raise as in
    `attention`. The same keywords as `attention`.

    Example:
        >>> q = k = v = torch.randn(2, 128, 8, 64)
        >>> print(explain(q, k, v, mask="causal"))
    """
    from fusedattn.selection import NoBackendError
    from fusedattn.selection import explain as explain_config

    token = _explaining.set(True)
    try:
        configured = attention(q, k, v, **kwargs)
    except NoBackendError as error:  # the table says why, and names the forced backend if any
        return explain_config(error.cfg, kwargs.get("backend"))
    finally:
        _explaining.reset(token)
    return explain_config(configured.cfg, kwargs.get("backend"))


def _native_plan(cfg, selection, q) -> int | None:
    """The native operator's plan for a cuDNN call (registered once per config), or None: the Python
    path runs it (another backend, a feature the operator does not run, or no native library here)."""
    return _native_plan_on(cfg, selection.name, q.device)


def _native_plan_on(cfg, backend_name: str, device: torch.device) -> int | None:
    if backend_name != "cudnn" or device.type != "cuda":
        return None
    return torch_plans.plan_for(cfg, device.index if device.index is not None else torch.cuda.current_device())


def _native_call(plan: int, signature, planned, q, k, v, sink, dropout_seed, dropout_offset):
    """The call through the native operator fusedattn_native.attention (see backends/cudnn/native)."""
    cfg = planned[0]
    if v is None:  # a packed layout: views of the pack
        q, k, v = split_packed(cfg.layout, [x for x in (q, k) if x is not None])
    seed = offset = None
    if cfg.dropout_p > 0.0:
        seed, offset = _dropout_state(dropout_seed, dropout_offset, q)
    try:
        out, lse = _operator(plan, q, k, v, sink, seed, offset)
    except RuntimeError as error:
        if "is not registered in this process" not in str(error):
            raise
        torch_plans.forget(cfg)  # the library's bounded registry dropped it
        plan = _native_plan(cfg, planned[1], q)
        if signature is not None:
            remember_call(signature, (*planned[:2], plan))
        if plan is None:
            raise
        out, lse = _operator(plan, q, k, v, sink, seed, offset)
    return pick_outputs(cfg, out, lse, None)


def _operator(plan: int, q, k, v, sink, seed, offset):
    """(out, lse) from the native operator: through the library's Python entry where it has one and no
    tensor overrides torch functions (those go through torch.ops, which honours them)."""
    entry = torch_plans.entry
    if entry is not None and not has_torch_function((q, k, v, sink)):
        return entry(plan, q, k, v, sink, seed, offset)
    return torch.ops.fusedattn_native.attention.default(plan, q, k, v, sink, seed, offset)


def _signature(tensors: tuple, options: tuple, score_mod):
    """A summary of a call that fixes its config and selection (hashable when its options are), or
    None when arguments are not what they should be (the full path explains those). Options count
    with their types (and a window's items with theirs), so window=(2.0, 0) never shares the plan
    of (2, 0): one is valid, the other is not. score_mod: the callbacks' identities and aux names;
    a caller using the summary checks their structural key. Flat, as a repeat call builds it every
    time."""
    try:
        window = options[2]
        return (*[None if x is None else (x.shape, x.dtype, x.device, x.requires_grad) for x in tensors],
                options, tuple(map(type, options)), None if window is None else tuple(map(type, window)),
                score_mod, torch.is_grad_enabled(), settings.value(ENV_BACKEND), settings.value(ENV_THD_BUCKET))
    except (TypeError, AttributeError):  # not tensors, or a window that is no sequence: the full path explains
        return None


# ---------------------------------------------------------------- under torch.compile

SCORE_MOD_GRAPH_BREAK = (
    "fusedattn.torch.attention with a score_mod runs eagerly inside a compiled model (one graph break): its "
    "callbacks build cuDNN graphs in Python and its aux tensors and scalars are bound per call. Compile with "
    "fullgraph=False; everything around the call still compiles.")


def _score_mod_call_outside_graph(*args, **kwargs):
    return attention(*args, **kwargs)


_score_mod_call_outside_graph = torch.compiler.disable(_score_mod_call_outside_graph, reason=SCORE_MOD_GRAPH_BREAK)


@torch._dynamo.assume_constant_result
def _compile_time_plan(described: tuple, options: tuple, backend, grad_enabled: bool) -> str:
    """Validate, configure and select at trace time, from shapes alone; return the op's config key.

    Dynamo runs this once per distinct call and bakes the key into the graph as a constant.
    """
    options = dict(options)
    stand_ins, metas = {}, {}
    for name, entry in zip(TENSOR_ARGUMENTS, described):
        if entry is None:
            stand_ins[name] = None
            continue
        shape, dtype, device, requires_grad = entry
        stand_ins[name] = torch.empty(shape, dtype=dtype, device="meta").requires_grad_(requires_grad)
        metas[name] = TensorMeta(tuple(shape), OPS.dtype_name(stand_ins[name]), str(device), device.type)
    offsets_given = any(stand_ins[n] is not None for n in TENSOR_ARGUMENTS[6:])
    if offsets_given and (options["max_seqlen_q"] is None or options["max_seqlen_kv"] is None):
        raise ValueError(f"{API}: max_seqlen_q/max_seqlen_kv: expected ints under torch.compile (the offsets' "
                         "values cannot be read while tracing), got None")
    differentiable = [stand_ins[n] for n in TENSOR_ARGUMENTS[:6] if stand_ins[n] is not None]
    cfg, selection, _, _ = prepare_call(
        API, "torch", stand_ins, describe=lambda x, name: metas.get(name), host_copy=lambda x: None,
        is_training=grad_enabled and any(x.requires_grad for x in differentiable),
        bias_requires_grad=bool(stand_ins["bias"] is not None and stand_ins["bias"].requires_grad),
        backend=backend, score_mod=None, **options,
    )
    return register_config(cfg, selection.name)


@torch._dynamo.assume_constant_result
def _compile_time_native(key: str, device: torch.device) -> int:
    """The native operator's plan for a compiled call (registered while tracing, as eager calls register
    theirs), or -1: the call runs as the Python custom op. Dynamo bakes the id into the graph."""
    from fusedattn.torch.ops import backend_of

    plan = _native_plan_on(config_of(key), backend_of(key), device)
    return -1 if plan is None else plan


def _compiled_attention(tensors: tuple, options: dict, backend, dropout_seed, dropout_offset):
    described = tuple(None if x is None else (tuple(x.shape), x.dtype, x.device, x.requires_grad) for x in tensors)
    key = _compile_time_plan(described, tuple(options.items()), backend, torch.is_grad_enabled())
    q, k, v = tensors[:3]
    passed = tuple(x for x in (q, k, v) if x is not None)
    unpacked = split_packed(options["layout"], passed)
    arrays, check = (*unpacked, *tensors[3:]), None
    if any(x is not None for x in tensors[6:]):  # offsets are never read while compiling: checked on the device
        cfg = config_of(key)
        check = check_unread_offsets(cfg, passed, dict(zip(TENSOR_ARGUMENTS[6:], tensors[6:])))
        arrays = guard_inputs(cfg, passed, arrays, check)
    seed = offset = None
    if options["dropout_p"] > 0.0:
        seed = (torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=q.device) if dropout_seed is None
                else torch.as_tensor(dropout_seed, dtype=torch.int64, device=q.device))
        offset = torch.as_tensor(dropout_offset, dtype=torch.int64, device=q.device)
    native = _compile_time_native(key, q.device)
    if native >= 0:  # the eager warm path's operator, its autograd traced by AOTAutograd
        out, lse = torch.ops.fusedattn_native.attention.default(native, *unpacked, tensors[5], seed, offset)
        max_logit = None
    else:
        out, lse, max_logit = (poisoned(check, x)
                               for x in torch.ops.fusedattn.attention_fwd(key, *arrays, seed, offset))
    if not (options["return_lse"] or options["return_max_logit"]):
        return out
    return AttentionResult(out, lse if options["return_lse"] else None,
                           max_logit if options["return_max_logit"] else None)


def small_seq_attention(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, **kwargs):
    """`attention(...)` on the small_seq backend only: one query per sequence, a few keys.

    The same keywords as `attention`. Use it to insist on the kernel (for example in a
    benchmark); when the call is outside what it runs, the error lists its reasons.
    Plain `attention` already picks small_seq for these shapes.
    """
    return on_backend_only("small_seq_attention", attention, "small_seq", q, k, v, kwargs)
