"""Keys of cuDNN-native score_mod callbacks come from what they build (no cudnn needed)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from fusedattn.score_mods.key import structural_key


def softcap(cap):
    def mod(graph, score, tensors):
        x = graph.div(a=score, b=graph.tensor_scalar(cap, "RUNTIME_PARAM"))
        return graph.mul(a=graph.tanh(input=x), b=graph.tensor_scalar(cap, "RUNTIME_PARAM"))

    return mod


def add_bias(graph, score, tensors):
    return graph.add(a=score, b=tensors["bias"])


def scale_by(graph, score, tensors):
    return graph.mul(a=score, b=tensors["factor"])


def test_the_same_function_gives_the_same_key():
    bias = torch.zeros(1, 4, 8, 8)
    assert structural_key(add_bias, {"bias": bias}) == structural_key(add_bias, {"bias": torch.ones(1, 4, 8, 8)})


def test_two_module_level_lambdas_that_build_different_graphs_differ():
    a = lambda graph, score, tensors: graph.tanh(input=score)  # noqa: E731
    b = lambda graph, score, tensors: graph.sigmoid(input=score)  # noqa: E731
    assert structural_key(a) != structural_key(b)


def test_closures_over_different_baked_constants_differ():
    assert structural_key(softcap(30.0)) != structural_key(softcap(50.0))
    assert structural_key(softcap(30.0)) == structural_key(softcap(30.0))


class Builder:
    def __init__(self, op):
        self.op = op

    def __call__(self, graph, score, tensors):
        return getattr(graph, self.op)(input=score)


def test_instances_that_build_different_graphs_differ_even_at_a_reused_address():
    keys = []
    for op in ("tanh", "exp", "tanh"):
        instance = Builder(op)  # the previous instance is freed: its address may be reused
        keys.append(structural_key(instance))
        del instance
        gc.collect()
    assert keys[0] != keys[1] and keys[0] == keys[2]


@pytest.mark.parametrize("first,second", [(30.0, 5.0), (np.float32(2.0), np.float32(3.0)), (7, 9),
                                          (torch.tensor(1.5), torch.tensor(2.5))])
def test_changing_a_runtime_scalar_value_keeps_the_key(first, second):
    assert structural_key(scale_by, {"factor": first}) == structural_key(scale_by, {"factor": second})


def test_aux_shape_dtype_or_strides_change_the_key():
    base = structural_key(add_bias, {"bias": torch.zeros(1, 4, 8, 8)})
    assert structural_key(add_bias, {"bias": torch.zeros(2, 4, 8, 8)}) != base
    assert structural_key(add_bias, {"bias": torch.zeros(1, 4, 8, 8, dtype=torch.float16)}) != base
    assert structural_key(add_bias, {"bias": torch.zeros(1, 4, 8, 8).transpose(2, 3)}) != base


def test_bprop_is_part_of_the_key():
    def bprop(graph, dscore, tensors):
        return graph.mul(a=dscore, b=tensors["factor"])

    assert structural_key(scale_by, {"factor": 2.0}) != structural_key(scale_by, {"factor": 2.0}, bprop,
                                                                            {"factor": 2.0})


def test_tensor_methods_are_recorded():
    def typed(graph, score, tensors):
        mask = graph.cmp_gt(input=score, comparison=graph.tensor_scalar(0.0, "RUNTIME_PARAM"))
        mask.set_data_type("BOOLEAN")
        return graph.binary_select(input0=score, input1=score, mask=mask)

    def untyped(graph, score, tensors):
        mask = graph.cmp_gt(input=score, comparison=graph.tensor_scalar(0.0, "RUNTIME_PARAM"))
        return graph.binary_select(input0=score, input1=score, mask=mask)

    assert structural_key(typed) != structural_key(untyped)


@pytest.mark.parametrize("callback,match", [
    (lambda graph, score, tensors: 1.0, "return a graph tensor"),
    (lambda graph, score, tensors: tensors["missing"], "failed while its graph was recorded"),
    ("not callable", "expected a callable"),
])
def test_bad_callbacks_get_clear_errors(callback, match):
    with pytest.raises(ValueError, match=match):
        structural_key(callback)
