#!/bin/bash
# One device call for the launch core's replays: builds the core (the torch operator carried in
# .native-libs), shows whether score_mod plans replay (FUSEDATTN_NATIVE_DEBUG traces), then runs
# TESTS (default tests/gpu/test_replay_gpu.py). The core is copied to $OUT/native-libs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FUSEDATTN_CACHE_DIR=/tmp/fusedattn-cache
export FUSEDATTN_NATIVE_LIB_TORCH=$PWD/.native-libs/libfusedattn_torch.so
python3 -m fusedattn build --kinds core 2>&1 | tail -1
mkdir -p $OUT/native-libs && find $FUSEDATTN_CACHE_DIR -name "libfusedattn_core.so" -exec cp {} $OUT/native-libs/ \;
FUSEDATTN_NATIVE_DEBUG=1 python3 - 2>&1 <<'PY' | grep -i "replay\|route"
import torch, fusedattn.torch as fat
from fusedattn import score_mods as sm
from fusedattn.backends.cudnn.native import core
q = torch.randn(1, 128, 4, 64, device="cuda", dtype=torch.bfloat16)
for name, mod in (("builtin", sm.softcap(20.0)), ("flex", lambda s, b, h, qi, ki: 20 * sm.tanh(s / 20))):
    for _ in range(5):
        fat.attention(q, q, q, score_mod=mod)
    torch.cuda.synchronize()
    print(name, "routes", core.replay_counts())
PY
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/gpu/test_replay_gpu.py} 2>&1 | tee $OUT/gpu-tests.txt | grep -E "passed|failed|^FAILED|^ERROR|^E  " | head -30
if [ -n "${EXTRA:-}" ]; then eval "$EXTRA"; fi
