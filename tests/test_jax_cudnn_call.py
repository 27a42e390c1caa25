"""JAX's cuDNN passes (fusedattn.jax.cudnn_call) without a GPU: what each pass hands the graph and what
it makes of the graph's results, with the custom call replaced by a fake that records its operands
and returns known values. The custom call itself runs in tests/gpu/test_jax.py and
tests/gpu/test_jax_without_torch.py."""

from __future__ import annotations

import types

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from needs_torch import requires_torch  # noqa: E402

from fusedattn.backends.base import ARRAY_NAMES  # noqa: E402
from fusedattn.backends.cudnn.spec import sdpa_spec  # noqa: E402
from fusedattn.config import AttentionConfig  # noqa: E402
from fusedattn.jax import cudnn_call  # noqa: E402

B, S, H, D = 2, 8, 2, 16


class FakeLaunch:
    """cudnn_call._launch: records (direction, inputs) and returns `value` in every result."""

    def __init__(self, value=1.0):
        self.calls, self.value = [], value

    def __call__(self, cfg, direction, inputs, results, score_mod, steps_of=None):
        self.calls.append((direction, cfg, {n: (tuple(x.shape), str(x.dtype)) for n, x in inputs.items()}))
        self.steps_of = steps_of
        return {name: jnp.full(shape.shape, self.value, shape.dtype) for name, shape in results.items()}


@pytest.fixture
def fake(monkeypatch):
    """The fake launch, with padded and THD passes fixing their rows in jax.numpy (the path score_mods and
    max_logit keep; the custom call's own fix-ups run on the GPU: tests/gpu/test_jax.py)."""
    launch = FakeLaunch()
    monkeypatch.setattr(cudnn_call, "_launch", launch)
    monkeypatch.setattr(cudnn_call.sequence_steps, "unsupported", lambda cfg: "the fake launch runs no kernels")
    return launch


def _cfg(**changes) -> AttentionConfig:
    base = dict(dtype="bfloat16", layout="bshd", batch=B, seqlen_q=S, seqlen_kv=S, heads_q=H, heads_kv=H,
                head_dim_qk=D, head_dim_v=D, is_training=True, device="cuda", framework="jax")
    return AttentionConfig(**{**base, **changes})


def _arrays(cfg: AttentionConfig, **named) -> tuple:
    rng = np.random.default_rng(0)
    shapes = {"bshd": ((B, cfg.seqlen_q, H, D), (B, cfg.seqlen_kv, H, D)),
              "sbhd": ((cfg.seqlen_q, B, H, D), (cfg.seqlen_kv, B, H, D)),
              "bhsd": ((B, H, cfg.seqlen_q, D), (B, H, cfg.seqlen_kv, D))}
    q_shape, kv_shape = shapes.get(cfg.layout.value, ((cfg.seqlen_q, H, D), (cfg.seqlen_kv, H, D)))
    named = {"q": rng.standard_normal(q_shape), "k": rng.standard_normal(kv_shape),
             "v": rng.standard_normal(kv_shape), **named}
    return tuple(None if named.get(n) is None else jnp.asarray(named[n], jnp.int32 if n.startswith("cu_")
                                                                else jnp.bfloat16)
                 for n in ARRAY_NAMES)


@pytest.mark.parametrize("layout", ["bshd", "sbhd", "bhsd"])
def test_dense_passes_bind_q_k_v_and_return_the_layouts_shapes(fake, layout):
    cfg = _cfg(layout=layout, mask="causal")
    arrays = _arrays(cfg)
    out, lse, max_logit = cudnn_call.forward(cfg, None, arrays)
    assert out.shape == arrays[0].shape and out.dtype == jnp.bfloat16
    assert lse.shape == (B, H, S) and lse.dtype == jnp.float32 and max_logit.shape == (0,)
    (_, _, inputs), = fake.calls
    assert set(inputs) == {"q", "k", "v"} and inputs["q"] == (arrays[0].shape, "bfloat16")
    grads = cudnn_call.backward(cfg, None, arrays, out, lse, None)
    direction, _, inputs = fake.calls[-1]
    assert direction == "backward" and set(inputs) == {"q", "k", "v", "o", "dO", "stats"}
    assert inputs["stats"] == ((B, H, S, 1), "float32")
    assert {n: g.shape for n, g in grads.items()} == {n: arrays[ARRAY_NAMES.index(n)].shape for n in "qkv"}


def test_bias_sink_and_dropout_reach_the_graph_as_it_declares_them(fake):
    cfg = _cfg(bias="pre_scale", bias_shape=(1, H, 1, S), bias_requires_grad=True, softmax="learnable",
               dropout_p=0.1)
    arrays = list(_arrays(cfg, bias=np.ones((H, 1, S)), sink=np.zeros(H)))
    arrays[ARRAY_NAMES.index("dropout_seed")] = jnp.uint32(7)
    arrays[ARRAY_NAMES.index("dropout_offset")] = jnp.uint32(3)
    out, lse, _ = cudnn_call.forward(cfg, None, tuple(arrays))
    inputs = fake.calls[0][2]
    assert inputs["bias"] == ((1, H, 1, S), "bfloat16") and inputs["sink"] == ((1, H, 1, 1), "float32")
    assert inputs["dropout_seed"] == ((2,), "uint32")  # 8 bytes: cuDNN's int64
    grads = cudnn_call.backward(cfg, None, tuple(arrays), out, lse, jnp.ones_like(out))
    assert set(grads) == {"q", "k", "v", "bias", "sink"}
    # dBias: the graph's (1, H, Sq, Skv) summed over the broadcast query axis, times the scale (pre_scale),
    # in the bias's own shape
    assert grads["bias"].shape == (H, 1, S)
    np.testing.assert_allclose(np.asarray(grads["bias"], np.float32), S * cfg.scale, rtol=1e-2)
    assert grads["sink"].shape == (H,)


def test_seed_bits_are_the_uint32_then_zero():
    inputs = cudnn_call._graph_inputs(_cfg(dropout_p=0.5), {
        "q": jnp.zeros((B, S, H, D), jnp.bfloat16), "k": None, "v": None,
        "dropout_seed": jnp.uint32(0xDEADBEEF), "dropout_offset": jnp.uint32(5)}, {}, None, None)
    assert np.asarray(inputs["dropout_seed"]).view(np.int64)[0] == 0xDEADBEEF
    assert np.asarray(inputs["dropout_offset"]).view(np.int64)[0] == 5


def test_padded_rows_past_each_end_get_zero_output_and_minus_inf_lse(fake):
    cfg = _cfg(mask="padding")
    cu = np.array([0, 5, 5])  # the second sequence has no queries
    cu_kv = np.array([0, 0, 8])  # ... and the first has no keys
    arrays = _arrays(cfg, cu_seqlens_q=cu, cu_seqlens_kv=cu_kv)
    out, lse, _ = cudnn_call.forward(cfg, None, arrays)
    inputs = fake.calls[0][2]
    assert inputs["seq_len_q"] == ((B, 1, 1, 1), "int32") and "ro_q" not in inputs
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert (out == 0).all()  # sequence 0 has no keys, sequence 1 no queries
    assert np.isneginf(lse).all()
    grads = cudnn_call.backward(cfg, None, arrays, jnp.asarray(out, jnp.bfloat16), jnp.asarray(lse), None)
    assert all((np.asarray(grads[n], np.float32) == 0).all() for n in "qkv")


def test_thd_offsets_are_element_offsets_and_gaps_are_cleared(fake):
    cfg = _cfg(layout="thd", mask="padding_causal", seqlen_q=4, seqlen_kv=4, padded_offsets=True)
    cu = np.array([0, 3, 5])
    padded = np.array([0, 4, 8])  # one unused token after the first sequence, three after the second
    tokens = np.ones((8, H, D))
    arrays = _arrays(cfg, q=tokens, k=tokens, v=tokens, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                     cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    out, lse, _ = cudnn_call.forward(cfg, None, arrays)
    inputs = fake.calls[0][2]
    spec = sdpa_spec(cfg)
    assert inputs["ro_q"] == ((B + 1, 1, 1, 1), "int32") and inputs["ro_stats"] == ((B + 1, 1, 1, 1), "int32")
    table = cudnn_call._Sequences(cfg, dict(zip(ARRAY_NAMES, arrays)))
    np.testing.assert_array_equal(np.asarray(table.inputs["ro_q"]).ravel(), padded * spec.token_stride("q"))
    np.testing.assert_array_equal(np.asarray(table.inputs["ro_stats"]).ravel(), padded * H)
    inside = np.array([1, 1, 1, 0, 1, 1, 0, 0], bool)  # tokens of a sequence
    out = np.asarray(out, np.float32)
    assert (out[inside] == 1).all() and (out[~inside] == 0).all()
    np.testing.assert_array_equal(np.asarray(lse)[~inside], 0.0)  # THD gaps: LSE 0, as the torch path
    grads = cudnn_call.backward(cfg, None, arrays, jnp.asarray(out, jnp.bfloat16), lse, None)
    for name in "qkv":
        got = np.asarray(grads[name], np.float32)
        assert (got[inside] == 1).all() and (got[~inside] == 0).all(), name


def test_queries_of_a_sequence_without_keys_get_the_sink_logit(fake):
    cfg = _cfg(mask="padding", softmax="learnable")
    sink = np.array([0.5, -1.0])
    arrays = _arrays(cfg, cu_seqlens_q=np.array([0, 8, 16]), cu_seqlens_kv=np.array([0, 0, 8]), sink=sink)
    out, lse, _ = cudnn_call.forward(cfg, None, arrays)
    lse = np.asarray(lse)
    np.testing.assert_allclose(lse[0], np.broadcast_to(np.asarray(jnp.asarray(sink, jnp.bfloat16),
                                                                  np.float32)[:, None], (H, S)))
    np.testing.assert_array_equal(lse[1], 1.0)  # the fake's stats, untouched inside a sequence with keys


def test_max_logit_is_the_largest_row_maximum_and_the_lse_their_sum(fake):
    cfg = _cfg(return_max_logit=True)
    out, lse, max_logit = cudnn_call.forward(cfg, None, _arrays(cfg))
    assert set(fake.calls[0][2]) == {"q", "k", "v"}
    np.testing.assert_allclose(np.asarray(lse), 1.0)  # row max 1 + log(sum 1)
    np.testing.assert_allclose(np.asarray(max_logit), np.ones(H))


def test_bottom_right_rows_without_keys_run_the_rows_that_have_keys(fake):
    cfg = _cfg(mask="causal_bottom_right", seqlen_q=12, seqlen_kv=8)
    arrays = _arrays(cfg)
    out, lse, _ = cudnn_call.forward(cfg, None, arrays)
    ran = fake.calls[0][1]
    assert ran.seqlen_q == 8 and fake.calls[0][2]["q"][0] == (B, 8, H, D)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert out.shape == (B, 12, H, D) and (out[:, :4] == 0).all() and (out[:, 4:] == 1).all()
    assert np.isneginf(lse[:, :, :4]).all() and (lse[:, :, 4:] == 1).all()
    grads = cudnn_call.backward(cfg, None, arrays, jnp.asarray(out, jnp.bfloat16), jnp.asarray(lse), None)
    assert grads["q"].shape == (B, 12, H, D) and (np.asarray(grads["q"][:, :4], np.float32) == 0).all()


@pytest.mark.parametrize("softmax", ["learnable", "off_by_one"])
def test_bottom_right_rows_without_keys_take_the_sinks_lse(fake, softmax):
    """The rows that see no key: output 0 and the LSE of the sink term alone (they were padded with -inf)."""
    cfg = _cfg(mask="causal_bottom_right", seqlen_q=12, seqlen_kv=8, softmax=softmax)
    sink = np.array([0.5, -1.0, 2.0, 0.25][:H]) if softmax == "learnable" else None
    arrays = _arrays(cfg, sink=sink)
    _, lse, _ = cudnn_call.forward(cfg, None, arrays)
    expected = np.asarray(jnp.asarray(sink, jnp.bfloat16), np.float32) if sink is not None else np.zeros(H)
    np.testing.assert_array_equal(np.asarray(lse)[:, :, :4], np.broadcast_to(expected[None, :, None], (B, H, 4)))


def test_vmap_folds_into_the_batch_unless_a_shared_operand_is_vmapped(fake):
    """A vmapped q with a shared (1, H, S, S) bias runs one pass of batch N * B; a vmapped bias has no
    batch axis to fold into, so each item runs alone (its own pass, batch B)."""
    cfg = _cfg(bias="post_scale", bias_shape=(1, H, S, S))
    rng = np.random.default_rng(1)
    bias = jnp.asarray(rng.standard_normal((1, H, S, S)), jnp.bfloat16)
    arrays = list(_arrays(cfg, bias=np.asarray(bias, np.float32)))
    stacked_q = jnp.stack([arrays[0]] * 3)

    def forward(q, bias):
        return cudnn_call.forward(cfg, None, (q, *arrays[1:3], bias, *arrays[4:]))[0]

    out = jax.vmap(forward, in_axes=(0, None))(stacked_q, bias)
    assert out.shape == (3, B, S, H, D)
    assert {call[1].batch for call in fake.calls if call[0] == "forward"} >= {3 * B}
    fake.calls.clear()
    out = jax.vmap(forward)(stacked_q, jnp.stack([bias] * 3))
    assert out.shape == (3, B, S, H, D)
    assert {call[1].batch for call in fake.calls} == {B}, "a vmapped bias runs item by item"


@pytest.mark.parametrize("shared", [False, True], ids=["per-item", "shared"])
def test_vmap_gives_nan_to_the_items_whose_offsets_break_the_rules_and_runs_the_others_on_theirs(fake, shared):
    """Folding concatenates the items' lengths, which hides offsets that do not start at 0: a pass that checks
    its own offsets (cudnn_call.checks_offsets) would run the folded batch as valid. The rule checks each item
    first: a broken item runs on all-zero offsets and its results are NaN; the others run on their own."""
    cfg = _cfg(mask="padding")
    good, broken = np.array([0, 5, 8]), np.array([1, 5, 8])
    arrays = list(_arrays(cfg, cu_seqlens_q=good, cu_seqlens_kv=good))
    stacked_q = jnp.stack([arrays[0]] * 3)
    cus = jnp.asarray(np.stack([good, broken, good]), jnp.int32)

    def forward(q, cu):
        named = dict(zip(ARRAY_NAMES, arrays), q=q, cu_seqlens_q=cu, cu_seqlens_kv=cu)
        return cudnn_call.forward(cfg, None, tuple(named[name] for name in ARRAY_NAMES))

    out, lse, _ = jax.vmap(forward, in_axes=(0, None if shared else 0))(stacked_q, cus[1] if shared else cus)
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    broken_items = [0, 1, 2] if shared else [1]
    assert np.isnan(out[broken_items]).all() and np.isnan(lse[broken_items]).all()
    if not shared:
        assert not np.isnan(out[[0, 2]]).any()
    assert {call[1].batch for call in fake.calls if call[0] == "forward"} >= {3 * B}, "the items run as one folded pass"


# ------------------------------------------------- the custom call's own table and fix-ups (sequence_steps)

class KernelLaunch(FakeLaunch):
    """cudnn_call._launch as jax_call.cc runs a pass with its own kernels: the planned launches before the
    graph (Triton's interpreter over torch tensors), the graph (a fake writing `graph_results`), the
    launches after it; every word decoded as the handler decodes it."""

    def __init__(self, graph_results):
        super().__init__()
        self.graph_results = graph_results

    def __call__(self, cfg, direction, inputs, results, score_mod, steps_of=None):
        import torch

        assert steps_of is not None, "a padded or THD pass without its own kernels"
        steps = steps_of(0)
        assert not set(steps.table_slots) & set(inputs), "the graph reads its sequence rows from the table"
        names = tuple(inputs)

        def host(*values):  # the handler, on the host: jax_call.cc's order of work
            buffers = {name: torch.from_numpy(np.array(x)) for name, x in zip(names, values)}
            buffers.update({name: torch.from_numpy(self.graph_results(name, shape)) for name, shape in results.items()})
            for phase in (cudnn_call.sequence_steps.BEFORE, cudnn_call.sequence_steps.AFTER):
                for launch in steps.launches:
                    if launch.phase == phase:
                        _run(steps.kernels[launch.kernel], launch, buffers)
            return tuple(buffers[name].numpy() for name in results)

        # the table is one more result of the call, as cudnn_call._launch declares it
        results = dict(results, **{cudnn_call.sequence_steps.TABLE: jax.ShapeDtypeStruct(steps.table_shape, jnp.int32)})
        outs = jax.pure_callback(host, tuple(results.values()), *inputs.values())
        return dict(zip(results, outs))


def _run(kernel, launch, buffers) -> None:
    """One planned launch in Triton's interpreter, its words decoded as jax_call.cc decodes them."""
    import struct

    _, function, constants, _ = kernel
    names = cudnn_call.sequence_steps.arguments(function)
    assert len(names) == len(launch.words)
    args = []
    for name, word in zip(names, launch.words):
        if isinstance(word, tuple):
            assert word[1] == 0 and word[0] in buffers, word
            args.append(buffers[word[0]])
        else:
            args.append(struct.unpack("<f", struct.pack("<I", word))[0] if name == "gap_lse" else word)
    function[(launch.blocks,)](*args, **constants)


def _graph_results(name, shape):
    """What the fake graph writes: fixed values per result, finite, differing by row (the sequence table:
    -7, for the table kernel to overwrite)."""
    if name == cudnn_call.sequence_steps.TABLE:
        return np.full(shape.shape, -7, np.int32)
    rng = np.random.default_rng(abs(hash((name, shape.shape))) % 2**32)
    return rng.standard_normal(shape.shape).astype(shape.dtype)


@requires_torch("Triton's interpreter runs the sequence kernels over torch tensors")
@pytest.mark.parametrize("case", ["padding", "padding_sink", "thd_gaps", "thd_causal_gqa", "bhsd", "sbhd"])
def test_the_calls_own_fix_ups_give_what_the_jax_numpy_fixes_give(monkeypatch, triton_interpreter, case):
    pytest.importorskip("triton")
    _interpreted_kernels(monkeypatch)
    cu = np.array([0, 5, 5])  # the second sequence has no queries
    cu_kv = np.array([0, 0, 8])  # ... and the first has no keys
    extra = {}
    if case.startswith("thd"):
        cfg = _cfg(layout="thd", mask="padding_causal" if case == "thd_causal_gqa" else "padding", seqlen_q=4,
                   seqlen_kv=4, padded_offsets=True, dtype="float16")
        cu, cu_kv, padded = np.array([0, 3, 5]), np.array([0, 2, 5]), np.array([0, 4, 8])
        tokens = np.ones((8, H, D))
        extra = dict(q=tokens, k=tokens, v=tokens, cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded)
    else:
        cfg = _cfg(mask="padding", dtype="float16", layout=case if case in ("bhsd", "sbhd") else "bshd",
                   softmax="learnable" if case == "padding_sink" else "vanilla")
        if case == "padding_sink":
            extra = dict(sink=np.array([0.5, -1.0]))
    arrays = [None if x is None else (x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x)
              for x in _arrays(cfg, cu_seqlens_q=cu, cu_seqlens_kv=cu_kv, **extra)]
    _assert_own_fix_ups_match_the_jax_numpy_ones(monkeypatch, cfg, arrays)


def _generated_case(seed: int) -> tuple:
    """(cfg, arrays) of a random padded or THD call: 1-3 sequences of 0 to S tokens on each side (THD: gaps
    between them and after the last), grouped heads, any sink, head dims 8-24, one to eight positions."""
    rng = np.random.default_rng(seed)
    layout = str(rng.choice(["bshd", "sbhd", "bhsd", "thd"]))
    b, hkv = int(rng.integers(1, 4)), int(rng.choice([1, 2]))
    hq, d = hkv * int(rng.choice([1, 2])), int(rng.choice([8, 16, 24]))
    sq, skv = int(rng.choice([1, 3, 8])), int(rng.choice([1, 5, 8]))
    lengths = {"q": rng.integers(0, sq + 1, b), "kv": rng.integers(0, skv + 1, b)}
    cfg = _cfg(layout=layout, mask=str(rng.choice(["padding", "padding_causal"])), batch=b, seqlen_q=sq, seqlen_kv=skv,
               heads_q=hq, heads_kv=hkv, head_dim_qk=d, head_dim_v=d, dtype="float16",
               softmax=str(rng.choice(["vanilla", "off_by_one", "learnable"])), padded_offsets=layout == "thd")
    named = {f"cu_seqlens_{side}": np.concatenate([[0], np.cumsum(n)]) for side, n in lengths.items()}
    if layout == "thd":
        shapes = {}
        for side, n in lengths.items():
            padded = np.concatenate([[0], np.cumsum(n + rng.integers(0, 3, b))])
            named[f"cu_seqlens_{side}_padded"] = padded
            shapes[side] = int(padded[-1]) + int(rng.integers(0, 3))
        q_shape, kv_shape = (shapes["q"], hq, d), (shapes["kv"], hkv, d)
    else:
        dims = {"bshd": lambda s, h: (b, s, h, d), "sbhd": lambda s, h: (s, b, h, d), "bhsd": lambda s, h: (b, h, s, d)}
        q_shape, kv_shape = dims[layout](sq, hq), dims[layout](skv, hkv)
    named.update(q=rng.standard_normal(q_shape), k=rng.standard_normal(kv_shape), v=rng.standard_normal(kv_shape))
    if cfg.softmax.value == "learnable":
        named["sink"] = rng.standard_normal(hq)
    arrays = tuple(None if named.get(n) is None else jnp.asarray(named[n], jnp.int32 if n.startswith("cu_")
                                                                   else jnp.float16 if n != "sink" else jnp.float32)
                   for n in ARRAY_NAMES)
    return cfg, arrays


@requires_torch("Triton's interpreter runs the sequence kernels over torch tensors")
@pytest.mark.parametrize("seed", range(12))
def test_generated_padded_and_thd_calls_fix_their_rows_as_the_jax_numpy_path_does(monkeypatch, triton_interpreter,
                                                                                  seed):
    """Random layouts, lengths (empty and one-token sequences included), THD gaps, grouped heads and sinks: the
    custom call's own kernels give the jax.numpy path's out, LSE and gradients bit for bit."""
    pytest.importorskip("triton")
    _interpreted_kernels(monkeypatch)
    cfg, arrays = _generated_case(seed)
    _assert_own_fix_ups_match_the_jax_numpy_ones(monkeypatch, cfg, arrays)


def _assert_own_fix_ups_match_the_jax_numpy_ones(monkeypatch, cfg, arrays) -> None:
    own = KernelLaunch(_graph_results)
    monkeypatch.setattr(cudnn_call, "_launch", own)
    assert cudnn_call._own_fixes(cfg)
    out, lse, _ = cudnn_call.forward(cfg, None, arrays)
    grads = cudnn_call.backward(cfg, None, arrays, out, lse, None)

    fixed_in_jax = FakeLaunch()
    fixed_in_jax.__class__ = type("GraphValues", (FakeLaunch,), {"__call__": lambda self, cfg, direction, inputs,
                                  results, score_mod, steps_of=None: {n: jnp.asarray(_graph_results(n, s))
                                                                      for n, s in results.items()}})
    monkeypatch.setattr(cudnn_call, "_launch", fixed_in_jax)
    monkeypatch.setattr(cudnn_call.sequence_steps, "unsupported", lambda cfg: "compared")
    want_out, want_lse, _ = cudnn_call.forward(cfg, None, arrays)
    want_grads = cudnn_call.backward(cfg, None, arrays, want_out, want_lse, None)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want_out, np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(want_lse))
    assert set(grads) == set(want_grads)
    for name in grads:
        np.testing.assert_array_equal(np.asarray(grads[name], np.float32), np.asarray(want_grads[name], np.float32),
                                      err_msg=name)


def _interpreted_kernels(monkeypatch) -> None:
    """sequence_steps' kernels as Triton's interpreter runs them (_run), not compiled for a GPU."""
    from fusedattn.backends.cudnn.native import sequence_plans

    monkeypatch.setattr(sequence_plans, "_compile",
                        lambda function, cfg, target, constants, divisible=None: (b"", function, constants, 0))
    monkeypatch.setattr(cudnn_call.sequence_steps, "_target", lambda device: types.SimpleNamespace(arch="interpreted"))


@requires_torch("Triton's interpreter runs the sequence kernels over torch tensors")
@pytest.mark.parametrize("cu", [[1, 5, 8], [0, 9, 9], [0, 6, 2]], ids=["not-from-zero", "too-long", "negative"])
def test_a_call_that_checks_its_own_offsets_gives_nan_everywhere_for_broken_ones(monkeypatch, triton_interpreter, cu):
    """The frontend multiplies nothing by its NaN-or-one factor around a pass that checks its offsets itself
    (cudnn_call.checks_offsets): the table kernel flags them and every output and gradient is NaN."""
    pytest.importorskip("triton")
    _interpreted_kernels(monkeypatch)
    cfg = _cfg(mask="padding", dtype="float16", softmax="learnable", bias="post_scale", bias_shape=(1, H, S, S),
               bias_requires_grad=True)
    assert cudnn_call.checks_offsets(cfg)
    arrays = [None if x is None else (x.astype(jnp.float16) if jnp.issubdtype(x.dtype, jnp.floating) else x)
              for x in _arrays(cfg, cu_seqlens_q=np.array(cu), cu_seqlens_kv=np.array(cu), sink=np.array([0.5, -1.0]),
                              bias=np.random.default_rng(1).standard_normal((1, H, S, S)))]
    monkeypatch.setattr(cudnn_call, "_launch", KernelLaunch(_graph_results))
    out, lse, _ = cudnn_call.forward(cfg, None, arrays)
    grads = cudnn_call.backward(cfg, None, arrays, out, lse, None)
    assert np.isnan(np.asarray(out, np.float32)).all() and np.isnan(np.asarray(lse)).all()
    assert set(grads) >= {"q", "k", "v", "bias", "sink"}
    for name, grad in grads.items():
        assert np.isnan(np.asarray(grad, np.float32)).all(), name
