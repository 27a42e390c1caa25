"""A config's score_mod inside a cuDNN graph: aux tensors, the user's callbacks, and the
masks cuDNN cannot combine with a score_mod (causal, windows, padding), composed after it.

cuDNN disables its own mask options when a score_mod is present, so the masks are graph
ops here: query and key positions (per sequence for packed layouts), comparisons, and a
select that writes MASKED. Names of graph tensors: "mod:<name>" for the user's aux
entries, "sm_<name>" for ours.
"""

from __future__ import annotations

import cudnn

from fusedattn.backends.cudnn.score_mod_masks import aux_name, mask_plan
from fusedattn.backends.cudnn.spec import dense
from fusedattn.config import AttentionConfig
from fusedattn.score_mods.graph_ops import both, col_index, compare, index_plus, keep_where, row_index
from fusedattn.score_mods.key import aux_used

__all__ = ["declare_score_mod"]

_DATA_TYPES = {"float16": cudnn.data_type.HALF, "bfloat16": cudnn.data_type.BFLOAT16,
               "float32": cudnn.data_type.FLOAT, "int32": cudnn.data_type.INT32}
_SCALAR = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], is_pass_by_value=True)


def _declare_aux(graph, name: str, description: tuple):
    if description[0] == "scalar":
        return graph.tensor(name=name, data_type=_DATA_TYPES[description[1]], **_SCALAR)
    _, shape, dtype, stride = description
    return graph.tensor(name=name, dim=list(shape), stride=list(stride), data_type=_DATA_TYPES[dtype])


def declare_score_mod(graph, tensors: dict, cfg: AttentionConfig, backward: bool) -> dict:
    """Declare the score_mod's inputs on the outer graph; the sdpa keywords that run it.

    Both callbacks of one build share a dict, so forward can leave intermediates for bprop.
    """
    recipe, plan = cfg.score_mod_recipe, mask_plan(cfg)
    used = aux_used(recipe.forward, [name for name, _ in recipe.aux], recipe.bprop if backward else None)
    shared = {}
    for name, description in recipe.aux:
        if name in used:
            shared[name] = tensors[aux_name(name)] = _declare_aux(graph, aux_name(name), description)

    def declare(name, dim, data_type=cudnn.data_type.FLOAT, stride=None):
        if dim is None:
            tensors[name] = graph.tensor(name=name, data_type=data_type, **_SCALAR)
        else:
            stride = stride or dense(dim).stride
            tensors[name] = graph.tensor(name=name, dim=list(dim), stride=list(stride), data_type=data_type)
        return tensors[name]

    mask = {}
    if plan.padding:  # the column penalty is one row read with a zero query stride (see core._normalize)
        mask["row_penalty"] = declare("sm_row_penalty", (cfg.batch, 1, cfg.seqlen_q, 1))
        mask["col_penalty"] = declare("sm_col_penalty", (cfg.batch, 1, cfg.seqlen_q, cfg.seqlen_kv),
                                      stride=(cfg.seqlen_kv, cfg.seqlen_kv, 0, 1))
    if plan.left or plan.right:
        mask["masked"] = declare("sm_masked", None)
    for name in plan.scalar_bounds(cfg):
        mask[name] = declare(name, None, cudnn.data_type.INT32)

    def forward(callback_graph, score):
        g = callback_graph
        score = recipe.forward(g, score, shared)
        if plan.padding:
            score = g.add(a=g.add(a=score, b=mask["row_penalty"]), b=mask["col_penalty"])
        if not (plan.left or plan.right):
            return score
        row, col = row_index(g, score), col_index(g, score)
        keep = None
        if plan.left:
            keep = compare(g, "le", index_plus(g, row, mask["sm_row_shift"]), index_plus(g, col, mask["sm_left"]))
        if plan.right:
            near = compare(g, "le", index_plus(g, col, mask["sm_col_shift"]), index_plus(g, row, mask["sm_right"]))
            keep = both(g, keep, near)
        return keep_where(g, score, keep, mask["masked"])

    kwargs = {"score_mod": forward}
    if backward and recipe.bprop is not None:
        kwargs["score_mod_bprop"] = lambda callback_graph, dscore: recipe.bprop(callback_graph, dscore, shared)
    return kwargs
