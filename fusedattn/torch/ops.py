"""fusedattn as torch.library custom ops, so torch.compile(fullgraph=True) sees one opaque op.

Ops take a config key (a string naming an AttentionConfig and the backend chosen for it)
plus tensors. The fake implementations give output shapes from the config, so tracing
never runs a kernel; the registered autograd calls the backward op of the same backend:
the forward decides the backward here too.

A compiled graph holds its key as a constant for as long as the graph lives, while the
key -> config cache is bounded. So a key spells out the config itself (its fields as Python
literals): a key the cache evicted is rebuilt from its own text, never a failed lookup.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import enum
import hashlib

import torch

from fusedattn.backends import get_backend
from fusedattn.backends.base import ARRAY_NAMES, AttentionInputs, AttentionOutputs, lse_gradient_for
from fusedattn.cache import LRUCache, register
from fusedattn.config import AttentionConfig

__all__ = ["register_config", "config_of", "backend_of", "attention_fwd", "attention_bwd"]

CONFIG_CACHE_SIZE = 4096
# key -> (config, backend name). Keys come from the config's contents, never from id().
_CONFIGS: LRUCache = register("torch.ops.configs", LRUCache(CONFIG_CACHE_SIZE))
_DIGEST = "#"  # marks a key that names its config by digest only (the config is not literals)
GRAD_NAMES = ARRAY_NAMES[:6]  # the differentiable arrays, in argument order


@contextlib.contextmanager
def _autograd_enabled():
    """Undo, for the duration, the autograd exclusion torch applies inside custom op kernels."""
    keys = [getattr(torch._C.DispatchKey, name) for name in
            ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")]
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in keys]
    try:
        for key in keys:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
        with torch.enable_grad():
            yield
    finally:
        for key, was in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def _spelled(cfg: AttentionConfig) -> str | None:
    """The config's fields that differ from their defaults, as a dict of Python literals; None when
    a field left out of comparisons is set (a score_mod's recipe: callbacks, not text)."""
    fields = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.default is dataclasses.MISSING or value != f.default:
            if not f.compare:
                return None
            fields[f.name] = value.value if isinstance(value, enum.Enum) else value
    return repr(fields)


def _rebuilt(key: str) -> tuple[AttentionConfig, str]:
    """(config, backend name) from a key's own text; RuntimeError when it does not spell one out."""
    name, _, text = key.partition(":")
    try:
        if text.startswith(_DIGEST):
            raise ValueError("the key names its config by digest only")
        cfg = AttentionConfig(**ast.literal_eval(text))
        get_backend(name)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as error:
        raise RuntimeError(
            f"fusedattn.torch ops: config key {key[:200]!r} is no longer registered ({CONFIG_CACHE_SIZE} most "
            f"recently used configs are kept) and cannot be rebuilt from its text ({error}): register the config "
            "again with register_config, or recompile the model (torch._dynamo.reset()) so tracing registers it"
        ) from None
    return cfg, name


def register_config(cfg: AttentionConfig, backend_name: str) -> str:
    """The key naming (cfg, backend_name) for the ops: the config spelled out, so that it can be
    rebuilt from the key after the bounded cache drops it; a digest where the config is more than
    literals (a score_mod's key)."""
    spelled = _spelled(cfg)
    key = f"{backend_name}:{_DIGEST if spelled is None else spelled}"
    try:
        if _rebuilt(key)[0] != cfg:
            raise RuntimeError("the config does not survive its text")
    except RuntimeError:
        key = f"{backend_name}:{_DIGEST}{hashlib.sha1(repr(cfg).encode()).hexdigest()[:20]}"
    _CONFIGS.put(key, (cfg, backend_name))
    return key


def _entry(key: str) -> tuple[AttentionConfig, str]:
    """(config, backend name) for a key: one dict read when cached, else rebuilt from the key."""
    entry = _CONFIGS.peek(key)
    if entry is None:
        entry = _CONFIGS.get_or_build(key, lambda: _rebuilt(key))
    return entry


def config_of(key: str) -> AttentionConfig:
    """The config a key returned by register_config names."""
    return _entry(key)[0]


def backend_of(key: str) -> str:
    """The backend name a key returned by register_config names."""
    return _entry(key)[1]


def _inputs(q, k, v, bias, alibi_slopes, sink, cu_q, cu_kv, cu_q_padded, cu_kv_padded, seed, offset):
    return AttentionInputs(q, k, v, bias, alibi_slopes, sink, cu_q, cu_kv, cu_q_padded, cu_kv_padded, seed, offset)


@torch.library.custom_op("fusedattn::attention_fwd", mutates_args=())
def attention_fwd(key: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  alibi_slopes: torch.Tensor | None, sink: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_kv: torch.Tensor | None, cu_seqlens_q_padded: torch.Tensor | None,
                  cu_seqlens_kv_padded: torch.Tensor | None, dropout_seed: torch.Tensor | None,
                  dropout_offset: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg, name = _entry(key)
    inputs = _inputs(q, k, v, bias, alibi_slopes, sink, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                     cu_seqlens_kv_padded, dropout_seed, dropout_offset)
    with torch.no_grad():
        outputs, _ = get_backend(name).forward(cfg, inputs)
    return outputs.out.contiguous(), outputs.lse.contiguous(), outputs.max_logit.contiguous()


@attention_fwd.register_fake
def _attention_fwd_fake(key, q, k, v, *rest):
    cfg, _ = _entry(key)
    out = q.new_empty((*q.shape[:-1], cfg.head_dim_v))
    stats = getattr(torch, cfg.stats_dtype)
    if cfg.layout.is_ragged:
        lse = q.new_empty((q.shape[0], cfg.heads_q), dtype=stats)
    else:
        lse = q.new_empty((cfg.batch, cfg.heads_q, cfg.seqlen_q), dtype=stats)
    max_logit = q.new_empty((cfg.heads_q if cfg.return_max_logit else 0,), dtype=stats)
    return out, lse, max_logit


@torch.library.custom_op("fusedattn::attention_bwd", mutates_args=())
def attention_bwd(key: str, grad_out: torch.Tensor, grad_lse: torch.Tensor | None, out: torch.Tensor,
                  lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                  alibi_slopes: torch.Tensor | None, sink: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                  cu_seqlens_kv: torch.Tensor | None, cu_seqlens_q_padded: torch.Tensor | None,
                  cu_seqlens_kv_padded: torch.Tensor | None, dropout_seed: torch.Tensor | None,
                  dropout_offset: torch.Tensor | None) -> list[torch.Tensor]:
    """Gradients [dq, dk, dv, dbias, dalibi_slopes, dsink]; empty (0,) tensors for absent inputs.
    grad_lse: the gradient reaching the returned LSE, as in eager mode (a backend without one raises)."""
    cfg, name = _entry(key)
    inputs = _inputs(q, k, v, bias, alibi_slopes, sink, cu_seqlens_q, cu_seqlens_kv, cu_seqlens_q_padded,
                     cu_seqlens_kv_padded, dropout_seed, dropout_offset)
    backend = get_backend(name)
    grad_lse = lse_gradient_for(backend, grad_lse, "fusedattn.torch.attention")
    with _autograd_enabled():  # the reference backend differentiates by autograd, even inside this op
        grads = backend.backward(cfg, inputs, None, AttentionOutputs(out, lse), grad_out, grad_lse)
    result = []
    for grad_name in GRAD_NAMES:
        source, grad = getattr(inputs, grad_name), grads.get(grad_name)
        if source is None or grad is None:
            result.append(q.new_empty((0,)))
            continue
        grad = grad.contiguous() if grad.shape == source.shape else grad.reshape(source.shape)
        result.append(grad)
    return result


@attention_bwd.register_fake
def _attention_bwd_fake(key, grad_out, grad_lse, out, lse, q, k, v, bias, alibi_slopes, sink, *rest):
    return [x.new_empty(x.shape) if x is not None else q.new_empty((0,)) for x in (q, k, v, bias, alibi_slopes, sink)]


def _setup_context(ctx, inputs, output):
    key, *arrays = inputs
    out, lse, _ = output
    ctx.key = key
    ctx.save_for_backward(out, lse, *(a if isinstance(a, torch.Tensor) else None for a in arrays))
    ctx.present = [a is not None for a in arrays]
    # The LSE has a gradient as in eager mode (a backend without one raises the same error there
    # and here); max_logit has none in either.
    ctx.mark_non_differentiable(output[2])
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse, _grad_max_logit):
    out, lse, *arrays = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    grads = torch.ops.fusedattn.attention_bwd(ctx.key, grad_out, grad_lse, out, lse, *arrays)
    wanted = [g if present and g.numel() else None for g, present in zip(grads, ctx.present[:6])]
    return (None, *wanted, *([None] * 6))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)
