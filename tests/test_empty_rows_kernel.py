"""The empty-rows kernel (backends/cudnn/empty_rows_kernel.py) under TRITON_INTERPRET=1, against the
rule written with torch ops: rows whose LSE is below MASKED_BELOW or NaN get output 0 and LSE -inf
(training: a new LSE, and the raw LSE turned into the backward's stats, +inf there); every other row
and every other element stays as it was. Outputs in the layouts' strides, odd sizes, one row, none."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from fusedattn.backends.cudnn import empty_rows_kernel  # noqa: E402
from fusedattn.score_mods.core import MASKED_BELOW  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter")


def _expected(out_rows, raw, training):
    empty = ~(raw >= MASKED_BELOW)
    out = out_rows.masked_fill(empty.unsqueeze(-1), 0)
    lse = raw.masked_fill(empty, float("-inf"))
    return out, lse, (raw.masked_fill(empty, float("inf")) if training else None)


# (B, H, S, D, the output's layout)
SHAPES = [(2, 3, 5, 8, "bshd"), (1, 4, 67, 24, "bhsd"), (3, 2, 9, 7, "sbhd"), (1, 1, 1, 1, "bshd"),
          (2, 5, 130, 64, "bshd"), (0, 2, 3, 8, "bshd")]


@pytest.mark.parametrize("pattern", ["scattered", "last_only", "none"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[0]}x{s[1]}x{s[2]}x{s[3]}-{s[4]}" for s in SHAPES])
def test_empty_rows_get_zero_output_and_infinite_lse(shape, training, pattern):
    """scattered: rows emptied, NaN and low-but-kept at random; last_only: one empty row, so every other
    block of rows skips the output; none: nothing changes but the LSE's copy."""
    batch, heads, seqlen, dim, layout = shape
    gen = torch.Generator().manual_seed(batch * 100 + seqlen)
    sizes = {"bshd": (batch, seqlen, heads, dim), "bhsd": (batch, heads, seqlen, dim),
             "sbhd": (seqlen, batch, heads, dim)}[layout]
    to_bhsd = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "sbhd": (1, 2, 0, 3)}[layout]
    out = torch.randn(sizes, generator=gen).to(torch.bfloat16)
    out_rows = out.permute(to_bhsd)
    raw = torch.randn(batch, heads, seqlen, generator=gen) * 3
    if pattern == "scattered":
        pick = torch.rand(raw.shape, generator=gen)
        raw[pick < 0.3] = MASKED_BELOW * 2.5  # emptied by a mask's score
        raw[(pick >= 0.3) & (pick < 0.35)] = float("nan")
        raw[(pick >= 0.35) & (pick < 0.4)] = MASKED_BELOW * 0.5  # low, but above the threshold: kept
    elif pattern == "last_only" and raw.numel():
        raw.view(-1)[-1] = MASKED_BELOW * 3
    want_out, want_lse, want_stats = _expected(out_rows.clone(), raw.clone(), training)
    lse, stats = empty_rows_kernel.run(out_rows, raw, training)
    torch.testing.assert_close(out_rows, want_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0, equal_nan=False)
    if training:
        torch.testing.assert_close(stats, want_stats, rtol=0, atol=0)
