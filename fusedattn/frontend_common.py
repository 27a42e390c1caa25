"""What both frontends share: preparing a call (describe, validate, select) and shaping results."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NamedTuple

from fusedattn.arguments import (
    ENV_THD_BUCKET,
    CallArguments,
    bucket_max_seqlens,
    build_config,
    check_offset_tensors,
    check_sequence_values,
    clamp_max_seqlens,
    infer_max_seqlens,
)
from fusedattn.config import BiasType, standard_alibi_slopes
from fusedattn.layout import dense_to_tokens, lse_tokens_to_dense, offsets_violated, split_packed, tokens_to_dense
from fusedattn.options import TENSORS
from fusedattn.score_mods.core import bind, needs_gradient, refuse_unfollowed
from fusedattn.score_mods.flex import reads_learners, reads_positions
from fusedattn.selection import NoBackendError, select_backend
from fusedattn.xp import namespace

__all__ = ["AttentionResult", "pick_outputs", "documents_possible", "call_as_thd", "thd_keywords", "dense_result",
           "prepare_call", "PreparedCall", "TENSOR_ARGUMENTS", "on_backend_only",
           "UnreadOffsetsCheck", "check_unread_offsets", "poisoned", "guard_inputs"]


class AttentionResult(NamedTuple):
    """Returned instead of the bare output when return_lse or return_max_logit is set.

    out: attention output in q's layout. lse: log-sum-exp of the scaled scores (including the
    sink term), float32 (float64 for float64 inputs), (B, Hq, Sq), or (Tq, Hq) for THD; None unless
    return_lse. max_logit: (Hq,) largest visible score per head, in the LSE's dtype; None unless
    return_max_logit.
    """

    out: Any
    lse: Any = None
    max_logit: Any = None


def pick_outputs(cfg, out, lse, max_logit):
    """The bare output, or an AttentionResult holding what was asked for."""
    if not (cfg.return_lse or cfg.return_max_logit):
        return out
    return AttentionResult(out, lse if cfg.return_lse else None, max_logit if cfg.return_max_logit else None)


def documents_possible(options: dict, framework: str, device=None) -> bool:
    """Whether a document mask_mod may run as THD: nothing else in the call needs the dense layout (a
    score_mod may come along where it reads only the score and h (flex.reads_positions) and nothing that
    learns, whose term would run as a bias)."""
    get = options.get
    mod = get("score_mod")
    return ((mod is None or (not reads_positions(framework, mod, device) and get("score_mod_tensors") is None
                             and not reads_learners(framework, mod)))
            and get("bias") is None and get("alibi_slopes") is None and not get("return_max_logit"))


def thd_keywords(offsets, longest: int) -> dict:
    """The keywords that make a dense call over documents (offsets: their cu_seqlens over the B*S tokens,
    longest: the longest one) a THD call, one sequence per document."""
    return {"layout": "thd", "cu_seqlens_q": offsets, "cu_seqlens_kv": offsets, "max_seqlen_q": longest,
            "max_seqlen_kv": longest}


def dense_result(result, layout, batch: int):
    """A THD call's result (its output, or an AttentionResult) back in the dense call's layout; anything
    else (explain's config) as it is."""
    if isinstance(result, AttentionResult):
        return AttentionResult(tokens_to_dense(result.out, layout, batch), lse_tokens_to_dense(result.lse, batch),
                               result.max_logit)
    return tokens_to_dense(result, layout, batch) if hasattr(result, "shape") else result


def call_as_thd(attention, q, k, v, options: dict, offsets, longest: int, batch: int):
    """attention() of a document-masked dense call run as THD, one sequence per document (offsets: the
    documents' cu_seqlens over the B*S tokens), its results back in q's layout."""
    layout = options.get("layout") or "bshd"
    tokens = [dense_to_tokens(x, layout) for x in (q, k, v)]
    return dense_result(attention(*tokens, **{**options, **thd_keywords(offsets, longest)}), layout, batch)


# The tensor arguments of a call: q, k, v and the tensor options (backends get them in this order,
# then the dropout state, which frontends make).
TENSOR_ARGUMENTS = ("q", "k", "v", *TENSORS)


class PreparedCall(NamedTuple):
    """A validated call: its config, the chosen backend, and the arrays to hand it
    (q, k, v unpacked, then the other tensor arguments in TENSOR_ARGUMENTS order)."""

    cfg: Any
    selection: Any
    arrays: tuple
    score_mod: Any = None  # the call's BoundScoreMod, or None
    term: Any = None  # the LearningTerm that made the bias in `arrays`, or None


class LearningTerm:
    """A score_mod's added term whose tensors learn, as the post-scale bias it runs as (it has a gradient;
    cuDNN gives a score_mod's tensors none): called with q and the call's own bias, it sums the term from
    the tensors' current values, so a repeat call of a training loop reuses the rest of the call's work.
    In q's dtype, as every bias (the cast passes the gradient back to the term's own dtype)."""

    def __init__(self, mod, cfg):
        self.mod, self.shape = mod, (cfg.batch, cfg.heads_q, cfg.seqlen_q, cfg.seqlen_kv)
        self.scale = cfg.scale if cfg.bias is BiasType.PRE_SCALE else None
        self.dtype = cfg.dtype
        self.memo: dict = {}  # what the term's sum keeps between calls (the mod's as_bias)

    def learns(self) -> bool:
        """Whether the term's tensors still ask for a gradient (else the call binds it as a score_mod)."""
        return needs_gradient(self.mod)

    def __call__(self, q, given_bias):
        term = self.mod.as_bias(self.mod.tensors, self.shape, q, self.memo)  # (read only: no copy a call)
        if given_bias is not None:  # one post-scale bias: the call's own (times the scale where pre-scale) + the term
            term = term + (given_bias if self.scale is None else given_bias * self.scale)
        ops = namespace(term)
        return term if ops.dtype_name(term) == self.dtype else ops.astype(term, self.dtype)


def prepare_call(api: str, framework: str, tensors: dict, *, describe, host_copy, is_training: bool,
                 bias_requires_grad: bool, backend, alibi_standard: bool = False, **options) -> PreparedCall:
    """Describe, validate and select for one call; shared by the torch and JAX frontends.

    describe(x, name) -> TensorMeta | None; host_copy(x) -> numpy array, or None when the
    values are not available (a JAX tracer). `options` are the call's remaining keywords.
    """
    metas = {name: describe(tensors[name], name) for name in TENSOR_ARGUMENTS}
    args = CallArguments(
        api=api, framework=framework, tensors=(metas["q"], metas["k"], metas["v"]),
        **{name: metas[name] for name in TENSOR_ARGUMENTS[3:]},
        is_training=is_training, bias_requires_grad=bias_requires_grad, alibi_standard=alibi_standard, **options,
    )
    check_offset_tensors(args)
    offsets = {name: tensors[name] for name in TENSOR_ARGUMENTS[6:] if tensors[name] is not None}
    host = {name: host_copy(x) for name, x in offsets.items()}
    host = {name: values for name, values in host.items() if values is not None}
    infer_max_seqlens(args, host, traced=set(offsets) - set(host))
    clamp_max_seqlens(args)
    bucket_max_seqlens(args, os.environ.get(ENV_THD_BUCKET))
    cfg = build_config(args)
    mod = args.score_mod
    if mod is not None and is_training:
        refuse_unfollowed(api, mod)  # (before an added term runs as a bias: it would not reach them either)
    term = None
    if mod is not None and mod.as_bias is not None and is_training and needs_gradient(mod):
        if cfg.layout.is_ragged or tensors.get("alibi_slopes") is not None:
            where = f"layout {cfg.layout.value!r}" if cfg.layout.is_ragged else "alibi_slopes"
            raise ValueError(f"{api}: score_mod: its tensors require grad, so its added term runs as a post-scale "
                             f"bias (which has a gradient), and {where} takes no bias; detach the tensors, or "
                             "use a padded layout without alibi_slopes")
        term = LearningTerm(mod, cfg)
        tensors = {**tensors, "bias": term(tensors["q"], tensors.get("bias"))}
        metas["bias"] = describe(tensors["bias"], "bias")
        args = dataclasses.replace(args, bias=metas["bias"], bias_type="post_scale", bias_requires_grad=True,
                                   score_mod=mod.beside_bias)
        cfg = build_config(args)
    bound = None
    if args.score_mod is not None:  # its key (what its callbacks build) is part of the config
        # Tensors read other than as an added term that require grad: selection keeps the backends whose
        # forward autodiff differentiates (Backend.score_mod_gradient); the others say why.
        learns = is_training and needs_gradient(args.score_mod)
        bound = bind(api, args.score_mod, batch=cfg.batch, heads_q=cfg.heads_q, seqlen_q=cfg.seqlen_q,
                     seqlen_kv=cfg.seqlen_kv, device=metas["q"].device if framework == "torch" else None,
                     training=is_training and not learns, like=tensors["q"])
        cfg = cfg.replace(score_mod_key=bound.key, score_mod_recipe=bound.recipe, score_mod_learns=learns)
    unpacked = split_packed(cfg.layout, [tensors[n] for n in ("q", "k", "v") if tensors[n] is not None])
    if len(host) == len(offsets):
        totals = (unpacked[0].shape[0], unpacked[1].shape[0]) if cfg.layout.is_ragged else (None, None)
        check_sequence_values(args, cfg, host, *totals)
    try:
        selection = select_backend(cfg, backend, call_lines=args.call_lines)
    except NoBackendError:
        raise
    except ValueError as error:  # a bad backend name, from the argument or the environment
        raise ValueError(f"{api}: {error}") from None
    return PreparedCall(cfg, selection, (*unpacked, *(tensors[n] for n in TENSOR_ARGUMENTS[3:])), bound, term)


def on_backend_only(api: str, attention, backend: str, q, k, v, kwargs: dict):
    """`attention(q, k, v, **kwargs)` forced onto one backend (its reasons raise if it cannot run)."""
    if kwargs.get("backend") not in (None, backend):
        raise ValueError(f"{api}: backend: expected None or {backend!r}, got {kwargs['backend']!r}")
    return attention(q, k, v, **{**kwargs, "backend": backend})


def slopes_are_standard(values) -> bool:
    """Whether host ALiBi slopes (Hq,) equal the paper's sequence (what cuDNN's built-in ALiBi uses)."""
    import numpy as np

    values = np.asarray(values, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        return False
    return bool(np.allclose(values, standard_alibi_slopes(int(values.size)), rtol=1e-3, atol=0.0))


class UnreadOffsetsCheck(NamedTuple):
    """The device-side check of offsets whose values were not read (see check_unread_offsets)."""

    factor: Any  # 0-d: 1, or NaN when the offsets break the rules
    safe_offsets: dict  # {keyword: the offsets, or zeros (every sequence empty) when they break the rules}


def check_unread_offsets(cfg, passed: tuple, offsets: dict, violated=None) -> UnreadOffsetsCheck | None:
    """Check on the device offsets whose values were not read (traced, or trusted GPU tensors) against
    the rules the host check enforces; `violated`, another device check, counts too. None when there
    is nothing to check.

    A broken call must not give a plausible answer, nor let a kernel read or write past the tensors:
    the frontends multiply q, k, v and the outputs by the factor (guard_inputs, poisoned) and run the
    kernels on the safe offsets. passed: q, k, v as the call passed them; offsets: {keyword: array or None}.
    """
    ragged = cfg.layout.is_ragged
    kv_tensor = passed[1] if len(passed) > 1 else passed[0]
    totals = {"q": passed[0].shape[0] if ragged else None, "kv": kv_tensor.shape[0] if ragged else None}
    limits = {"q": cfg.seqlen_q, "kv": cfg.seqlen_kv}
    bad = violated
    for side in ("q", "kv"):
        cu = offsets.get(f"cu_seqlens_{side}")
        if cu is None:
            continue
        this = offsets_violated(cu, limits[side], totals[side], offsets.get(f"cu_seqlens_{side}_padded"))
        bad = this if bad is None else bad | this
    if bad is None:
        return None
    ops = namespace(passed[0])
    safe = {name: None if x is None else ops.where(bad, 0, x) for name, x in offsets.items()}
    return UnreadOffsetsCheck(ops.where(bad, float("nan"), 1.0), safe)


def poisoned(check: UnreadOffsetsCheck | None, x):
    """x times the check's factor, in x's dtype: x bit for bit, or NaN.

    A product, not a select, so the gradient is NaN too: every output and every gradient of q, k and
    v (even of tokens the broken offsets made the kernel skip) is NaN for a broken call."""
    if check is None or x is None:
        return x
    ops = namespace(x)
    return x * ops.astype(check.factor, ops.dtype_name(x))


def guard_inputs(cfg, passed: tuple, arrays: tuple, check: UnreadOffsetsCheck | None, poison=None) -> tuple:
    """arrays (TENSOR_ARGUMENTS order, q/k/v unpacked) with q, k, v given the check's factor before they
    are split (packed layouts keep their strides) and the offsets made safe. poison(check, x): how an
    input takes the factor (default `poisoned`, a product)."""
    if check is None:
        return arrays
    poison = poisoned if poison is None else poison
    unpacked = split_packed(cfg.layout, [poison(check, x) for x in passed])
    offsets = tuple(check.safe_offsets.get(name, x) for name, x in zip(TENSOR_ARGUMENTS[6:], arrays[6:10]))
    return (*unpacked, *arrays[3:6], *offsets, *arrays[10:])
