"""Building the cuDNN frontend graphs of a config (forward and backward).

Each graph remembers its IR tensors by our names, so a run binds buffers by name.
Only called on a machine with a GPU and `nvidia-cudnn-frontend` installed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import cudnn

from fusedattn.backends.cudnn.spec import SdpaSpec, TensorSpec, gradient_spec, short_reason
from fusedattn.config import AttentionConfig

__all__ = ["BuiltGraph", "build_forward", "build_backward", "GraphBuildError"]

_IO_TYPES = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16}
_FLOAT = cudnn.data_type.FLOAT
# The frontend logs every declined plan at WARNING; a decline is an answer for us, not noise.
logging.getLogger("cudnn.pygraph").setLevel(logging.ERROR)


class GraphBuildError(Exception):
    """cuDNN declined to build a graph; the message is cuDNN's own, shortened."""


@dataclass
class BuiltGraph:
    graph: object
    tensors: dict = field(default_factory=dict)  # our name -> IR tensor
    workspace: int = 0
    engine: str = ""


def _declare(graph, tensors: dict, name: str, spec: TensorSpec, data_type):
    tensors[name] = graph.tensor(name=name, dim=list(spec.dim), stride=list(spec.stride), data_type=data_type)
    return tensors[name]


def _output(tensors: dict, name: str, tensor, spec: TensorSpec, data_type=None):
    tensor.set_output(True).set_dim(list(spec.dim)).set_stride(list(spec.stride))
    if data_type is not None:
        tensor.set_data_type(data_type)
    tensors[name] = tensor
    return tensor


def _mask_kwargs(spec: SdpaSpec) -> dict:
    kwargs = {}
    if spec.right_bound is not None or spec.left_bound is not None:
        kwargs["diagonal_alignment"] = (cudnn.diagonal_alignment.TOP_LEFT if spec.top_left
                                        else cudnn.diagonal_alignment.BOTTOM_RIGHT)
    if spec.right_bound is not None:
        kwargs["diagonal_band_right_bound"] = spec.right_bound
    if spec.left_bound is not None:
        kwargs["diagonal_band_left_bound"] = spec.left_bound
    return kwargs


_INDEX = TensorSpec((1, 1, 1, 1), (1, 1, 1, 1))


def _ragged(graph, tensors: dict, cfg: AttentionConfig, spec: SdpaSpec, name: str, tensor):
    """Give a THD tensor its per-sequence start offsets (an int32 (B+1, 1, 1, 1) input "ro_<name>")."""
    if spec.ragged:
        offsets = TensorSpec((cfg.batch + 1, 1, 1, 1), (1, 1, 1, 1))
        tensor.set_ragged_offset(_declare(graph, tensors, "ro_" + name, offsets, cudnn.data_type.INT32))
    return tensor


def _common_inputs(graph, tensors: dict, cfg: AttentionConfig, spec: SdpaSpec) -> dict:
    """Tensors and attributes shared by forward and backward (they must match)."""
    io = _IO_TYPES[cfg.dtype]
    kwargs = {role: _ragged(graph, tensors, cfg, spec, role, _declare(graph, tensors, role, getattr(spec, role), io))
              for role in ("q", "k", "v")}
    kwargs.update(attn_scale=cfg.scale, **_mask_kwargs(spec))
    if spec.padding:
        lengths = TensorSpec((cfg.batch, 1, 1, 1), (1, 1, 1, 1))
        kwargs["use_padding_mask"] = True
        kwargs["seq_len_q"] = _declare(graph, tensors, "seq_len_q", lengths, cudnn.data_type.INT32)
        kwargs["seq_len_kv"] = _declare(graph, tensors, "seq_len_kv", lengths, cudnn.data_type.INT32)
    if spec.bias is not None:
        kwargs["bias"] = _declare(graph, tensors, "bias", spec.bias, io)
    if spec.sink:
        heads = cfg.heads_q
        kwargs["sink_token"] = _declare(graph, tensors, "sink", TensorSpec((1, heads, 1, 1), (heads, 1, 1, 1)), _FLOAT)
    if spec.dropout:
        seed = _declare(graph, tensors, "dropout_seed", _INDEX, cudnn.data_type.INT64)
        offset = _declare(graph, tensors, "dropout_offset", _INDEX, cudnn.data_type.INT64)
        kwargs["dropout"] = (cfg.dropout_p, seed, offset)
    return kwargs


def _finish(graph, tensors: dict, what: str) -> BuiltGraph:
    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception as error:  # cuDNN reports declines through several exception types
        raise GraphBuildError(f"{what} graph: {short_reason(error)}") from error
    engine = getattr(graph, "selected_engine", None)
    name = "" if engine is None else getattr(engine, "name", str(engine))
    extras = sorted(n for n in tensors if n in _FEATURE_TENSORS)
    if engine is not None and extras:
        # The frontend's Python (CuTe DSL) engines are chosen by a separate analysis that
        # does not see every attribute; only the cuDNN library is trusted with these.
        raise GraphBuildError(f"{what} graph: served by the frontend's Python engine {name}, which is not "
                              f"trusted with {', '.join(extras)}")
    return BuiltGraph(graph, tensors, graph.get_workspace_size(), name)


# Inputs whose semantics a Python engine might drop silently.
_FEATURE_TENSORS = frozenset({"bias", "sink", "dropout_seed", "seq_len_q", "ro_q"})


def build_forward(cfg: AttentionConfig, spec: SdpaSpec, handle, dump_dropout: bool = False) -> BuiltGraph:
    """The forward graph; dump_dropout adds cuDNN's debug output of the dropout mask (tests only)."""
    graph = cudnn.pygraph(io_data_type=_IO_TYPES[cfg.dtype], intermediate_data_type=_FLOAT,
                          compute_data_type=_FLOAT, handle=handle)
    tensors: dict = {}
    kwargs = _common_inputs(graph, tensors, cfg, spec)
    # cuDNN outputs either the LSE or the row max with the row sum of exp(s - max), not
    # both: with max_logit requested, the LSE is max + log(sum_exp), computed by the caller.
    if spec.max_logit:
        for name, key in (("row_max", "score_max"), ("sum_exp", "score_sum_exp")):
            kwargs[key] = graph.tensor(name=name, dim=list(spec.stats.dim), stride=list(spec.stats.stride),
                                       data_type=_FLOAT)
    if dump_dropout:
        scores = (cfg.batch, cfg.heads_q, cfg.seqlen_q, cfg.seqlen_kv)
        kwargs["rng_dump"] = graph.tensor(name="rng_dump", dim=list(scores), stride=list(_dense(scores)),
                                          data_type=_FLOAT)
    o, stats = graph.sdpa(name="sdpa", generate_stats=not spec.max_logit, **kwargs)
    _ragged(graph, tensors, cfg, spec, "o", _output(tensors, "o", o, spec.o))
    if spec.max_logit:
        _output(tensors, "row_max", kwargs["score_max"], spec.stats, _FLOAT)
        _output(tensors, "sum_exp", kwargs["score_sum_exp"], spec.stats, _FLOAT)
    else:
        _ragged(graph, tensors, cfg, spec, "stats", _output(tensors, "stats", stats, spec.stats, _FLOAT))
    if dump_dropout:
        dims = (cfg.batch, cfg.heads_q, cfg.seqlen_q, cfg.seqlen_kv)
        _output(tensors, "rng_dump", kwargs["rng_dump"], TensorSpec(dims, _dense(dims)), _FLOAT)
    return _finish(graph, tensors, "forward")


def build_backward(cfg: AttentionConfig, spec: SdpaSpec, handle) -> BuiltGraph:
    graph = cudnn.pygraph(io_data_type=_IO_TYPES[cfg.dtype], intermediate_data_type=_FLOAT,
                          compute_data_type=_FLOAT, handle=handle)
    tensors: dict = {}
    io = _IO_TYPES[cfg.dtype]
    kwargs = _common_inputs(graph, tensors, cfg, spec)
    kwargs["o"] = _ragged(graph, tensors, cfg, spec, "o", _declare(graph, tensors, "o", spec.o, io))
    kwargs["dO"] = _declare(graph, tensors, "dO", spec.o, io)
    if spec.ragged:  # dO is laid out like o
        kwargs["dO"].set_ragged_offset(tensors["ro_o"])
    kwargs["stats"] = _ragged(graph, tensors, cfg, spec, "stats", _declare(graph, tensors, "stats", spec.stats, _FLOAT))
    if spec.bias is not None and cfg.bias_requires_grad:
        dims = spec.bias.dim
        kwargs["dBias"] = graph.tensor(name="dbias", dim=list(dims), stride=list(_dense(dims)), data_type=io)
    if spec.sink:
        heads = cfg.heads_q
        kwargs["dSink_token"] = graph.tensor(name="dsink", dim=[1, heads, 1, 1], stride=[heads, 1, 1, 1],
                                             data_type=_FLOAT)
    if cfg.deterministic:
        kwargs["use_deterministic_algorithm"] = True
    dq, dk, dv = graph.sdpa_backward(name="sdpa_backward", **kwargs)
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        _ragged(graph, tensors, cfg, spec, name, _output(tensors, name, grad, gradient_spec(getattr(spec, name[1]))))
    if "dBias" in kwargs:
        _output(tensors, "dbias", kwargs["dBias"], TensorSpec(spec.bias.dim, _dense(spec.bias.dim)))
    if spec.sink:
        _output(tensors, "dsink", kwargs["dSink_token"], TensorSpec((1, cfg.heads_q, 1, 1), (cfg.heads_q, 1, 1, 1)),
                _FLOAT)
    return _finish(graph, tensors, "backward")


def _dense(dim) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(dim):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
