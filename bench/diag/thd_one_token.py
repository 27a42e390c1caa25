"""Diagnose cuDNN THD backward with one-token sequences beside longer ones (issue 12, case 1).

Per sequence, the error of dq/dk/dv against a float64 computation, for several length lists,
layouts (THD, padded BSHD with a padding mask) and options. Prints one line per case.
"""
import json
import os
import sys

import torch

import fusedattn.torch as fat

torch.manual_seed(0)
DEV = "cuda"


def exact(q, k, v, do, lens, scale, causal):
    """Per-sequence float64 attention gradients (dq, dk, dv) for THD tensors, plus lse."""
    q, k, v, do = (x.double().detach().requires_grad_(True) for x in (q, k, v, do))
    outs, lses = [], []
    start = 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs, ks, vs = q[start:start + n], k[start:start + n], v[start:start + n]
        ks, vs = ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1)
        outs.append(torch.einsum("hqk,khd->qhd", p, vs))
        lses.append(lse.transpose(0, 1))
        start += n
    out = torch.cat(outs)
    (out * do).sum().backward()
    return out, torch.cat(lses), q.grad, k.grad, v.grad


def per_sequence(got, want, lens):
    errs, start = [], 0
    scale = want.abs().max().item()
    for n in lens:
        if n == 0:
            errs.append(0.0)
            continue
        errs.append(round((got[start:start + n].double() - want[start:start + n]).abs().max().item() / scale, 4))
        start += n
    return errs


def case(lens, hq=8, hkv=2, d=128, causal=False, layout="thd", trusted=False, deterministic=False,
         dtype=torch.bfloat16):
    total = sum(lens)
    q = torch.randn(total, hq, d, device=DEV, dtype=dtype)
    k = torch.randn(total, hkv, d, device=DEV, dtype=dtype)
    v = torch.randn(total, hkv, d, device=DEV, dtype=dtype)
    do = torch.randn(total, hq, d, device=DEV, dtype=dtype)
    scale = d ** -0.5
    out64, lse64, dq64, dk64, dv64 = exact(q, k, v, do, lens, scale, causal)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=DEV)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    if layout == "thd":
        kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, mask="padding_causal" if causal else "padding")
        if trusted:
            kw.update(max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        res = fat.attention(*leaves, backend="cudnn", return_lse=True, deterministic=deterministic, **kw)
        out, lse = res.out, res.lse
        out.backward(do)
        grads = [x.grad for x in leaves]
    else:  # padded bshd with a padding mask
        b, s = len(lens), max(lens)
        pads = []
        for x in leaves:
            p = x.new_zeros(b, s, *x.shape[1:])
            st = 0
            for i, n in enumerate(lens):
                p[i, :n] = x[st:st + n]
                st += n
            pads.append(p.detach().requires_grad_(True))
        res = fat.attention(*pads, backend="cudnn", return_lse=True, cu_seqlens_q=cu, cu_seqlens_kv=cu,
                            mask="padding_causal" if causal else "padding", deterministic=deterministic)
        dpad = do.new_zeros(b, s, hq, d)
        st = 0
        for i, n in enumerate(lens):
            dpad[i, :n] = do[st:st + n]
            st += n
        res.out.backward(dpad)
        unpad = lambda p: torch.cat([p[i, :n] for i, n in enumerate(lens)])  # noqa: E731
        out = unpad(res.out)
        lse = torch.cat([res.lse[i, :, :n].transpose(0, 1) for i, n in enumerate(lens)])
        grads = [unpad(x.grad) for x in pads]
    row = dict(lens=lens, hq=hq, hkv=hkv, d=d, causal=causal, layout=layout, trusted=trusted,
               deterministic=deterministic, dtype=str(dtype).split(".")[-1],
               out=per_sequence(out, out64, lens), lse=per_sequence(lse, lse64, lens),
               dq=per_sequence(grads[0], dq64, lens), dk=per_sequence(grads[1], dk64, lens),
               dv=per_sequence(grads[2], dv64, lens))
    # For a one-token first sequence the exact dq/dk are 0 (softmax over one key is 1, dS = 0);
    # dq = scale * dS * k tells what D cuDNN used: dS = dP - D'.
    if lens[0] == 1:
        g = hq // hkv
        kk = k[0].double().repeat_interleave(g, 0)  # (hq, d)
        dS = (grads[0][0].double() * kk).sum(-1) / (scale * (kk * kk).sum(-1))
        dP = (do[0].double() * v[0].double().repeat_interleave(g, 0)).sum(-1)
        D_true = (do[0].double() * out64[0]).sum(-1)
        row["seq0_D_used_minus_true"] = [round(x, 4) for x in (dP - dS - D_true).tolist()]
        row["seq0_D_true"] = [round(x, 4) for x in D_true.tolist()]
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    rows = []
    L0 = [1, 37, 1000, 5]
    plans = [
        dict(lens=L0), dict(lens=L0, causal=True), dict(lens=L0, trusted=True), dict(lens=L0, deterministic=True),
        dict(lens=L0, layout="bshd"), dict(lens=L0, hq=8, hkv=8, d=64), dict(lens=L0, dtype=torch.float16),
        dict(lens=[1, 37, 5]), dict(lens=[1, 1, 1]), dict(lens=[37, 1000, 5]), dict(lens=[0, 37, 1000, 5]),
        dict(lens=[37, 1, 1000, 5]), dict(lens=[37, 1000, 5, 1]), dict(lens=[2, 37, 1000, 5]),
        dict(lens=[1, 2]), dict(lens=[1, 64]), dict(lens=[1, 65]), dict(lens=[1, 128, 128]),
        dict(lens=[3, 37, 1000, 5]), dict(lens=[1, 37, 1000, 5], hq=2, hkv=2, d=64),
        dict(lens=[1, 1, 37]), dict(lens=[5, 1, 1, 37]),
    ]
    for plan in plans:
        try:
            rows.append(case(**plan))
        except Exception as error:  # noqa: BLE001
            print(json.dumps({"plan": str(plan), "error": f"{type(error).__name__}: {error}"[:400]}), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "thd_one_token.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    sys.exit(0)
