#!/bin/bash
# One device call's score_mod training host-time round (gpu_suite.sh's EXTRA): score_mod_train_host.py,
# then the native operator's step profile (FUSEDATTN_NATIVE_PROFILE) of forward+backward calls at
# B1 S128 H8 D64 causal, one process per variant (plain, softcap built-in, flex softcap, flex ALiBi).
set -u
(cd bench/diag && taskset -c 5 python3 score_mod_train_host.py) > $OUT/score_mod_train.txt 2>&1
grep -v "^    " $OUT/score_mod_train.txt | grep "us/step" | tail -12
for variant in plain builtin softcap alibi; do
VARIANT=$variant FUSEDATTN_NATIVE_PROFILE=1 taskset -c 5 python3 - > $OUT/native-profile-$variant.txt 2>&1 <<'PY'
import os, time, torch
import fusedattn.torch as fat
from fusedattn import score_mods as sm
q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
slopes = torch.rand(8, device="cuda") / 8
grad = torch.randn_like(q)
mods = {"plain": {}, "builtin": {"score_mod": sm.softcap(30.0)},
        "softcap": {"score_mod": lambda s, b, h, qi, ki: 30 * sm.tanh(s / 30)},
        "alibi": {"score_mod": lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)}}
given = mods[os.environ["VARIANT"]]
for _ in range(50):
    torch.autograd.grad(fat.attention(q, k, v, mask="causal", **given), (q, k, v), grad)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(1000):
    torch.autograd.grad(fat.attention(q, k, v, mask="causal", **given), (q, k, v), grad)
print(f"host+gpu {(time.perf_counter() - start) * 1e3:.1f} us/step (1000 steps)")
torch.cuda.synchronize()
PY
echo "== $variant"; grep -v "leak\|nanobind\|skipped rem" $OUT/native-profile-$variant.txt | grep "us/\|Error" | head -30
done
