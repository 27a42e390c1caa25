"""Added score_mod terms whose tensors learn (run as a post-scale bias summed from the tensors at each
call): out and every gradient against a float64 attention written here, for tables read by the
positions themselves (a strided view of the table, no gather), read in another order or by arithmetic
(a gather), larger than the call (their leading part), over several steps of a loop that updates them
in place."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import fusedattn.torch as fat  # noqa: E402

B, S, H, D = 2, 7, 3, 8


def _exact(q, k, v, term, scale):
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale + term
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


TABLES = {  # name: (table shape, the term as a callback of the table, the same term as a (B, H, S, S) array)
    "slopes[h] * (kv - q)": ((H,), lambda t: lambda s, b, h, qi, ki: s + t[h] * (ki - qi),
                             lambda t, i: t.view(1, H, 1, 1) * (i[None, :] - i[:, None])),
    "slopes[h] of a longer table": ((H + 4,), lambda t: lambda s, b, h, qi, ki: s - t[h],
                                    lambda t, i: -t[:H].view(1, H, 1, 1).expand(1, H, S, S)),
    "u[b, kv]": ((B, S + 2), lambda t: lambda s, b, h, qi, ki: s + t[b, ki],
                 lambda t, i: t[:, None, None, :S].expand(B, H, S, S)),
    "w[h, q, kv]": ((H, S, S), lambda t: lambda s, b, h, qi, ki: s + 0.5 * t[h, qi, ki],
                    lambda t, i: 0.5 * t[None]),
    "t[kv, h] (another order)": ((S, H), lambda t: lambda s, b, h, qi, ki: s + t[ki, h],
                                 lambda t, i: t.t()[None, :, None, :]),
    "c * (kv - q), c 0-d": ((), lambda t: lambda s, b, h, qi, ki: s + t * (ki - qi),
                            lambda t, i: t * (i[None, :] - i[:, None])),
    "c of shape (1,) used whole": ((1,), lambda t: lambda s, b, h, qi, ki: s - t * (qi - ki).abs(),
                                   lambda t, i: -t * (i[:, None] - i[None, :]).abs()),
    "table[h, q - kv + S - 1]": ((H, 2 * S - 1), lambda t: lambda s, b, h, qi, ki: s + t[h, qi - ki + S - 1],
                                 lambda t, i: t[:, i[:, None] - i[None, :] + S - 1][None]),
}


@pytest.mark.parametrize("name", list(TABLES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_learning_term_matches_float64_over_the_steps_of_a_loop(name, dtype):
    shape, as_mod, as_array = TABLES[name]
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, S, H, D, generator=gen, dtype=dtype) for _ in range(3))
    table = torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(True)
    mod, positions = as_mod(table), torch.arange(S)
    grad = torch.randn(B, S, H, D, generator=gen, dtype=torch.float64)
    tolerance = 1e-10 if dtype == torch.float64 else 2e-5
    for step in range(3):
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
        out = fat.attention(*leaves, score_mod=mod)
        out.double().backward(grad)
        got = (out, *(x.grad for x in leaves), table.grad)
        table.grad = None
        exact_leaves = [x.detach().double().clone().requires_grad_(True) for x in (q, k, v, table)]
        exact_out = _exact(*exact_leaves[:3], as_array(exact_leaves[3], positions), D ** -0.5)
        exact_out.backward(grad)
        exact = (exact_out, *(x.grad for x in exact_leaves))
        for label, a, b in zip(("out", "dq", "dk", "dv", "dtable"), got, exact):
            error = float((a.double() - b).abs().max())
            assert error <= tolerance * max(1.0, float(b.abs().max())), (step, label, error)
        with torch.no_grad():
            table.add_(torch.randn(shape, generator=gen, dtype=dtype) / 4)
