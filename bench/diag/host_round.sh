#!/bin/bash
# One device call's host-time round (run by gpu_suite.sh as EXTRA): the pinned overhead benchmark,
# the native operator's step profile over forward+backward calls, and the cuDNN suite's rows at
# SEQLENS (default 1024). Results under $OUT.
set -u
taskset -c 5 python3 bench/profile_overhead.py --out $OUT/overhead.json > $OUT/overhead.txt 2>&1
grep -E "ratio|ours|sdpa" $OUT/overhead.txt | tail -12
FUSEDATTN_NATIVE_PROFILE=1 taskset -c 5 python3 - > $OUT/native-profile.txt 2>&1 <<'PY'
import torch
import fusedattn.torch as fat
q, k, v = (torch.randn(8, 1024, 12, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
grad = torch.randn_like(q)
for _ in range(500):
    torch.autograd.grad(fat.attention(q, k, v, mask="causal"), (q, k, v), grad)
torch.cuda.synchronize()
from fusedattn.backends.cudnn.native import core
print("fusedattn native profile: launches by route", core.replay_counts())
PY
grep "profile" $OUT/native-profile.txt
timeout ${CUDNN_SECONDS:-200} python3 bench/bench_cudnn.py --seqlens ${SEQLENS:-1024} --out $OUT/cudnn.json \
  > $OUT/cudnn.txt 2>&1
grep -iE "ratio|^bshd|^gqa|^thd" $OUT/cudnn.txt | tail -24
