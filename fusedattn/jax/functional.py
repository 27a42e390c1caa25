"""fusedattn.jax.attention: validate, describe, select, run through a custom_vjp (no math here)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from fusedattn.arguments import TensorMeta, host_slopes
from fusedattn.backends import get_backend
from fusedattn.backends.base import ARRAY_NAMES, DIFFERENTIABLE, AttentionInputs, AttentionOutputs, no_lse_gradient
from fusedattn.frontend_common import (
    TENSOR_ARGUMENTS,
    call_as_thd,
    check_unread_offsets,
    documents_possible,
    on_backend_only,
    pick_outputs,
    prepare_call,
    slopes_are_standard,
)
from fusedattn.jax import cudnn_call, small_seq_call, torch_bridge
from fusedattn.jax import documents as documents_thd
from fusedattn.jax.offset_guard import guard_inputs, poisoned
from fusedattn.jax.partition import check_declared, find_split
from fusedattn.jax.shard_guard import batched, check_shard_axes, guard_whole
from fusedattn.layout import layout_spec
from fusedattn.options import SCORE_MOD_NAMES, TENSORS, check_keywords, describe_arguments
from fusedattn.options import settings as settings_of
from fusedattn.score_mods.builtins import flex_keywords
from fusedattn.score_mods.core import as_score_mod
from fusedattn.score_mods.mask_rewrite import rewrite_mask
from fusedattn.xp.jax_ops import OPS

__all__ = ["attention"]

API = "fusedattn.jax.attention"


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _meta(x, name: str) -> TensorMeta | None:
    if x is None:
        return None
    if _is_torch(x):  # named, never printed: a tensor's repr is its whole contents
        raise ValueError(f"{API}: {name}: expected a JAX array, got {_type_name(x)}; convert it once with "
                         "jax.dlpack.from_dlpack(tensor) or jnp.asarray(tensor.numpy()), or call "
                         "fusedattn.torch.attention")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{API}: {name}: expected a JAX array, got {type(x).__name__}")
    x = x if isinstance(x, jax.Array) else jnp.asarray(x)
    return TensorMeta(tuple(x.shape), OPS.dtype_name(x), OPS.device_label(x), OPS.device_kind(x))


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _type_name(x) -> str:
    """The type as users spell it: torch.Tensor, jax.Array, numpy.ndarray, int."""
    kind = type(x)
    if _is_torch(x) and kind.__name__ == "Tensor":
        return "torch.Tensor"
    if isinstance(x, jax.Array):
        return "jax.Array"
    module = kind.__module__.split(".")[0]
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def _describe_value(x) -> str:
    """A short description of an argument (type, shape, dtype), never its contents."""
    if _is_torch(x) or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return _type_name(x)
    return f"{_type_name(x)} of shape {tuple(x.shape)}, dtype {x.dtype}"


def _inputs(arrays, score_mod) -> AttentionInputs:
    return AttentionInputs(**dict(zip(ARRAY_NAMES, arrays)), score_mod=score_mod)


def _native(cfg, backend):
    """The module that runs this backend's passes inside the XLA program (cuDNN graphs as native custom
    calls where the library loads; small_seq's Triton kernels through jax-triton on a GPU), or None."""
    if backend.name == "cudnn" and cudnn_call.unavailable() is None:
        return cudnn_call
    if backend.name == "small_seq" and small_seq_call.runs(cfg):
        return small_seq_call
    return None


def _checks_its_own_offsets(call, arrays: tuple, shard_axes) -> bool:
    """Whether the call's one custom call per pass checks its sequence offsets on the device itself (a padded
    or THD cuDNN pass with its own sequence kernels), as the torch operator does. Not under vmap (items
    folded into one batch would share one check; the frontend's check is per item) nor split over devices."""
    cfg, backend = call.cfg, get_backend(call.selection.name)
    if _native(cfg, backend) is not cudnn_call or not cudnn_call.checks_offsets(cfg):
        return False
    if any(batched(x) for x in arrays if x is not None):
        return False
    q = arrays[0]
    return find_split(API, cfg, q, layout_spec(cfg.layout).tensors[0][1], shard_axes) is None


def _run_forward(cfg, backend_name, score_mod, split, arrays):
    """(outputs, saved): in jax.numpy, as native calls, or through torch for backends whose kernels are
    torch's where no native call runs them."""
    backend = get_backend(backend_name)
    native = _native(cfg, backend)
    if native is not None:
        return AttentionOutputs(*native.forward(cfg, score_mod, arrays, split)), None
    if backend.array_framework == "torch":
        return AttentionOutputs(*torch_bridge.forward(cfg, backend, score_mod, arrays, split)), None
    return backend.forward(cfg, _inputs(arrays, score_mod))


# The backend chosen at trace time is a static argument: forward decides backward. So is `split`:
# how a bridge call (torch-implemented backend) is split over devices, or None. The score_mod's arrays
# are operands (`mod_arrays`, no gradient: one that learns ran as a bias before): a tracer held in a
# static argument leaks when jax.grad differentiates a jitted call (grad(jit(f))).
@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _attention(cfg, backend_name, score_mod, split, arrays, mod_arrays):
    # Runs only when nothing differentiates the call: an inference forward where that differs.
    outputs, _ = _run_forward(_for_inference(cfg, backend_name), backend_name, _with_arrays(score_mod, mod_arrays),
                              split, arrays)
    return tuple(outputs)


_HELD = object()  # a score_mod value that travels among the operands (see _without_arrays)


def _without_arrays(score_mod) -> tuple:
    """(the bound score_mod with its arrays left out, those arrays): see _attention."""
    if score_mod is None:
        return None, ()
    held = {name: _HELD for name, x in score_mod.values.items() if isinstance(x, (jax.Array, jax.core.Tracer))}
    if not held:
        return score_mod, ()
    mod = score_mod.mod
    if mod.forward is not None and any(isinstance(score_mod.values[name], jax.core.Tracer) for name in held):
        # The reference runs the user's callbacks, which read the traced arrays themselves: it runs their
        # traced form over these operands instead (what cuDNN runs).
        mod = dataclasses.replace(mod, eager=None)
    return (dataclasses.replace(score_mod, mod=mod, values={**score_mod.values, **held}),
            tuple(score_mod.values[name] for name in held))


def _with_arrays(score_mod, mod_arrays: tuple):
    if not mod_arrays:
        return score_mod
    given = iter(mod_arrays)
    return dataclasses.replace(score_mod, values={name: next(given) if x is _HELD else x
                                                  for name, x in score_mod.values.items()})


def _for_inference(cfg, backend_name: str):
    """cfg without training when no output needs it (no lse/max_logit asked for, no dropout, which
    training decides on) and the backend runs it (checked by building, as selection does): cuDNN
    then writes no LSE and may choose faster kernels."""
    backend = get_backend(backend_name)
    if (backend.array_framework != "torch" or cfg.dropout_p > 0.0 or cfg.return_lse or cfg.return_max_logit
            or not cfg.is_training):
        return cfg
    inference = cfg.replace(is_training=False)
    return cfg if backend.supports(inference) else inference


def _attention_fwd(cfg, backend_name, score_mod, split, arrays, mod_arrays):
    # symbolic_zeros: primals arrive wrapped; cotangents of unused outputs arrive as SymbolicZero.
    arrays = tuple(None if x is None else x.value for x in arrays)
    learning = tuple(x.perturbed and jnp.issubdtype(x.value.dtype, jnp.floating) for x in mod_arrays)
    mod_arrays = tuple(x.value for x in mod_arrays)
    backend = get_backend(backend_name)
    if any(learning) and (_native(cfg, backend) is not None or backend.array_framework == "torch"):
        raise ValueError(f"{API}: score_mod: a captured array is differentiated, but the call was traced before "
                         f"that was known (jax.grad outside jax.jit, checkpoint or vmap), and {backend.name} gives "
                         "score_mod arrays no gradient; take jax.grad inside the transform (an added term then "
                         "learns as a bias), pass the term as bias=, or use backend='reference'")
    outputs, saved = _run_forward(cfg, backend_name, _with_arrays(score_mod, mod_arrays), split, arrays)
    return tuple(outputs), (arrays, mod_arrays, learning, saved, outputs.out, outputs.lse)


def _attention_bwd(cfg, backend_name, held_mod, split, residuals, cotangents):
    arrays, mod_arrays, learning, saved, out, lse = residuals
    score_mod = _with_arrays(held_mod, mod_arrays)
    grad_out, grad_lse, _ = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
    backend = get_backend(backend_name)
    if grad_lse is not None and not backend.lse_gradient:
        raise no_lse_gradient(API, backend.name)
    native = _native(cfg, backend)
    if native is not None:
        grads = native.backward(cfg, score_mod, arrays, out, lse, grad_out, grad_lse, split)
    elif backend.array_framework == "torch":
        grads = torch_bridge.backward(cfg, backend, score_mod, arrays, out, lse, grad_out, grad_lse, split)
    else:
        grads = backend.backward(cfg, _inputs(arrays, score_mod), saved, AttentionOutputs(out, lse), grad_out,
                                 grad_lse)
    mod_grads = tuple(None for _ in mod_arrays)
    if any(learning):  # (a jax.numpy backend: _attention_fwd refused the others)
        mod_grads = _mod_array_cotangents(cfg, backend, held_mod, arrays, mod_arrays, learning, out, lse, grad_out,
                                          grad_lse)
    return (tuple(grads.get(name) if name in DIFFERENTIABLE and x is not None else None
                  for name, x in zip(ARRAY_NAMES, arrays)), mod_grads)


def _mod_array_cotangents(cfg, backend, held_mod, arrays, mod_arrays, learning, out, lse, grad_out,
                          grad_lse) -> tuple:
    """The cotangents of the score_mod arrays being differentiated (`learning`), on a jax.numpy backend, by
    autodiff of its forward. Under jit that a captured array is differentiated is not known when the call
    is traced (an added term that learns then stays an aux array, not a bias): its gradient comes here."""
    floats = [i for i, wanted in enumerate(learning) if wanted]

    def outputs(*chosen):
        given = list(mod_arrays)
        for i, x in zip(floats, chosen):
            given[i] = x
        result, _ = backend.forward(cfg, _inputs(arrays, _with_arrays(held_mod, tuple(given))))
        return result.out, result.lse

    _, pullback = jax.vjp(outputs, *(mod_arrays[i] for i in floats))
    found = pullback((jnp.zeros_like(out) if grad_out is None else grad_out,
                      jnp.zeros_like(lse) if grad_lse is None else grad_lse))
    grads = [None] * len(mod_arrays)
    for i, g in zip(floats, found):
        grads[i] = g
    return tuple(grads)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _dropout_state(rng, seed, offset):
    """(seed, offset) uint32 scalars from a PRNG key, or from the given integers."""
    if rng is not None and seed is not None:
        raise ValueError(f"{API}: dropout_rng and dropout_seed: expected one of them (a PRNG key, or a seed with "
                         "dropout_offset), got both")
    if rng is not None:
        expected = "a jax.random key (jax.random.key(...), or a legacy jax.random.PRNGKey)"
        if _is_torch(rng) or not hasattr(rng, "dtype"):
            raise ValueError(f"{API}: dropout_rng: expected {expected}, got {_describe_value(rng)}")
        try:
            bits = jax.random.bits(rng, (2,), jnp.uint32)
        except (TypeError, ValueError):  # JAX's message prints the key data and its implementation
            raise ValueError(f"{API}: dropout_rng: expected {expected}, got {_describe_value(rng)}") from None
        return bits[0], bits[1]
    if seed is None:
        raise ValueError(f"{API}: dropout_rng: expected a PRNG key (or dropout_seed) when dropout_p > 0, got None")
    return _uint32_scalar("dropout_seed", seed), _uint32_scalar("dropout_offset", offset)


def _uint32_scalar(name: str, value):
    """An integer (Python or a one-element integer array) as a uint32 scalar, modulo 2**32."""
    if isinstance(value, int) and not isinstance(value, bool):
        return jnp.uint32(value % 2**32)
    dtype = getattr(value, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer) or getattr(value, "size", 0) != 1:
        got = f"an array of shape {tuple(value.shape)}, dtype {dtype}" if dtype is not None else repr(value)
        raise ValueError(f"{API}: {name}: expected an int or a one-element integer array, got {got}")
    return jnp.reshape(value, ()).astype(jnp.uint32)


def attention(q, k=None, v=None, **options):
    """Scaled-dot-product attention for JAX arrays, with the keywords of fusedattn.torch.attention.

    Differences from the torch frontend: dropout takes `dropout_rng` (a PRNG key turned
    into the (seed, offset) pair; or pass dropout_seed/dropout_offset); under `jax.jit`
    THD calls need static `max_seqlen_q/kv` (offsets are traced, so their values are not
    checked). THD sequences may be given as packed segment ids instead of cu_seqlens.

    Sharding: inputs sharded over batch and/or heads run shard-local. Backends whose kernels
    run through callbacks (cudnn, small_seq) need the split when the call is traced: it is read
    from concrete arrays and explicit shardings; under jit with in_shardings pass
    `shard_axes={"batch": "data", "heads": "model"}` (mesh axis names) inside
    `jax.set_mesh(mesh)`. Sharded sequence or head-dim axes are refused.

    Args:
        q, k, v: arrays in `layout` (see below); packed layouts take fewer.
        {options}

    Example:
        >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 128, 8, 64))
        >>> out = attention(q, k, v, mask="causal")
        >>> grads = jax.grad(lambda q: attention(q, k, v).sum())(q)
    """
    check_keywords(API, options, "jax")
    # NumPy arrays become JAX arrays here, as jax.numpy takes them: the score_mod tracer and the segment-id
    # packing work on the framework's arrays.
    q, k, v = (jnp.asarray(x) if isinstance(x, np.ndarray) else x for x in (q, k, v))
    for name in ("segment_ids_q", "segment_ids_kv"):
        if isinstance(options.get(name), np.ndarray):
            options = {**options, name: jnp.asarray(options[name])}
    options = flex_keywords(options)  # a built-in in flex form: its score_mod and mask_mod
    if options.get("mask_mod") is not None:  # its causal, window, padding and document parts as native masks
        options, documents = rewrite_mask("jax", q, k, v, options, document_ok=documents_possible(options, "jax"))
        if documents is not None:
            found = documents_thd.boundaries(documents.ids, documents.batch, documents.seqlen)
            if found is not None:
                return call_as_thd(attention, q, k, v, options, *found, documents.batch)
            options = {**options, "mask_mod": documents.fallback}  # traced or unsorted ids: a select
    get = options.get
    alibi_slopes = get("alibi_slopes")
    slopes = host_slopes(f"{API}: alibi_slopes", alibi_slopes, getattr(q, "dtype", None))
    if slopes is not None:  # a list such as fusedattn.standard_alibi_slopes(Hq), or a NumPy array
        alibi_slopes = jnp.asarray(slopes)
    elif alibi_slopes is not None and not isinstance(alibi_slopes, (jax.Array, jax.core.Tracer)):
        raise ValueError(f"{API}: alibi_slopes: expected an array, list or NumPy array of (Hq,) or (B, Hq) slopes, "
                         f"got {type(alibi_slopes).__name__}")
    mod = as_score_mod(API, *(get(name) for name in SCORE_MOD_NAMES), framework="jax")
    q, k, v = check_shard_axes(API, get("layout", "bshd"), q, k, v)
    tensors = {"q": q, "k": k, "v": v, **{name: get(name) for name in TENSORS}, "alibi_slopes": alibi_slopes}
    segments_violated = None
    if get("segment_ids_q") is not None or get("segment_ids_kv") is not None:
        tensors["cu_seqlens_q"], tensors["cu_seqlens_kv"], segments_violated = _from_segment_ids(
            get("segment_ids_q"), get("segment_ids_kv"), get("num_sequences"), get("cu_seqlens_q"),
            get("cu_seqlens_kv"), _token_counts(get("layout", "bshd"), q, k))
    elif get("num_sequences") is not None:
        raise ValueError(f"{API}: num_sequences: expected None without segment_ids_q/kv (it counts their "
                         f"sequences), got {get('num_sequences')!r}")
    call = prepare_call(
        API, "jax", tensors, describe=_meta, host_copy=lambda x: OPS.to_host(x) if _is_concrete(x) else None,
        # Whether a gradient will be taken is unknown at trace time: assume it may.
        is_training=True, bias_requires_grad=get("bias") is not None, backend=get("backend"),
        **settings_of(options), score_mod=mod,
        alibi_standard=alibi_slopes is not None and _is_concrete(alibi_slopes)
        and slopes_are_standard(OPS.to_host(alibi_slopes)),
    )
    offsets = {name: tensors[name] for name in TENSOR_ARGUMENTS[6:]}
    check = None
    unread = segments_violated is not None or any(x is not None and not _is_concrete(x) for x in offsets.values())
    # Traced offsets or segment ids were never read: checked on the device, NaN results when broken (outputs
    # and gradients times a factor, fused with work XLA does anyway: offset_guard.py), unless the custom call
    # checks them itself (cudnn_call.checks_offsets) and no factor is needed around it.
    if unread and not (segments_violated is None
                       and _checks_its_own_offsets(call, (q, k, v, *offsets.values()), get("shard_axes"))):
        passed = tuple(x for x in (q, k, v) if x is not None)
        check = check_unread_offsets(call.cfg, passed, offsets, segments_violated)
        call = call._replace(arrays=guard_inputs(call.cfg, passed, call.arrays, check))
    seed = offset = None
    if call.cfg.dropout_p > 0.0:
        seed, offset = _dropout_state(get("dropout_rng"), get("dropout_seed"), get("dropout_offset", 0))
    split = None
    if get_backend(call.selection.name).array_framework == "torch" and not any(map(batched, (q, k, v))):
        split = find_split(API, call.cfg, q, layout_spec(call.cfg.layout).tensors[0][1], get("shard_axes"))
        if split is None:  # sharded inputs would be gathered: refused when XLA partitions the program
            call = call._replace(arrays=(*guard_whole(API, layout_spec(call.cfg.layout).base.value, call.arrays[:3],
                                                      call.selection.name), *call.arrays[3:]))
    else:  # no split to find (find_split checks shard_axes itself): the same argument is refused the same way
        check_declared(API, get("shard_axes"))
    score_mod, mod_arrays = _without_arrays(call.score_mod)
    out, lse, max_logit = _attention(call.cfg, call.selection.name, score_mod, split, (*call.arrays, seed, offset),
                                     mod_arrays)
    return pick_outputs(call.cfg, *(poisoned(check, x) for x in (out, lse, max_logit)))


describe_arguments(attention, "jax")


def _token_counts(layout, q, k) -> tuple | None:
    """(query tokens, key tokens) of a packed-token (THD) layout's arrays, else None. Segment ids are
    refused on a padded layout, whose rows they do not describe."""
    try:
        ragged = layout_spec(layout).layout.is_ragged
    except (ValueError, TypeError, AttributeError):
        return None  # a bad layout: build_config says so
    if not ragged:
        raise ValueError(f"{API}: segment_ids_q/kv: expected None for layout {layout!r}, got arrays; segment ids "
                         "number the tokens of a packed layout ('thd', 't3hd', 'thd_t2hd'); for a padded batch pass "
                         "mask='padding' with cu_seqlens_q/kv, or a mask_mod over per-position ids")
    shape_q, shape_kv = getattr(q, "shape", ()), getattr(k if k is not None else q, "shape", ())
    return (shape_q[0], shape_kv[0]) if shape_q and shape_kv else None


def _from_segment_ids(ids_q, ids_kv, num_sequences, cu_q, cu_kv, tokens: tuple | None = None):
    """(cu_seqlens_q, cu_seqlens_kv, violated) from packed segment ids (both sides), with clear errors.
    tokens: the (query, key) token counts the ids must match, where the layout packs tokens.

    Concrete ids are checked here (unsorted ids raise); traced ones give `violated`, a 0-d boolean
    on the device that the call turns into NaN results (None when every id was checked)."""
    from fusedattn.layout import check_segment_ids, segment_ids_to_cu_seqlens, segment_ids_violated

    if ids_q is None or ids_kv is None:
        missing = "segment_ids_kv" if ids_kv is None else "segment_ids_q"
        raise ValueError(f"{API}: {missing}: expected a (T,) array with the other segment ids, got None")
    if cu_q is not None or cu_kv is not None:
        raise ValueError(f"{API}: cu_seqlens_q/kv: expected None with segment ids, got arrays (pass one or the other)")
    if not isinstance(num_sequences, int) or isinstance(num_sequences, bool) or num_sequences < 1:
        raise ValueError(f"{API}: num_sequences: expected a static int >= 1 with segment ids, got {num_sequences!r}")
    for side, (name, ids) in enumerate((("segment_ids_q", ids_q), ("segment_ids_kv", ids_kv))):
        if len(getattr(ids, "shape", ())) != 1:
            raise ValueError(f"{API}: {name}: expected a (T,) integer array, got shape "
                             f"{getattr(ids, 'shape', type(ids).__name__)}")
        if tokens is not None and ids.shape[0] != tokens[side]:
            raise ValueError(f"{API}: {name}: expected one id per packed {('query', 'key')[side]} token "
                             f"({tokens[side]}), got {ids.shape[0]}")
    violated = None
    for name, ids in (("segment_ids_q", ids_q), ("segment_ids_kv", ids_kv)):
        if _is_concrete(ids):
            check_segment_ids(f"{API}: {name}", OPS.to_host(ids))
        else:
            this = segment_ids_violated(ids)
            violated = this if violated is None else violated | this
    cu = (segment_ids_to_cu_seqlens(ids_q, num_sequences), segment_ids_to_cu_seqlens(ids_kv, num_sequences))
    return (*cu, violated)


def small_seq_attention(q, k=None, v=None, **kwargs):
    """`attention(...)` on the small_seq backend only (see fusedattn.torch.small_seq_attention).

    On a GPU the Triton kernels run inside the JAX program through jax-triton (fusedattn/jax/small_seq_call.py);
    without jax-triton, and in Triton's CPU interpreter, through torch (fusedattn/jax/torch_bridge.py).
    """
    return on_backend_only("small_seq_attention", attention, "small_seq", q, k, v, kwargs)
