"""The reference backend on a CUDA device agrees with itself on the CPU (float32)."""

import pytest

torch = pytest.importorskip("torch")

import fusedattn  # noqa: E402
import fusedattn.torch as fat  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right"])
def test_reference_cuda_matches_cpu(mask):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 33, 4, 64, generator=gen) for _ in range(3))
    k, v = k[:, :17], v[:, :17]
    expected = fat.attention(q, k, v, mask=mask)
    with pytest.warns(RuntimeWarning, match="unfused reference"):
        fusedattn.selection.clear_decisions()
        got = fat.attention(q.cuda(), k.cuda(), v.cuda(), mask=mask)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)
