"""fusedattn.torch.attention: validate, describe, select, run (no math here)."""

from __future__ import annotations

import contextvars
import functools
import operator
import types
from typing import NamedTuple

import torch
from torch.overrides import has_torch_function

from fusedattn import settings
from fusedattn.arguments import ENV_THD_BUCKET, TensorMeta, host_slopes
from fusedattn.backends.cudnn.native import torch_plans
from fusedattn.backends.cudnn.spec import ALIGNMENT
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig
from fusedattn.frontend_common import (
    TENSOR_ARGUMENTS,
    AttentionResult,
    call_as_thd,
    check_unread_offsets,
    dense_result,
    documents_possible,
    guard_inputs,
    on_backend_only,
    pick_outputs,
    poisoned,
    prepare_call,
    slopes_are_standard,
    thd_keywords,
)
from fusedattn.layout import dense_to_tokens, split_packed
from fusedattn.options import (
    DROPOUT_NAMES,
    SCORE_MOD_NAMES,
    SETTINGS,
    TENSORS,
    check_keywords,
    describe_arguments,
    names,
)
from fusedattn.options import settings as settings_of
from fusedattn.score_mods.builtins import flex_keywords
from fusedattn.score_mods.core import ScoreMod, as_score_mod, bind, needs_gradient
from fusedattn.score_mods.flex import PartialMask
from fusedattn.score_mods.mask_rewrite import rewrite_mask
from fusedattn.selection import ENV_BACKEND, forget_calls, recall_call, remember_call
from fusedattn.torch import (
    compiled_score_mods,
    mask_rewrites,
    rows_with_keys,
    score_mod_bindings,
    trace_time,
    warm_entries,
)
from fusedattn.torch import documents as documents_thd
from fusedattn.torch.autograd import run_attention
from fusedattn.torch.ops import backend_of, config_of, register_config
from fusedattn.xp.torch_ops import OPS

__all__ = ["attention", "explain"]

API = "fusedattn.torch.attention"
_KEYWORDS = names("torch")
_SCORE_MOD_KEYWORDS = frozenset(SCORE_MOD_NAMES)
_SIGNED = frozenset((*SETTINGS, "backend"))  # what a call's plan-cache signature holds besides tensors
# A call whose keywords are all among these looks its plan up first (attention's warm path): settings,
# dropout state and score_mods (a mask_mod is rewritten first: see _MASK_WARM_KEYWORDS).
_WARM_KEYWORDS = _SIGNED | (_KEYWORDS & frozenset(DROPOUT_NAMES)) | (_SCORE_MOD_KEYWORDS - {"mask_mod"})
_MASK_WARM_KEYWORDS = _WARM_KEYWORDS | {"mask_mod"}  # and with a mask_mod whose rewrite is kept (mask_rewrites)


def _meta(x, name: str) -> TensorMeta | None:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{API}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    return TensorMeta(tuple(x.shape), OPS.dtype_name(x), str(x.device), x.device.type)


def _check_dense(tensors: dict) -> None:
    """ValueError for a nested or sparse tensor argument: every backend reads dense strided memory."""
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and (x.is_nested or x.layout != torch.strided):
            got = (f"a {str(x.layout).removeprefix('torch.')} tensor" if not x.is_nested else
                   "a nested tensor (sequences of different lengths go as layout='thd' with cu_seqlens_q/kv, "
                   "or padded with a padding mask)")
            raise ValueError(f"{API}: {name}: expected a dense (strided) torch.Tensor, got {got}")


def _unaligned(**tensors) -> tuple[str, ...]:
    """Names of the GPU tensors whose address is not a multiple of ALIGNMENT bytes (cuDNN copies those)."""
    return tuple(name for name, x in tensors.items()
                 if isinstance(x, torch.Tensor) and x.is_cuda and x.data_ptr() % ALIGNMENT)


def _strides(q, k, v) -> tuple | None:
    """The strides of q, k, v as passed (tensors, or their strides); the config keeps them where they
    are not contiguous. None for a packed layout (its own strides say how q, k, v lie)."""
    if q is None or k is None or v is None:
        return None
    strides = tuple(tuple(x.stride()) if isinstance(x, torch.Tensor) else x for x in (q, k, v))
    return strides if all(isinstance(x, tuple) for x in strides) else None


def _dropout_state(seed, offset, like: torch.Tensor):
    """(seed, offset) as int64 tensors on q's device; a missing seed is drawn from torch's RNG."""
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (), dtype=torch.int64))
    _check_dropout_state(seed, offset)
    return _device_scalar(seed, like.device), _device_scalar(offset, like.device)


def _check_dropout_state(seed, offset) -> None:
    """Eager and compiled calls alike: an int (symbolic under torch.compile where it changed) or a
    one-element integer tensor, each."""
    for name, value in (("dropout_seed", seed), ("dropout_offset", offset)):
        if not (isinstance(value, (int, torch.SymInt)) or (isinstance(value, torch.Tensor) and value.numel() == 1
                                                           and not value.is_floating_point())):
            got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
                   else repr(value))  # (no tensor repr: a compiled call cannot make one)
            raise ValueError(f"{API}: {name}: expected an int or a one-element integer tensor, got {got}")
        if isinstance(value, int) and not -2**63 <= value < 2**63:  # an int64 on the device
            raise ValueError(f"{API}: {name}: expected an int that fits in int64, got {value}")


def _device_scalar(value, device: torch.device) -> torch.Tensor:
    """An int64 scalar tensor on `device`. A host value is filled in by a kernel, not copied: a copy from
    pageable memory would make the warm path wait for the device."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.to(device=device, dtype=torch.int64).reshape(())
    return torch.full((), int(value), dtype=torch.int64, device=device)


def attention(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, **options):
    """Scaled-dot-product attention, forward and backward, on the best backend for the call.

    Args:
        q, k, v: tensors in `layout` (see below); packed layouts take fewer.
        {options}

    Returns:
        The output in q's layout (B, S, Hq, Dv) etc., or an AttentionResult.

    Example:
        >>> q = k = v = torch.randn(2, 128, 8, 64)
        >>> out = attention(q, k, v, mask="causal")
    """
    compiling = torch.compiler.is_compiling()
    warm_call = torch_plans.warm_call
    if warm_call is not None and not compiling and not _explaining.get():  # a repeat call answered in C
        out = warm_call(q, k, v, options)
        if out is not None:
            return out if type(out) is not tuple else AttentionResult(*out)
    given_options = options
    mod = options.get("score_mod")
    if type(mod) is ScoreMod and mod.flex and not compiling:
        # a built-in in flex form: its score_mod and mask_mod (compiled, it stays a ScoreMod of numbers,
        # whose closures Dynamo need not see: compiled_score_mods)
        options = flex_keywords(options)
    # A call without tensor options (settings and maybe a score_mod) looks its plan up before anything
    # else is read: the warm path of most calls. One with a mask_mod too, once its rewrite is known
    # (mask_rewrites). Any other call, and any miss, goes on below.
    eager = not compiling and not _explaining.get()
    warm = eager and _WARM_KEYWORDS.issuperset(options)
    rewrite_key = signature = documents = None
    if eager and not warm and options.get("mask_mod") is not None and _MASK_WARM_KEYWORDS.issuperset(options):
        rewrite_key = _signature(q, k, v, None, None, (), options, _score_mod_names(_mod_keywords(options)))
        rewritten = mask_rewrites.recall(rewrite_key, options)
        if (rewritten is not None and rewritten[2] is not None and options.get("score_mod") is not None
                and not documents_possible(options, "torch", q.device)):
            rewritten = None  # its score_mod reads b, a position or a tensor that learns now: no longer THD's
        if rewritten is not None:
            options, signature, documents = rewritten  # a document mask runs as THD below
            warm = documents is None
    if warm:
        mods = _mod_keywords(options)
        has_mod = mods is not None
        if signature is None:
            signature = _signature(q, k, v, None, None, (), options, _score_mod_names(mods) if has_mod else None)
        if has_mod:  # the binding carries its plan
            binding = _kept_binding(signature, mods)
            if binding is not None:
                out = _kept_call(binding, signature, q, k, v, None, None, options)
                warm_entries.remember(q, k, v, given_options, binding.planned[0], binding.planned[2], binding, mods)
                return out
        signature, planned = _recalled(signature)
        if planned is not None and planned[2] is not None and not has_mod:
            out = _native_call(planned[2], signature, planned, q, k, v, None, None, None, options)
            warm_entries.remember(q, k, v, given_options, planned[0], planned[2])
            return out
    if not _KEYWORDS.issuperset(options):
        check_keywords(API, options, "torch")
    get = options.get
    alibi_slopes = get("alibi_slopes")
    if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
        # a list such as fusedattn.standard_alibi_slopes(Hq), or a NumPy array
        slopes = host_slopes(f"{API}: alibi_slopes", alibi_slopes, getattr(q, "dtype", None))
        if slopes is None:
            raise ValueError(f"{API}: alibi_slopes: expected a tensor, list or NumPy array of (Hq,) or (B, Hq) "
                             f"slopes, got {type(alibi_slopes).__name__}")
        alibi_slopes = options["alibi_slopes"] = torch.as_tensor(slopes, device=q.device)
    before_rewrite = options
    if (documents is None and get("mask_mod") is not None and not compiling
            and not isinstance(get("mask_mod"), PartialMask)):  # (a PartialMask is what a rewrite kept)
        options, documents = rewrite_mask("torch", q, k, v, options,
                                          document_ok=documents_possible(options, "torch", q.device))
        get = options.get
        if documents is not None and rewrite_key is not None:
            mask_rewrites.remember(rewrite_key, before_rewrite, options, None, documents)
    if documents is not None:  # rewritten now or kept: the options are this call's own dict
        result = _document_call(q, k, v, options, documents, rewrite_key, given_options)
        if result is not None:
            return result
        options["mask_mod"] = documents.fallback  # ids not sorted: the mask runs in the graph
    mods = _mod_keywords(options)
    has_mod = mods is not None
    if compiling:
        if trace_time.reads_offsets(options, any(get(name) is not None for name in TENSOR_ARGUMENTS[6:])):
            return _offsets_read_outside_graph(q, k, v, **options)
        if has_mod:
            return _compiled_score_mod_attention(q, k, v, options)
        return _compiled_attention(q, k, v, options)
    bias, sink = get("bias"), get("sink")
    offsets = (get("cu_seqlens_q"), get("cu_seqlens_kv"), get("cu_seqlens_q_padded"), get("cu_seqlens_kv_padded"))
    # Offsets on a GPU with both max lengths given are trusted, as FlashAttention trusts them:
    # reading their values back would stall the GPU queue on every call.
    given = not (offsets[0] is None and offsets[1] is None and offsets[2] is None and offsets[3] is None)
    trusted = given and (get("max_seqlen_q") is not None and get("max_seqlen_kv") is not None
                         and all(x is None or (isinstance(x, torch.Tensor) and x.is_cuda) for x in offsets))
    signed = (q, k, v, bias, sink, offsets if trusted else (), options, _score_mod_names(mods) if has_mod else None)
    if not warm:
        # ALiBi slopes decide the config (cuDNN's built-in ALiBi has the paper's slopes only), so
        # calls with slopes read their values every time and take the full path; so do offsets whose
        # values are checked.
        signature, planned = _recalled(
            None if alibi_slopes is not None or (given and not trusted) else _signature(*signed))
        if rewrite_key is not None and documents is None:
            mask_rewrites.remember(rewrite_key, before_rewrite, options, signature)
    # the warm path: one operator call, autograd in C++ (a warm call's binding was looked up above)
    if has_mod:
        binding = None if warm else _kept_binding(signature, mods)
        if binding is not None:
            out = _kept_call(binding, signature, q, k, v, sink, bias, options)
            if rewrite_key is None and not given:
                warm_entries.remember(q, k, v, given_options, binding.planned[0], binding.planned[2], binding, mods)
            return out
    elif planned is not None and planned[2] is not None:
        out = _native_call(planned[2], signature, planned, q, k, v, sink, bias, None, options)
        if rewrite_key is None and not given:
            warm_entries.remember(q, k, v, given_options, planned[0], planned[2])
        return out
    mod = None
    if has_mod:
        mod = as_score_mod(API, *(get(name) for name in SCORE_MOD_NAMES), framework="torch", device=q.device)
    bound = None
    if planned is not None and mod is not None:
        if needs_gradient(mod):  # tensors that learn take the full path (see prepare_call)
            planned = None
        else:
            # The signature only names the callbacks: bind this call's values and trust the
            # plan only if the callbacks still build what it was made for.
            bound = bind(API, mod, batch=planned[0].batch, heads_q=planned[0].heads_q,
                         seqlen_q=planned[0].seqlen_q, seqlen_kv=planned[0].seqlen_kv, device=str(q.device),
                         training=planned[0].is_training, like=q)
            if bound.key != planned[0].score_mod_key:
                planned = bound = None
    if planned is not None:  # seen before: already validated, configured and selected
        cfg, selection, native = planned
        if native is not None:  # the callbacks bind anew (they read other objects now)
            binding = score_mod_bindings.remember(signature, options, bound, torch_plans.operands(cfg), planned)
            return _native_call(native, signature, planned, q, k, v, sink, bias, binding, options)
        arrays = (*split_packed(cfg.layout, [x for x in (q, k, v) if x is not None]), bias, alibi_slopes, sink,
                  *offsets)
    else:
        tensors = {"q": q, "k": k, "v": v, **{name: get(name) for name in TENSORS}}
        _check_dense(tensors)
        differentiable = [x for x in (q, k, v, bias, alibi_slopes, sink) if isinstance(x, torch.Tensor)]
        # One host read of the offsets checks their values and fills missing max lengths.
        call = prepare_call(
            API, "torch", tensors, describe=_meta, host_copy=(lambda x: None) if trusted else OPS.to_host,
            is_training=torch.is_grad_enabled() and (any(x.requires_grad for x in differentiable)
                                                     or (mod is not None and needs_gradient(mod))),
            bias_requires_grad=isinstance(bias, torch.Tensor) and bias.requires_grad, backend=get("backend"),
            **settings_of(options), score_mod=mod, unaligned=_unaligned(q=q, k=k, v=v, bias=bias, sink=sink),
            strides=_strides(q, k, v),
            alibi_standard=isinstance(alibi_slopes, torch.Tensor)
            and slopes_are_standard(OPS.to_host(alibi_slopes.float())),
        )
        cfg, selection, arrays, bound, term = call
        if _explaining.get():
            return _Configured(cfg)
        native = _native_plan(cfg, selection, q)
        if signature is not None:
            if type(signature[0]) is not bytes and torch_plans.tensor_key is not None:
                signature = _signature(*signed)  # the library loaded in this call: key it as the next call will
            remember_call(signature, (cfg, selection, native))
        if native is not None:
            binding = None if bound is None and term is None else score_mod_bindings.remember(
                signature, options, bound, torch_plans.operands(cfg), (cfg, selection, native), term)
            # arrays[3]: the bias, or a learning score_mod's added term as one (term, made by prepare_call)
            return _native_call(native, signature, (cfg, selection, native), q, k, v, sink, arrays[3], binding,
                                options)
    check = None
    # Offsets whose values were not read are checked on the device: by the cuDNN backend itself
    # (its sequence table, backends/cudnn/sequences.py), else here.
    if trusted and selection.name != "cudnn":
        passed = tuple(x for x in (q, k, v) if x is not None)
        check = check_unread_offsets(cfg, passed, dict(zip(TENSOR_ARGUMENTS[6:], offsets)))
        arrays = guard_inputs(cfg, passed, arrays, check)
    seed = offset = None
    if cfg.dropout_p > 0.0:
        seed, offset = _dropout_state(get("dropout_seed"), get("dropout_offset", 0), q)
    out, lse, max_logit = run_attention(cfg, selection.backend, bound, (*arrays, seed, offset))
    return pick_outputs(cfg, *(poisoned(check, x) for x in (out, lse, max_logit)))


describe_arguments(attention, "torch")


# A document call whose THD call has a native plan: that call's plan-cache signature, by the dense call's
# signature (its rewrite key: shapes, strides, settings, the mask_mod) and the documents' boundaries
# (kept while the ids are unchanged), so a repeat call goes to the operator without a second attention().
_DOCUMENT_CALLS: LRUCache = register("torch.documents.thd_calls", LRUCache(64))


def _document_call(q, k, v, options: dict, documents, rewrite_key=None, given_options: dict | None = None):
    """The call as THD, one sequence per document (fusedattn.torch.documents); None when the ids are
    not sorted along each row. rewrite_key: the dense call's signature where its rewrite is kept;
    given_options: the call's own keywords, under which a warm call hands its answer to C."""
    found = documents_thd.boundaries(documents.ids, documents.batch, documents.seqlen)
    if found is None:
        return None
    if torch_plans.tiling_offsets is not None and found[0].is_cuda:  # no row for the fix-up kernels
        torch_plans.tiling_offsets(found[0])
    if rewrite_key is None:
        return call_as_thd(attention, q, k, v, options, *found, documents.batch)
    layout = options.get("layout") or "bshd"
    thd = {**options, **thd_keywords(*found)}
    mods = _mod_keywords(options)  # a score_mod beside the documents (or a mask left in the graph)
    kept = _DOCUMENT_CALLS.peek((rewrite_key, id(found)))  # no lock on the hot path, as the bindings
    if kept is not None and kept[0] is found:
        if mods is None:
            binding, (signature, planned) = None, _recalled(kept[1])
        else:  # its operands, bound when it was kept, carry its plan
            binding = _kept_binding(kept[1], mods)
            signature, planned = kept[1], None if binding is None else binding.planned
        if planned is not None and planned[2] is not None:
            if layout == "bshd":  # the operator reads the rows as tokens and answers in this layout
                out = _native_call(planned[2], signature, planned, q, k, v, None, None, binding, thd)
                if given_options is not None:
                    warm_entries.remember(q, k, v, given_options, planned[0], planned[2], binding, mods, documents,
                                          _offsets(planned[0], thd.get))
                return out
            tokens = [dense_to_tokens(x, layout) for x in (q, k, v)]
            return dense_result(_native_call(planned[2], signature, planned, *tokens, None, None, binding, thd),
                                layout, documents.batch)
    tokens = [dense_to_tokens(x, layout) for x in (q, k, v)]
    result = dense_result(attention(*tokens, **thd), layout, documents.batch)
    offsets = found[0]
    if offsets.is_cuda:  # as the THD call keys itself (its offsets are trusted)
        signature = _signature(*tokens, None, None, (offsets, offsets, None, None), thd,
                               None if mods is None else _score_mod_names(mods))
        if signature is not None:
            _DOCUMENT_CALLS.put((rewrite_key, id(found)), (found, signature))
    return result


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


def _native_plan(cfg, selection, q) -> int | rows_with_keys.RowsPlan | None:
    """The native operator's plan for a cuDNN call (registered once per config), or None: the Python
    path runs it (another backend, a feature the operator does not run, or no native library here).
    Bottom-right causal with Sq > Skv: a RowsPlan (the operator runs the rows that see keys)."""
    rows = rows_with_keys.plan(cfg, selection, lambda sub: _native_plan_on(sub, selection.name, q.device))
    return rows if rows is not None else _native_plan_on(cfg, selection.name, q.device)


def _native_plan_on(cfg, backend_name: str, device: torch.device) -> int | None:
    if backend_name != "cudnn" or device.type != "cuda":
        return None
    return torch_plans.plan_for(cfg, device.index if device.index is not None else torch.cuda.current_device())


def _kept_call(binding, signature, q, k, v, sink, bias, options: dict):
    """A repeat call whose score_mod binding was kept: its plan and operands, and a learning added term
    summed anew from its tensors as the plan's bias."""
    if binding.term is not None:
        bias = binding.term(q, bias)
    return _native_call(binding.planned[2], signature, binding.planned, q, k, v, sink, bias, binding, options)


def _native_call(plan, signature, planned, q, k, v, sink, bias, binding, options: dict):
    """The call through the native operator fusedattn_native.attention (see backends/cudnn/native).
    binding: a score_mod's operands (score_mod_bindings), or None. plan: the native plan, or a RowsPlan."""
    if type(plan) is not int:  # rows without keys (never with a score_mod): the others through the operator
        return rows_with_keys.run(plan, planned[0], lambda sub, q, bias: _native_call(
            sub[2], None, sub, q, k, v, sink, bias, None, options), q, bias, sink)
    cfg = planned[0]
    if v is None:  # a packed layout: views of the pack
        q, k, v = split_packed(cfg.layout, [x for x in (q, k) if x is not None])
    seed = offset = None
    if cfg.dropout_p > 0.0:
        seed, offset = _dropout_state(options.get("dropout_seed"), options.get("dropout_offset", 0), q)
    extra = () if binding is None and bias is None else (
        (bias,) if binding is None else (bias, binding.aux, binding.scalars, binding.empty_rows))
    if cfg.has_sequence_lengths:  # the sequence offsets, read on the device
        extra = (*extra, *_PLAIN_OPERANDS[len(extra):-1], _offsets(cfg, options.get))
    try:
        outputs = _operator(plan, q, k, v, sink, seed, offset, *extra)
    except RuntimeError as error:
        if "is not registered in this process" not in str(error):
            raise
        torch_plans.forget(cfg)  # the library's bounded registry dropped it
        score_mod_bindings.forget()  # bindings carry plan ids too
        plan = _native_plan(cfg, planned[1], q)
        if signature is not None:
            remember_call(signature, (*planned[:2], plan))
        else:  # the rows of a RowsPlan (rows_with_keys): the outer call's entry holds the old plan
            forget_calls()
        if plan is None:
            raise
        outputs = _operator(plan, q, k, v, sink, seed, offset, *extra)
    return pick_outputs(cfg, outputs[0], outputs[1], outputs[2] if len(outputs) > 2 else None)


def _operator(plan: int, q, k, v, sink, seed, offset, *extra):
    """[out, lse] (and max_logit where the plan has it) from the native operator: through the library's
    Python entry where it has one and no tensor overrides torch functions (those go through torch.ops,
    which honours them). extra: the operator's trailing operands (bias, aux, scalars, empty_rows,
    offsets), as many as the call has."""
    entry = torch_plans.entry
    if entry is not None and not has_torch_function((q, k, v, sink, *extra[:1], *(extra[1] if extra[1:] else ()),
                                                     *(extra[4] if extra[4:] else ()))):
        return entry(plan, q, k, v, sink, seed, offset, *extra)
    return torch.ops.fusedattn_native.attention.default(plan, q, k, v, sink, seed, offset,
                                                        *extra, *_PLAIN_OPERANDS[len(extra):])


_PLAIN_OPERANDS = (None, [], [], False, [])  # the operator's trailing operands for a call without them


def _offsets(cfg: AttentionConfig, get) -> list:
    """A padded or THD call's offset tensors as the operator takes them: cu_seqlens_q and _kv, then the
    padded offsets where the config has them."""
    names = ("cu_seqlens_q", "cu_seqlens_kv", *(("cu_seqlens_q_padded", "cu_seqlens_kv_padded")
                                                  if cfg.padded_offsets else ()))
    return [get(name) for name in names]


def _signature(q, k, v, bias, sink, offsets: tuple, options: dict, score_mod):
    """A summary of a call that fixes its config and selection (hashable when its options are), or
    None when arguments are not what they should be (the full path explains those). Settings count
    with their types (and a window's items with theirs), so window=(2.0, 0) never shares the plan
    of (2, 0): one is valid, the other is not. offsets: the trusted sequence offsets, or (). score_mod:
    the callbacks' identities and aux names; a caller using the summary checks their structural key."""
    key = torch_plans.tensor_key or _tensor_key
    tensors = key(q, k, v, bias, sink, *offsets)
    if tensors is None:
        return None
    try:
        signed = options if _SIGNED.issuperset(options) else {
            name: value for name, value in options.items() if name in _SIGNED}
        window = signed.get("window")
        return (tensors, tuple(signed.items()), tuple(map(type, signed.values())),
                None if window is None else tuple(map(type, window)),
                score_mod, torch.is_grad_enabled(), settings.value(ENV_BACKEND), settings.value(ENV_THD_BUCKET))
    except TypeError:  # a window that is no sequence: the full path explains
        return None


def _tensor_key(*tensors) -> tuple | None:
    """Each tensor's shape, strides, dtype, device and requires_grad (None for a missing one), or None
    where one is no strided tensor: what the native library's tensor_key gives, where it is not loaded."""
    try:
        return tuple([None if x is None else (x.shape, x.stride(), x.dtype, x.device, x.requires_grad)
                      for x in tensors])
    except (TypeError, AttributeError, RuntimeError):  # not tensors, or sparse ones (no strides)
        return None


def _recalled(signature) -> tuple:
    """(signature, what was remembered for it or None: always None while explain() runs, which goes the
    full way). The signature becomes None where it cannot be a key (unhashable options: the full path
    explains them)."""
    if signature is None or _explaining.get():
        return signature, None
    try:
        return signature, recall_call(signature)
    except TypeError:
        return None, None


def _kept_binding(signature, mods: tuple):
    """The score_mod binding kept for this call (score_mod_bindings), or None (also where the signature
    cannot be a key: the full path explains its options)."""
    if signature is None:
        return None
    try:
        return score_mod_bindings.recall(signature, mods)
    except TypeError:
        return None


_IS_GIVEN = functools.partial(operator.is_not, None)


def _mod_keywords(options: dict) -> tuple | None:
    """The score_mod keywords' values in SCORE_MOD_NAMES' order, or None where the call has no score_mod
    callbacks or tensors (a keyword given as None does not count)."""
    if _SCORE_MOD_KEYWORDS.isdisjoint(options):
        return None
    given = tuple(map(options.get, SCORE_MOD_NAMES))
    return given if any(map(_IS_GIVEN, given)) else None


_MOD, _BPROP, _MOD_TENSORS, _BPROP_TENSORS, _MASK_MOD = map(SCORE_MOD_NAMES.index, (
    "score_mod", "score_mod_bprop", "score_mod_tensors", "score_mod_bprop_tensors", "mask_mod"))


def _score_mod_names(given: tuple) -> tuple:
    """The score_mod part of a signature (given: _mod_keywords'): who the callbacks are (a function by its
    code: score_mod_bindings.signature_part) and their tensors' names."""
    who = score_mod_bindings.signature_part
    mod, bprop, mask_mod = given[_MOD], given[_BPROP], given[_MASK_MOD]
    return (None if mod is None else who(mod), None if bprop is None else who(bprop),
            tuple(given[_MOD_TENSORS] or ()), tuple(given[_BPROP_TENSORS] or ()),
            None if mask_mod is None else who(mask_mod))


# ---------------------------------------------------------------- under torch.compile

def _eager_call_behind_graph_break(reason: str):
    """`attention` run eagerly inside a compiled function: one graph break, whose reason fullgraph=True shows."""
    def eager_call(*args, **kwargs):
        return attention(*args, **kwargs)
    return torch.compiler.disable(eager_call, reason=reason)


_score_mod_call_outside_graph = _eager_call_behind_graph_break(compiled_score_mods.GRAPH_BREAK)
_offsets_read_outside_graph = _eager_call_behind_graph_break(trace_time.OFFSETS_READ_BREAK)
_score_mod_call_without_native_operator = _eager_call_behind_graph_break(compiled_score_mods.NO_NATIVE_BREAK)


def _compiled_score_mod_attention(q, k, v, given: dict):
    """A score_mod call in a compiled graph (torch/compiled_score_mods.py), or eagerly outside it."""
    if not compiled_score_mods.in_graph(given):
        return _score_mod_call_outside_graph(q, k, v, **given)
    tensors, options, described = _compiled_description(q, k, v, given)
    score_mod, mask_mod = given.get("score_mod"), given.get("mask_mod")
    for fn in (score_mod, mask_mod):
        if type(fn) is types.FunctionType:
            _score_mod_made_in_compiled_code_over_tensors_breaks_the_graph_here(fn)
    native, scalars, empty_rows, sources, aux_key, reads, offsets = compiled_score_mods.plan(
        described, tuple(options.items()), given.get("backend"), torch.is_grad_enabled(),
        compiled_score_mods.passed(score_mod), mask_mod, q.device)
    if native == compiled_score_mods.NO_NATIVE_OPERATOR[0]:
        return _score_mod_call_without_native_operator(q, k, v, **given)
    if native < 0:
        return _score_mod_call_outside_graph(q, k, v, **given)
    captured = compiled_score_mods.captured(score_mod, mask_mod, q, sources, reads)
    aux = []
    if captured:  # captured tensors: graph inputs, bound into aux tensors on every run
        aux = torch.ops.fusedattn.score_mod_aux.default(aux_key, captured)
    unpacked = split_packed(options["layout"], tuple(x for x in tensors[:3] if x is not None))
    seed, offset = _compiled_dropout(q, options, given)
    sequences = list(tensors[6:6 + offsets])  # TENSOR_ARGUMENTS' order: cu_seqlens_q, _kv, then the padded ones
    out, lse = torch.ops.fusedattn_native.attention.default(native, *unpacked, tensors[5], seed, offset, tensors[3],
                                                            list(aux), list(scalars), empty_rows, sequences)[:2]
    return _compiled_result(out, lse, None, options)


def _score_mod_made_in_compiled_code_over_tensors_breaks_the_graph_here(fn) -> None:
    """A function made in the traced code whose closure holds a tensor or a symbolic number cannot be handed
    to plan: repr makes Dynamo break the graph here (the call then runs eagerly), where plan's arguments would
    fail the whole compile. Under fullgraph=True, Dynamo's error shows this function's name and line."""
    repr(fn)  # fullgraph=True: make the score_mod outside the compiled function (tensors then are graph inputs)


def _compiled_description(q, k, v, given: dict) -> tuple:
    """(tensors in TENSOR_ARGUMENTS' order, settings, each tensor's shape, strides, dtype, device and
    requires_grad) of a compiled call: what its trace-time planning reads."""
    tensors = (q, k, v, *(given.get(name) for name in TENSORS))
    options = settings_of(given)
    if options["window"] is not None:
        options["window"] = tuple(options["window"])
    options = {name: trace_time.constants(value) for name, value in options.items()}
    return tensors, options, trace_time.describe(tensors)


def _compiled_dropout(q, options: dict, given: dict) -> tuple:
    """(seed, offset) device tensors of a compiled call with dropout, else (None, None)."""
    if options["dropout_p"] <= 0.0:
        return None, None
    dropout_seed, dropout_offset = given.get("dropout_seed"), given.get("dropout_offset", 0)
    _check_dropout_state(0 if dropout_seed is None else dropout_seed, dropout_offset)
    seed = (torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=q.device) if dropout_seed is None
            else torch.as_tensor(dropout_seed, dtype=torch.int64, device=q.device))
    return seed, torch.as_tensor(dropout_offset, dtype=torch.int64, device=q.device)


def _compiled_result(out, lse, max_logit, options: dict):
    if not (options["return_lse"] or options["return_max_logit"]):
        return out
    return AttentionResult(out, lse if options["return_lse"] else None,
                           max_logit if options["return_max_logit"] else None)


@torch._dynamo.assume_constant_result
def _compile_time_plan(described: tuple, options: tuple, backend, grad_enabled: bool) -> str | tuple:
    """Validate, configure and select at trace time, from shapes alone; return the op's config key (an
    argument error: trace_time.refusal's tuple).

    Dynamo runs this once per distinct call and bakes the key into the graph as a constant.
    """
    try:
        cfg, selection = trace_time.configure(described, dict(options), backend, grad_enabled)[:2]
    except trace_time.refused_errors as error:
        return trace_time.refusal(error)
    return register_config(cfg, selection.name)


@torch._dynamo.assume_constant_result
def _compile_time_native(key: str, device: torch.device) -> int:
    """The native operator's plan for a compiled call (registered while tracing, as eager calls register
    theirs), or -1: the call runs as the Python custom op. Dynamo bakes the id into the graph."""
    plan = _native_plan_on(config_of(key), backend_of(key), device)
    return -1 if plan is None else plan


def _compiled_attention(q, k, v, given: dict):
    tensors, options, described = _compiled_description(q, k, v, given)
    key = trace_time.raise_refusal(_compile_time_plan(described, tuple(options.items()), given.get("backend"),
                                                      torch.is_grad_enabled()))
    passed = tuple(x for x in (q, k, v) if x is not None)
    unpacked = split_packed(options["layout"], passed)
    arrays, check = (*unpacked, *tensors[3:]), None
    # Offsets are never read while compiling: checked on the device (by the cuDNN backend itself).
    if any(x is not None for x in tensors[6:]) and backend_of(key) != "cudnn":
        cfg = config_of(key)
        check = check_unread_offsets(cfg, passed, dict(zip(TENSOR_ARGUMENTS[6:], tensors[6:])))
        arrays = guard_inputs(cfg, passed, arrays, check)
    seed, offset = _compiled_dropout(q, options, given)
    native = _compile_time_native(key, q.device)
    if native >= 0:  # the eager warm path's operator, its autograd traced by AOTAutograd
        cfg = config_of(key)
        sequences = _offsets(cfg, dict(zip(TENSORS, tensors[3:])).get) if cfg.has_sequence_lengths else []
        out, lse, *max_logit = torch.ops.fusedattn_native.attention.default(native, *unpacked, tensors[5], seed,
                                                                            offset, tensors[3], [], [], False,
                                                                            sequences)
        max_logit = max_logit[0] if max_logit else None
    else:
        out, lse, max_logit = (poisoned(check, x)
                               for x in torch.ops.fusedattn.attention_fwd(key, *arrays, seed, offset))
    return _compiled_result(out, lse, max_logit, options)


def small_seq_attention(q: torch.Tensor, k: torch.Tensor | None = None, v: torch.Tensor | None = None, **kwargs):
    """`attention(...)` on the small_seq backend only: one query per sequence, a few keys.

    The same keywords as `attention`. Use it to insist on the kernel (for example in a
    benchmark); when the call is outside what it runs, the error lists its reasons.
    Plain `attention` already picks small_seq for these shapes.
    """
    return on_backend_only("small_seq_attention", attention, "small_seq", q, k, v, kwargs)
