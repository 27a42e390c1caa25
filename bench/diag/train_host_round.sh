#!/bin/bash
# One device call's score_mod training host-time round (gpu_suite.sh's EXTRA): score_mod_train_host.py,
# then the native operator's step profile of softcap forward+backward at B1 S128. Results under $OUT.
set -u
(cd bench/diag && taskset -c 5 python3 score_mod_train_host.py) > $OUT/score_mod_train.txt 2>&1
grep -v "^    " $OUT/score_mod_train.txt | tail -12
FUSEDATTN_NATIVE_PROFILE=1 taskset -c 5 python3 - > $OUT/native-profile-softcap.txt 2>&1 <<'PY'
import torch
import fusedattn.torch as fat
from fusedattn import score_mods as sm
q, k, v = (torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad, mod = torch.randn_like(q), sm.softcap(30.0)
for _ in range(1000):
    torch.autograd.grad(fat.attention(q, k, v, mask="causal", score_mod=mod), (q, k, v), grad)
torch.cuda.synchronize()
PY
grep -v "leak\|nanobind" $OUT/native-profile-softcap.txt | tail -40
