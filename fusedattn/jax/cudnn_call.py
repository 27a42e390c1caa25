"""The cuDNN backend from JAX: each pass is one native XLA custom call (jax/native.py), with what the
graph needs around it written in jax.numpy, so XLA fuses it and no torch or Python runs at run time.

Around the graph, as the torch path does it (backends/cudnn/torch_run.py), in jax.numpy:
  before: the bias in q's dtype (pre-scaled), the sink logits, the dropout seed and offset as the
  graph's int64 (a uint32 pair), sequence lengths and THD ragged offsets from cu_seqlens, a
  score_mod's padding penalties;
  after: the LSE from cuDNN's row maxima and sums (max_logit), rows a score_mod left without keys
  (output 0, LSE -inf), rows outside every sequence (padded and THD), dBias summed over its
  broadcast axes, dSink in the sink's dtype.
A padded or THD pass does its sequence work inside the custom call instead, as the torch operator does
(jax/sequence_steps.py: the sequence table before the graph, the row fix-ups after it, Triton kernels
launched by the handler), so no XLA pass reads and rewrites a whole output; the jax.numpy forms above
stay for score_mods (padding penalties), return_max_logit and head dims that are not multiples of 8.
Such a pass also checks its offsets itself, as the torch operator's does (the table kernel flags broken
ones, reads none of them into the table, and the fix-ups write NaN into every output and gradient row;
checks_offsets), so the frontend multiplies nothing by a NaN-or-one factor around it. Other passes get
their offsets already checked or made safe by the frontend (a broken traced call runs on all-zero
offsets and its outputs are NaN), so cuDNN never reads past a buffer. Numbers of a
score_mod travel by value in the call's attributes; its arrays are operands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fusedattn.backends.cudnn.score_mod_masks import aux_name, operands
from fusedattn.backends.cudnn.sequence_layout import config_layout
from fusedattn.backends.cudnn.spec import (
    lse_without_keys,
    rows_axis,
    rows_with_keys_bias,
    rows_with_keys_config,
    rows_without_keys,
    sdpa_spec,
)
from fusedattn.config import AttentionConfig, BiasType, Layout, SoftmaxType
from fusedattn.jax import native, sequence_steps
from fusedattn.jax.partition import Split
from fusedattn.jax.pass_calls import backward_call, forward_call, output_shapes
from fusedattn.score_mods.core import MASKED, MASKED_BELOW, may_empty_rows
from fusedattn.xp.jax_ops import OPS

__all__ = ["unavailable", "checks_offsets", "forward", "backward"]

_SCALAR_BITS = {"float32": np.float32, "int32": np.int32}


def unavailable() -> str | None:
    """Why cuDNN passes cannot run as native custom calls here (None: they can)."""
    return native.unavailable()


class _Sequences:
    """A padded or THD call's per-sequence facts as JAX arrays: lengths, starts, the graph's inputs."""

    def __init__(self, cfg: AttentionConfig, named: dict):
        self.cfg = cfg
        self.lengths, self.starts = {}, {}
        for side in ("q", "kv"):
            cu = named[f"cu_seqlens_{side}"].astype(jnp.int32)
            padded = named.get(f"cu_seqlens_{side}_padded")
            self.lengths[side] = cu[1:] - cu[:-1]
            self.starts[side] = cu if padded is None else padded.astype(jnp.int32)
        self.inputs = {"seq_len_q": self.lengths["q"].reshape(-1, 1, 1, 1),
                       "seq_len_kv": self.lengths["kv"].reshape(-1, 1, 1, 1)}
        layout = config_layout(cfg)
        for index, (name, unit) in enumerate(layout.offsets):  # THD: element offsets of each sequence
            side = "q" if index < layout.queries else "kv"
            self.inputs["ro_" + name] = (self.starts[side] * unit).reshape(-1, 1, 1, 1)

    def within(self, side: str):
        """(B, S) booleans of one side's padded positions: True inside the sequence."""
        seqlen = self.cfg.seqlen_q if side == "q" else self.cfg.seqlen_kv
        return jnp.arange(seqlen, dtype=jnp.int32)[None, :] < self.lengths[side][:, None]

    def rows(self, side: str, x) -> tuple:
        """(inside, alone) booleans of the rows of `x`, a tensor of that side: (B, S) for padded layouts,
        (T,) for THD. inside: the row belongs to a sequence; alone: it does, and the other side of that
        sequence is empty."""
        other = self.lengths["kv" if side == "q" else "q"]
        if not self.cfg.layout.is_ragged:
            inside = self.within(side)
            return inside, inside & (other[:, None] == 0)
        tokens = jnp.arange(x.shape[0], dtype=jnp.int32)
        starts = self.starts[side][:-1]
        sequence = jnp.clip(OPS.searchsorted(starts, tokens, right=True) - 1, 0, self.cfg.batch - 1)
        position = tokens - starts[sequence]
        inside = (position >= 0) & (position < self.lengths[side][sequence])
        return inside, inside & (other[sequence] == 0)


_LSE_TO_OUT = {Layout.BSHD: (0, 2, 1), Layout.SBHD: (2, 0, 1), Layout.BHSD: (0, 1, 2)}  # (B, H, S) -> layout


def _lse_to_out(mask, cfg: AttentionConfig):
    """An LSE-shaped mask ((B, H, Sq), or THD's (T, H)) against out (or a gradient) in the call's layout."""
    if cfg.layout.is_ragged:
        return mask[..., None]
    return mask.transpose(_LSE_TO_OUT[cfg.layout])[..., None]


def _rows_as(rows, cfg: AttentionConfig, lse: bool = False):
    """A (B, S) or (T,) row mask against the LSE ((B, H, S) / (T, H)), or else against a tensor in the
    call's layout."""
    as_lse = rows[:, None] if cfg.layout.is_ragged else rows[:, None, :]
    return as_lse if lse else _lse_to_out(as_lse, cfg)


def _clear_rows(x, rows, cfg: AttentionConfig):
    """x with the rows outside every sequence, or whose other side is empty, set to 0."""
    inside, alone = rows
    return jnp.where(_rows_as(inside & ~alone, cfg), x, jnp.zeros((), x.dtype))


def _graph_inputs(cfg: AttentionConfig, named: dict, aux: dict, score_mod, sequences: _Sequences | None) -> dict:
    """The graph's inputs by graph tensor name (besides o, dO and stats)."""
    spec = sdpa_spec(cfg)
    q = named["q"]
    inputs = {"q": q, "k": named["k"], "v": named["v"]}
    if sequences is not None:
        inputs.update(sequences.inputs)
    if spec.bias is not None:
        bias = named["bias"].astype(q.dtype)
        if cfg.bias is BiasType.PRE_SCALE:  # (qk + b) * scale == qk * scale + b * scale
            bias = bias * jnp.asarray(cfg.scale, q.dtype)
        inputs["bias"] = bias.reshape(cfg.bias_shape)
    if spec.sink:
        sink = (named["sink"].astype(jnp.float32) if cfg.softmax is SoftmaxType.LEARNABLE
                else jnp.zeros((cfg.heads_q,), jnp.float32))  # off_by_one: a zero logit per head
        inputs["sink"] = sink.reshape(1, cfg.heads_q, 1, 1)
    if spec.dropout:  # the graph's int64 seed and offset: the uint32 value, then zero (little-endian)
        for name in ("dropout_seed", "dropout_offset"):
            value = jnp.reshape(named[name], ()).astype(jnp.uint32)
            inputs[name] = jnp.stack([value, jnp.zeros((), jnp.uint32)])
    if spec.score_mod:
        inputs.update({aux_name(name): array for name, array in aux.items()})
        if sequences is not None:  # padding written in the score_mod: 0 inside each sequence, MASKED outside
            penalty = {side: jnp.where(sequences.within(side), 0.0, MASKED).astype(jnp.float32) for side in ("q", "kv")}
            inputs["sm_row_penalty"] = penalty["q"][:, None, :, None]
            inputs["sm_col_penalty"] = penalty["kv"][:, None, None, :]
    return inputs


def _scalars(cfg: AttentionConfig, score_mod) -> tuple[tuple[str, ...], np.ndarray]:
    """The pass-by-value inputs: (graph names, their 4-byte values as int32 bits)."""
    entries = operands(cfg).by_value(score_mod.values)
    bits = [np.asarray(value, _SCALAR_BITS[dtype]).view(np.int32) for _, value, dtype in entries]
    return tuple(name for name, _, _ in entries), np.asarray(bits, np.int32).reshape(-1)


def _launch(cfg: AttentionConfig, direction: str, inputs: dict, results: dict, score_mod,
            steps_of=None) -> dict:
    """One custom call: the graph reads `inputs` and writes `results` ({name: ShapeDtypeStruct}), by
    graph tensor name; the results as {name: array}. Names the graph lacks are left unbound.
    steps_of(device): the call's own kernels around the graph (sequence_steps), whose table slots the
    graph reads; None: none."""
    from fusedattn.backends.cudnn.graph_cache import current_device

    device = current_device("jax")
    scalar_names, scalar_bits = _scalars(cfg, score_mod) if cfg.score_mod_key is not None else ((), None)
    steps = None if steps_of is None else steps_of(device)
    if steps is not None:
        results = dict(results, **{sequence_steps.TABLE: jax.ShapeDtypeStruct(steps.table_shape, jnp.int32)})
    derived = () if steps is None else tuple(steps.table_slots)
    in_names, out_names = tuple(inputs), tuple(results)
    plan = native.plan(cfg, direction, device, in_names + out_names, scalar_names, derived)
    if plan is None:
        raise RuntimeError(f"fusedattn.jax.attention: cudnn: the {direction} graph cannot run as a native call "
                           "(cuDNN could not rebuild it from its bytes); use backend='reference'")
    workspace = jax.ShapeDtypeStruct((max(plan.workspace, 1),), jnp.uint8)
    call = jax.ffi.ffi_call(native.TARGET, (*results.values(), workspace), vmap_method="sequential")
    bits = np.zeros((0,), np.int32) if scalar_bits is None else scalar_bits
    own = native.attributes_of_steps(steps, in_names + out_names + ("workspace",), derived, device)
    outs = call(*inputs.values(), **plan.attributes, scalars=bits, **own)
    return dict(zip(out_names, outs[:-1]))


def _own_fixes(cfg: AttentionConfig) -> bool:
    """Whether a padded or THD pass runs its table and fix-ups in the custom call (sequence_steps)."""
    return cfg.has_sequence_lengths and sequence_steps.unsupported(cfg) is None


def checks_offsets(cfg: AttentionConfig) -> bool:
    """Whether cfg's passes check their sequence offsets on the device themselves: given broken ones, the
    custom call reads none of them and writes NaN into every output and gradient (the poisoned ones here)."""
    return not rows_without_keys(cfg) and _own_fixes(cfg)


def _poisoned_by_table(x, cfg: AttentionConfig, table):
    """x, or NaN where the call's sequence table flags its offsets as broken (a small gradient the
    fix-ups do not reach: dBias, dSink)."""
    broken = table[config_layout(cfg).flag_row, 0] != 0
    return jnp.where(broken, jnp.full((), jnp.nan, x.dtype), x)


def _offsets(named: dict) -> dict:
    """The call's sequence offsets as int32 operands, by sequence_steps.OFFSET_NAMES."""
    return {name: named[name].astype(jnp.int32) for name in sequence_steps.OFFSET_NAMES if named.get(name) is not None}


def _sequences(cfg: AttentionConfig, named: dict) -> _Sequences | None:
    return _Sequences(cfg, named) if cfg.has_sequence_lengths else None


def _may_empty_rows(cfg: AttentionConfig, score_mod) -> bool:
    """Whether the score_mod can leave a row without keys (score_mods.core.may_empty_rows): its numbers are
    known when the call is traced, its float arrays are not (they may)."""
    return may_empty_rows(cfg, score_mod, lambda x: jnp.issubdtype(x.dtype, jnp.floating), lambda arrays: True)


def _forward_pass(cfg: AttentionConfig, named: dict, aux: dict, score_mod) -> tuple:
    """(out, lse, max_logit) of one unsharded forward."""
    if rows_without_keys(cfg):
        return _forward_rows_with_keys(cfg, named, aux, score_mod)
    if _own_fixes(cfg):
        return _forward_own_fixes(cfg, named, aux, score_mod)
    spec = sdpa_spec(cfg)
    q = named["q"]
    sequences = _sequences(cfg, named)
    out_shape, lse_shape, max_shape = output_shapes(cfg, q)
    stats_shape = (q.shape[0], cfg.heads_q) if spec.ragged else spec.stats.dim
    stats = jax.ShapeDtypeStruct(stats_shape, jnp.float32)
    results = {"o": out_shape}
    if spec.max_logit:
        results.update(row_max=stats, sum_exp=stats)
    else:
        results["stats"] = stats  # unbound (never written) for an inference graph without it
    got = _launch(cfg, "forward", _graph_inputs(cfg, named, aux, score_mod, sequences), results, score_mod)
    out = got["o"]
    max_logit = jnp.zeros(max_shape.shape, jnp.float32)
    if spec.max_logit:
        row_max = got["row_max"]
        if sequences is not None:  # cuDNN leaves row maxima unwritten past each end and without keys
            inside, alone = sequences.rows("q", q)
            row_max = jnp.where((inside & ~alone)[:, None, :, None], row_max, -jnp.inf)
        lse = row_max + jnp.log(got["sum_exp"])
        max_logit = jnp.max(row_max, axis=(0, 2, 3))
    else:
        lse = got["stats"]
    lse = lse.reshape(lse_shape.shape)
    if spec.score_mod and _may_empty_rows(cfg, score_mod):  # rows left without a visible key (or NaN)
        empty = ~(lse >= MASKED_BELOW)
        out = jnp.where(_lse_to_out(empty, cfg), jnp.zeros((), out.dtype), out)
        lse = jnp.where(empty, -jnp.inf, lse)
    if sequences is not None:
        out, lse = _fix_forward_rows(cfg, sequences, out, lse, named.get("sink"))
    return out, lse, max_logit


def _forward_own_fixes(cfg: AttentionConfig, named: dict, aux: dict, score_mod) -> tuple:
    """A padded or THD forward whose custom call builds its sequence table and fixes its rows itself."""
    q = named["q"]
    out_shape, lse_shape, max_shape = output_shapes(cfg, q)
    spec = sdpa_spec(cfg)
    stats_shape = (q.shape[0], cfg.heads_q) if spec.ragged else spec.stats.dim
    results = {"o": out_shape, "stats": jax.ShapeDtypeStruct(stats_shape, jnp.float32)}
    inputs = {**_graph_inputs(cfg, named, aux, score_mod, None), **_offsets(named)}
    shapes = {"q": q.shape, "k": named["k"].shape, "o": out_shape.shape, "stats": lse_shape.shape}
    got = _launch(cfg, "forward", inputs, results, score_mod,
                  lambda device: sequence_steps.forward(cfg, device, shapes))
    return got["o"], got["stats"].reshape(lse_shape.shape), jnp.zeros(max_shape.shape, jnp.float32)


def _fix_forward_rows(cfg: AttentionConfig, sequences: _Sequences, out, lse, sink) -> tuple:
    """Rows outside every sequence: output 0 and LSE -inf (THD gaps: 0); queries whose sequence has
    no keys: output 0 and the LSE of the sink alone (-inf without one)."""
    rows = sequences.rows("q", out)
    inside, alone = rows
    out = _clear_rows(out, rows, cfg)
    sink_lse = lse_without_keys(cfg, sink, lse)
    sink_lse = sink_lse[None, :] if cfg.layout.is_ragged else sink_lse[None, :, None]
    lse = jnp.where(_rows_as(alone, cfg, lse=True), sink_lse, lse)
    gap = 0.0 if cfg.layout.is_ragged else -jnp.inf
    return out, jnp.where(_rows_as(inside, cfg, lse=True), lse, gap)


def _backward_pass(cfg: AttentionConfig, named: dict, aux: dict, score_mod, out, lse, grad_out,
                   wanted: tuple[str, ...]) -> dict:
    """{name: gradient} of one unsharded backward, for the differentiable arrays in `wanted`."""
    if rows_without_keys(cfg):
        return _backward_rows_with_keys(cfg, named, aux, score_mod, out, lse, grad_out, wanted)
    spec = sdpa_spec(cfg)
    own_fixes = _own_fixes(cfg)
    sequences = None if own_fixes else _sequences(cfg, named)
    inputs = _graph_inputs(cfg, named, aux, score_mod, sequences)
    if own_fixes:
        inputs.update(_offsets(named))
    if spec.score_mod:  # +inf for empty rows, so exp(score - stats) is 0 there
        stats = jnp.where(lse == -jnp.inf, jnp.inf, lse)
    elif sequences is not None and not spec.ragged:  # finite past each sequence's end
        stats = jnp.where(sequences.within("q")[:, None, :], lse, 0.0)
    elif own_fixes and not spec.ragged:  # finite past each sequence's end (and for queries without keys)
        stats = jnp.where(lse == -jnp.inf, 0.0, lse)
    else:
        stats = lse
    inputs.update(o=out, dO=jnp.zeros_like(out) if grad_out is None else grad_out.astype(out.dtype),
                  stats=stats if spec.ragged else stats.reshape(spec.stats.dim))
    results = {"d" + role: jax.ShapeDtypeStruct(named[role].shape, named[role].dtype) for role in ("q", "k", "v")}
    if spec.bias is not None and cfg.bias_requires_grad:  # what the graph writes (graphs.build_backward)
        results["dbias"] = jax.ShapeDtypeStruct(spec.bias.dim, named["q"].dtype)
    if spec.sink:  # written for an off-by-one sink too, and not returned
        results["dsink"] = jax.ShapeDtypeStruct((1, cfg.heads_q, 1, 1), jnp.float32)
    shapes = {role: named[role].shape for role in ("q", "k", "v")}
    steps_of = (lambda device: sequence_steps.backward(cfg, device, shapes)) if own_fixes else None
    got = _launch(cfg, "backward", inputs, results, score_mod, steps_of)
    grads = {role: got["d" + role] for role in ("q", "k", "v")}
    if sequences is not None:  # rows outside every sequence, or without the other side: 0
        grads["q"] = _clear_rows(grads["q"], sequences.rows("q", grads["q"]), cfg)
        kv_rows = sequences.rows("kv", grads["k"])
        grads["k"], grads["v"] = (_clear_rows(grads[role], kv_rows, cfg) for role in ("k", "v"))
    if "dbias" in got:
        axes = tuple(i for i, (g, s) in enumerate(zip(spec.bias.dim, cfg.bias_shape)) if s == 1 and g != 1)
        dbias = got["dbias"].astype(jnp.float32).sum(axis=axes, keepdims=True)
        if cfg.bias is BiasType.PRE_SCALE:
            dbias = dbias * cfg.scale
        grads["bias"] = dbias.reshape(named["bias"].shape).astype(named["bias"].dtype)
    if "dsink" in got and cfg.softmax is SoftmaxType.LEARNABLE:
        grads["sink"] = got["dsink"].reshape(cfg.heads_q).astype(named["sink"].dtype)
    if own_fixes:
        grads.update({name: _poisoned_by_table(grads[name], cfg, got[sequence_steps.TABLE])
                      for name in ("bias", "sink") if name in grads})
    return {name: grads[name] for name in wanted if name in grads}


# Bottom-right causal with Sq > Skv: the first Sq - Skv query rows see no key. cuDNN refuses the mask
# there, so the last Skv rows run on their own and the others are filled in (output 0, the LSE of the
# sink term alone: -inf without one).
def _rows_with_keys(cfg: AttentionConfig, named: dict) -> tuple:
    skipped, axis = rows_without_keys(cfg), rows_axis(cfg)
    named = dict(named, q=jax.lax.slice_in_dim(named["q"], skipped, cfg.seqlen_q, axis=axis),
                 bias=rows_with_keys_bias(cfg, named.get("bias")))
    return rows_with_keys_config(cfg), skipped, axis, named


def _pad_rows(x, skipped: int, axis: int, fill):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (skipped, 0)
    return jnp.pad(x, widths, constant_values=fill)


def _forward_rows_with_keys(cfg: AttentionConfig, named: dict, aux: dict, score_mod) -> tuple:
    sub, skipped, axis, named = _rows_with_keys(cfg, named)
    out, lse, max_logit = _forward_pass(sub, named, aux, score_mod)
    empty = jnp.broadcast_to(lse_without_keys(cfg, named.get("sink"), lse)[None, :, None], (*lse.shape[:2], skipped))
    return _pad_rows(out, skipped, axis, 0), jnp.concatenate([empty, lse], axis=2), max_logit


def _backward_rows_with_keys(cfg: AttentionConfig, named: dict, aux: dict, score_mod, out, lse, grad_out,
                             wanted: tuple[str, ...]) -> dict:
    sub, skipped, axis, sub_named = _rows_with_keys(cfg, named)
    rows = lambda x: jax.lax.slice_in_dim(x, skipped, cfg.seqlen_q, axis=axis)  # noqa: E731
    grads = _backward_pass(sub, sub_named, aux, score_mod, rows(out), lse[:, :, skipped:],
                           None if grad_out is None else rows(grad_out), wanted)
    grads["q"] = _pad_rows(grads["q"], skipped, axis, 0)
    if "bias" in grads and sub.bias_shape != cfg.bias_shape:
        full = _pad_rows(grads["bias"].reshape(sub.bias_shape), skipped, 2, 0)
        grads["bias"] = full.reshape(named["bias"].shape)
    return grads


def forward(cfg: AttentionConfig, score_mod, arrays, split: Split | None = None) -> tuple:
    """(out, lse, max_logit) of the cuDNN forward, as JAX arrays."""
    return forward_call(cfg, score_mod, arrays, split, lambda c, named, aux: _forward_pass(c, named, aux, score_mod))


def backward(cfg: AttentionConfig, score_mod, arrays, out, lse, grad_out, grad_lse=None,
             split: Split | None = None) -> dict:
    """{name: gradient} for the differentiable arrays the call passed; grad_out None means zero. cuDNN
    has no LSE gradient: the frontend refuses one before this (grad_lse is never read)."""
    def run_pass(c, named, aux, out, lse, grad_out, _grad_lse, wanted):
        return _backward_pass(c, named, aux, score_mod, out, lse, grad_out, wanted)

    return backward_call(cfg, score_mod, arrays, out, lse, grad_out, None, split, run_pass)
