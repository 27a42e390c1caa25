"""The cuDNN backend's sequence kernels (backends/cudnn/sequence_kernels.py) under TRITON_INTERPRET=1,
against NumPy: the table (lengths, ragged offsets, the offsets' check by layout.offsets_violated's rules)
and the row fix-ups of padded and THD outputs and gradients, on generated offsets with gaps, empty
sequences on either side, every sink kind and broken offsets of every kind."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusedattn.backends.cudnn.sequences import Layout, SequenceTable  # noqa: E402
from fusedattn.config import SoftmaxType  # noqa: E402
from fusedattn.layout import offsets_violated  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def offsets(rng, batch: int, longest: int, empty: float = 0.3, gaps: bool = False):
    """(cu_seqlens, padded starts or None) with some empty sequences and, with gaps, room after each."""
    lengths = rng.integers(1, longest + 1, batch) * (rng.random(batch) >= empty)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    if not gaps:
        return cu, None
    room = lengths + rng.integers(0, 3, batch)
    return cu, np.concatenate([[0], np.cumsum(room)]).astype(np.int32)


def table_of(cu_q, cu_kv, pad_q, pad_kv, limits, totals, units=(), queries=0):
    batch = len(cu_q) - 1
    layout = Layout(batch, -(-(batch + 1) // 4) * 4, tuple(units), queries, totals is not None, limits)
    tensor = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.int32))  # noqa: E731
    return SequenceTable.build(layout, tensor(cu_q), tensor(cu_kv), tensor(pad_q), tensor(pad_kv), totals)


@pytest.mark.parametrize("batch", [1, 3, 200])
@pytest.mark.parametrize("gaps", [False, True])
def test_table_holds_lengths_starts_and_ragged_offsets(batch, gaps):
    rng = np.random.default_rng(batch + 10 * gaps)
    cu_q, pad_q = offsets(rng, batch, 9, gaps=gaps)
    cu_kv, pad_kv = offsets(rng, batch, 7, gaps=gaps)
    starts_q = cu_q if pad_q is None else pad_q
    starts_kv = cu_kv if pad_kv is None else pad_kv
    units = (("q", 24), ("o", 16), ("stats", 3), ("k", 8), ("v", 40))
    table = table_of(cu_q, cu_kv, pad_q, pad_kv, (9, 7), (int(starts_q[-1]) + 2, int(starts_kv[-1])), units, 3)
    rows = table.table.numpy()
    np.testing.assert_array_equal(rows[0, :batch], np.diff(cu_q))
    np.testing.assert_array_equal(rows[1, :batch], np.diff(cu_kv))
    np.testing.assert_array_equal(rows[2, :batch + 1], starts_q)
    np.testing.assert_array_equal(rows[3, :batch + 1], starts_kv)
    for row, (name, unit) in enumerate(units, start=4):
        starts = starts_q if name in ("q", "o", "stats") else starts_kv
        np.testing.assert_array_equal(rows[row, :batch + 1], starts.astype(np.int64) * unit, err_msg=name)
    assert rows[table.layout.flag_row, 0] == 0 and not bool(table.broken())
    assert table.addresses["ro_k"] - table.addresses["seq_len_q"] == 7 * table.layout.width * 4


def breakages(cu, pad, limit, total):
    """(description, cu, pad, total) for each rule layout.offsets_violated enforces."""
    cu, cases = cu.copy(), []
    first = cu.copy()
    first[0] = 1
    cases.append(("first offset not 0", first, pad, total))
    falling = cu.copy()
    falling[1] = falling[2] + 1
    cases.append(("a negative length", falling, pad, total))
    longer = cu.copy()
    longer[1:] += limit + 1
    cases.append(("a length over the longest", longer, None if pad is None else pad + limit + 1, total))
    cases.append(("past the packed tensor", cu, pad, int((cu if pad is None else pad)[-1]) - 1))
    if pad is not None:
        tight = cu.copy()  # the first sequence one token short of room
        tight[1] -= 1
        cases.append(("less room than length", cu, tight, total))
        below = pad.copy()
        below[0] = -1
        cases.append(("a negative padded start", cu, below, total))
    return cases


@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("side", ["q", "kv"])
def test_table_flags_broken_offsets_as_layout_does_and_zeroes_them(gaps, side):
    rng = np.random.default_rng(7)
    good = {s: offsets(rng, 4, 6, empty=0.0, gaps=gaps) for s in ("q", "kv")}
    totals = {s: int((c if p is None else p)[-1]) for s, (c, p) in good.items()}
    for reason, cu, pad, total in breakages(*good[side], 6, totals[side]):
        sides = dict(good, **{side: (cu, pad)})
        bounds = dict(totals, **{side: total})
        padded = None if pad is None else torch.from_numpy(pad)
        assert bool(offsets_violated(torch.from_numpy(cu), 6, total, padded)), reason  # the rule it names
        table = table_of(sides["q"][0], sides["kv"][0], sides["q"][1], sides["kv"][1], (6, 6),
                         (bounds["q"], bounds["kv"]), (("q", 4), ("k", 4)), 1)
        rows = table.table.numpy()
        assert bool(table.broken()), reason
        assert not rows[:4, :4].any() and not rows[4:6, :5].any(), reason  # nothing for cuDNN to read


def test_padded_table_does_not_bound_the_last_offset():
    cu = np.array([0, 3, 5], dtype=np.int32)
    table = table_of(cu, cu, None, None, (3, 3), None)
    assert not bool(table.broken())
    np.testing.assert_array_equal(table.table.numpy()[0, :2], [3, 2])


# ----------------------------------------------------------------------------------------- row fix-ups

def sink_term(softmax, sink, heads):
    if softmax is SoftmaxType.LEARNABLE:
        return sink.numpy().astype(np.float32)
    return np.full(heads, 0.0 if softmax is SoftmaxType.OFF_BY_ONE else -np.inf, np.float32)


def expected_rows(inside, alone, broken, x):
    """x with rows outside or alone set to 0, or everything NaN when broken."""
    want = x.copy()
    want[~inside | alone] = 0
    return np.full_like(want, np.nan) if broken else want


@pytest.mark.parametrize("softmax", list(SoftmaxType))
@pytest.mark.parametrize("broken", [False, True])
def test_thd_forward_rows(softmax, broken):
    rng = np.random.default_rng(3)
    batch, heads, dim = 5, 3, 20
    cu_q, pad_q = offsets(rng, batch, 6, gaps=True)
    cu_kv, _ = offsets(rng, batch, 6, empty=0.5)
    tokens = int(pad_q[-1]) + 3  # and tokens after the last sequence
    table = table_of(cu_q, cu_kv, pad_q, None, (6 if not broken else 0, 6), (tokens, int(cu_kv[-1])),
                     (("q", heads * dim),), 1)
    assert bool(table.broken()) == broken
    out = torch.randn(tokens, heads, dim, dtype=torch.bfloat16)
    lse = torch.randn(tokens, heads)
    lse[::4, 0] = -float("inf")  # rows a score_mod emptied: +inf in the backward's stats
    sink = torch.randn(heads)
    before_out, before_lse = out.float().numpy(), lse.numpy().copy()
    backward_stats = torch.full_like(lse, 7.0)
    table.fix_rows("q", out, lse=lse, stats=lse, seqlen=6, sink=sink, softmax=softmax, backward_stats=backward_stats)
    token = np.arange(tokens)
    seq = np.clip(np.searchsorted(pad_q, token, side="right") - 1, 0, batch - 1)
    inside = (token - pad_q[seq] < np.diff(cu_q)[seq]) & (token < pad_q[-1])
    alone = inside & (np.diff(cu_kv)[seq] == 0)
    np.testing.assert_array_equal(out.float().numpy(), expected_rows(inside, alone, broken, before_out))
    want = np.where(alone[:, None], sink_term(softmax, sink, heads)[None, :], before_lse)
    want = np.where(inside[:, None], want, 0.0)
    np.testing.assert_array_equal(lse.numpy(), np.full_like(want, np.nan) if broken else want)
    np.testing.assert_array_equal(backward_stats.numpy(), np.where(lse.numpy() == -np.inf, np.inf, lse.numpy()))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("broken", [False, True])
def test_padded_forward_rows_and_stats(layout, broken):
    rng = np.random.default_rng(4)
    batch, seqlen, heads, dim = 4, 7, 2, 8
    cu_q, _ = offsets(rng, batch, seqlen)
    cu_kv, _ = offsets(rng, batch, seqlen, empty=0.5)
    table = table_of(cu_q, cu_kv, None, None, (seqlen if not broken else 0, seqlen), None)
    bhsd = torch.randn(batch, heads, seqlen, dim)
    if layout == "bshd":
        bhsd = torch.randn(batch, seqlen, heads, dim).permute(0, 2, 1, 3)
    stats = torch.randn(batch, heads, seqlen, 1)
    lse = torch.full((batch, heads, seqlen), 123.0)
    before_out, before_stats = bhsd.permute(0, 2, 1, 3).numpy().copy(), stats[..., 0].permute(0, 2, 1).numpy().copy()
    table.fix_rows("q", bhsd.permute(0, 2, 1, 3), lse=lse.permute(0, 2, 1), stats=stats[..., 0].permute(0, 2, 1),
                   seqlen=seqlen, softmax=SoftmaxType.OFF_BY_ONE)
    position = np.arange(seqlen)[None, :]
    inside = position < np.diff(cu_q)[:, None]
    alone = inside & (np.diff(cu_kv)[:, None] == 0)
    np.testing.assert_array_equal(bhsd.permute(0, 2, 1, 3).numpy(), expected_rows(inside, alone, broken, before_out))
    want = np.where(alone[..., None], 0.0, before_stats)
    want = np.where(inside[..., None], want, -np.inf)
    np.testing.assert_array_equal(lse.permute(0, 2, 1).numpy(), np.full_like(want, np.nan) if broken else want)
    kept = inside & (not broken)  # broken offsets: the table holds no sequence
    np.testing.assert_array_equal(stats[..., 0].permute(0, 2, 1).numpy(), np.where(kept[..., None], before_stats, 0))


@pytest.mark.parametrize("ragged", [False, True])
def test_gradient_rows_of_both_sides(ragged):
    rng = np.random.default_rng(5)
    batch, seqlen, heads_q, heads_kv, dim_qk, dim_v = 6, 5, 4, 2, 8, 16
    cu_q, pad_q = offsets(rng, batch, seqlen, empty=0.3, gaps=ragged)
    cu_kv, pad_kv = offsets(rng, batch, seqlen, empty=0.3, gaps=ragged)
    if ragged:
        totals = (int(pad_q[-1]) + 1, int(pad_kv[-1]) + 2)
        table = table_of(cu_q, cu_kv, pad_q, pad_kv, (seqlen, seqlen), totals, (("dq", 1), ("dk", 1)), 1)
        dq = torch.randn(totals[0], heads_q, dim_qk)
        dk, dv = torch.randn(totals[1], heads_kv, dim_qk), torch.randn(totals[1], heads_kv, dim_v)
    else:
        table = table_of(cu_q, cu_kv, None, None, (seqlen, seqlen), None)
        dq = torch.randn(batch, seqlen, heads_q, dim_qk)
        dk, dv = torch.randn(batch, seqlen, heads_kv, dim_qk), torch.randn(batch, seqlen, heads_kv, dim_v)
    before = [x.numpy().copy() for x in (dq, dk, dv)]
    table.fix_rows("q", dq, seqlen=seqlen)
    table.fix_rows("kv", dk, dv, seqlen=seqlen)
    len_q, len_kv = np.diff(cu_q), np.diff(cu_kv)
    for x, old, starts, own, other in ((dq, before[0], pad_q, len_q, len_kv), (dk, before[1], pad_kv, len_kv, len_q),
                                       (dv, before[2], pad_kv, len_kv, len_q)):
        if ragged:
            token = np.arange(x.shape[0])
            seq = np.clip(np.searchsorted(starts, token, side="right") - 1, 0, batch - 1)
            inside = (token - starts[seq] < own[seq]) & (token < starts[-1])
            alone = inside & (other[seq] == 0)
        else:
            inside = np.arange(seqlen)[None, :] < own[:, None]
            alone = inside & (other[:, None] == 0)
        np.testing.assert_array_equal(x.numpy(), expected_rows(inside, alone, False, old))


def test_offsets_past_int32_are_refused_with_the_numbers():
    layout = Layout(1, 4, (("q", 16 * 128), ("k", 8 * 128)), 1, True, (2**20, 2**20))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"'q' reach 1048576 tokens x 2048 elements .*int32"):
        SequenceTable.build(layout, cu, cu, None, None, (2**20, 10))
    SequenceTable.build(layout, cu, cu, None, None, (2**19, 2**20))  # 2^30 and 2^30: fits


@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("gaps", [False, True])
def test_score_mod_penalties(batch, gaps):
    """A score_mod graph's padding penalties (programs 1..B): 0 inside each sequence, MASKED past its end,
    in rows of their own after the flag; the table's own rows unchanged; all MASKED when broken."""
    from fusedattn.backends.cudnn.sequences import table_programs
    from fusedattn.score_mods.core import MASKED

    rng = np.random.default_rng(batch + 7 * gaps)
    seq_q, seq_kv = 9, 70  # penalties over more than one of a program's steps on the key side
    cu_q, pad_q = offsets(rng, batch, seq_q, gaps=gaps)
    cu_kv, pad_kv = offsets(rng, batch, seq_kv, gaps=gaps)
    layout = Layout(batch, -(-(batch + 1) // 4) * 4, (), 0, False, (seq_q, seq_kv), (seq_q, seq_kv))
    assert table_programs(layout) == batch + 1
    tensor = lambda a: None if a is None else torch.from_numpy(np.asarray(a, dtype=np.int32))  # noqa: E731
    for broken in (False, True):
        cu = cu_q.copy()
        if broken:
            cu[0] = 1
        table = SequenceTable.build(layout, tensor(cu), tensor(cu_kv), tensor(pad_q), tensor(pad_kv), None)
        flat = table.table.reshape(-1)
        row_q, row_kv = layout.penalty_rows
        width = layout.width
        assert row_q == layout.flag_row + 1 and table.table.shape[0] == layout.rows
        penalty_q = flat[row_q * width:row_q * width + batch * seq_q].view(torch.float32).reshape(batch, seq_q)
        penalty_kv = flat[row_kv * width:row_kv * width + batch * seq_kv].view(torch.float32).reshape(batch, seq_kv)
        for penalty, lengths, seq in ((penalty_q, np.diff(cu_q), seq_q), (penalty_kv, np.diff(cu_kv), seq_kv)):
            inside = np.arange(seq)[None, :] < (lengths * (not broken))[:, None]
            np.testing.assert_array_equal(penalty.numpy(), np.where(inside, 0.0, MASKED).astype(np.float32))
        assert table.addresses["sm_col_penalty"] - table.addresses["sm_row_penalty"] == (row_kv - row_q) * width * 4
        assert bool(table.broken()) == broken
        if not broken:
            np.testing.assert_array_equal(table.table[0, :batch].numpy(), np.diff(cu_q))
