"""The options are written once (fusedattn/options.py): signatures, keyword checks, docstrings, the
modules' pass-through and the config's inputs all follow the table."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from needs_torch import HAS_TORCH, requires_torch

from fusedattn import options
from fusedattn.arguments import CallArguments
from fusedattn.backends.base import ARRAY_NAMES
from fusedattn.frontend_common import TENSOR_ARGUMENTS

torch_frontend = requires_torch("the torch frontend")
if HAS_TORCH:
    import torch

    import fusedattn.torch as fat

    Q = torch.randn(1, 8, 2, 4)


def _jax():
    pytest.importorskip("jax")
    import fusedattn.jax as fjax

    return fjax


def _keywords(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY]


@pytest.mark.parametrize("framework", [pytest.param("torch", marks=torch_frontend), "jax"])
def test_signatures_and_docstrings_follow_the_table(framework):
    attention = fat.attention if framework == "torch" else _jax().attention
    table = [o.name for o in options.OPTIONS if framework in o.frameworks]
    assert _keywords(attention) == table
    parameters = inspect.signature(attention).parameters
    assert all(parameters[o.name].default == o.default for o in options.OPTIONS if framework in o.frameworks)
    assert list(parameters)[:3] == ["q", "k", "v"]
    for name in table:
        assert f"\n        {name}: " in attention.__doc__, name
    assert "{options}" not in attention.__doc__


def test_backends_receive_the_tensor_options_in_the_tables_order():
    assert TENSOR_ARGUMENTS == ("q", "k", "v", *options.TENSORS)
    assert ARRAY_NAMES == (*TENSOR_ARGUMENTS, "dropout_seed", "dropout_offset")


def test_the_config_arguments_hold_every_setting_and_tensor_option():
    fields = {f.name for f in dataclasses.fields(CallArguments)}
    assert set(options.SETTINGS) <= fields
    assert set(options.TENSORS) <= fields


@torch_frontend
@pytest.mark.parametrize(("keyword", "hint"), [
    ("maks", "did you mean 'mask'?"),
    ("is_causal", "use mask='causal'"),
    ("attn_mask", "use bias="),
    ("dropout_rng", "for the JAX frontend only"),
    ("segment_ids_q", "for the JAX frontend only"),
    ("zzz", "Its keywords: layout, mask"),
])
def test_an_unknown_torch_keyword_names_itself_and_what_to_use(keyword, hint):
    with pytest.raises(TypeError, match="unexpected keyword argument") as error:
        fat.attention(Q, Q, Q, **{keyword: 1})
    assert repr(keyword) in str(error.value) and hint in str(error.value)
    assert str(error.value).startswith("fusedattn.torch.attention()")


def test_an_unknown_jax_keyword_names_itself():
    fjax = _jax()
    import jax.numpy as jnp

    x = jnp.ones((1, 8, 2, 4))
    with pytest.raises(TypeError, match="'dropout_sed'; did you mean 'dropout_seed'"):
        fjax.attention(x, x, x, dropout_sed=1)


@torch_frontend
def test_the_torch_module_passes_every_other_keyword_through():
    module = fat.DotProductAttention(mask="causal")
    call_keywords = _keywords(module.forward)
    assert set(call_keywords) == options.names("torch") - {
        "layout", "window", "softmax_type", "sink", "dropout_p", "scale", "deterministic", "backend"}
    assert inspect.signature(module.forward).parameters["mask"].default is None
    result = module(Q, Q, Q, return_lse=True)  # a keyword the module does not hold reaches attention
    assert result.lse.shape == (1, 2, 8)
    expected = fat.attention(Q, Q, Q, mask="causal")
    torch.testing.assert_close(module(Q, Q, Q), expected, rtol=0, atol=0)
    torch.testing.assert_close(module(Q, Q, Q, mask="none"), fat.attention(Q, Q, Q), rtol=0, atol=0)


@torch_frontend
@pytest.mark.parametrize(("keyword", "match"), [
    ("layout", "layout is the module's, set when it is constructed"),
    ("maks", "did you mean 'mask'"),
])
def test_the_torch_module_refuses_held_and_unknown_keywords(keyword, match):
    with pytest.raises(TypeError, match=match):
        fat.DotProductAttention()(Q, Q, Q, **{keyword: "bshd"})


def test_settings_fill_defaults_and_keep_given_values():
    chosen = options.settings({"mask": "causal", "bias": object(), "window": (3, 0)})
    assert list(chosen) == list(options.SETTINGS)
    assert chosen["mask"] == "causal" and chosen["window"] == (3, 0) and chosen["layout"] == "bshd"
    assert "bias" not in chosen


def test_the_readme_api_table_names_every_option():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme[readme.index("## API"):readme.index("Definitions, written once")]
    paired = lambda name: re.sub(r"_(q|kv)(_padded)?$", r"_q/kv\2", name)  # noqa: E731  cu_seqlens_q/kv
    missing = [o.name for o in options.OPTIONS
               if "torch" in o.frameworks and f"`{o.name}`" not in table and f"`{paired(o.name)}`" not in table]
    assert not missing, missing
