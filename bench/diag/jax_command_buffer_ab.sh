#!/bin/bash
# One device call: the JAX feature rows at S=1024 with the cuDNN custom call declared safe for XLA's
# command buffers (the default) and without (FUSEDATTN_JAX_COMMAND_BUFFER=0), then with XLA's command
# buffers off; then the JAX tests that touch the plan registry. The JAX library is rebuilt (its source
# changed), and copied to $OUT for the next call. Env: TESTS (pytest node ids) overrides the tests.
rm -f .native-libs/libfusedattn_cudnn_call.so
export SUITE=0 EXTRA='
B="python bench/bench_jax.py --features --seqlens 1024 --repeats 5 --loop-ms 50"
timeout 200 $B --torch-peer --out $OUT/jax-cb-on.json > $OUT/bench-on.txt 2>&1; echo rc=$?
grep -A30 "^feature rows:" $OUT/bench-on.txt | head -60
cp "$(find /tmp/fusedattn-cache -name libfusedattn_cudnn_call.so | head -1)" $OUT/ 2>/dev/null
FUSEDATTN_JAX_COMMAND_BUFFER=0 timeout 120 $B --out $OUT/jax-cb-off.json > $OUT/bench-off.txt 2>&1; echo rc=$?
grep -A30 "^feature rows:" $OUT/bench-off.txt | head -60
XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout 60 $B --only "thd|padding" --out $OUT/jax-xla-cb-off.json \
  > $OUT/bench-xla-off.txt 2>&1; echo rc=$?
grep -A12 "^feature rows:" $OUT/bench-xla-off.txt | head -30
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/gpu/test_jax.py::test_native_programs_survive_the_cores_eviction tests/gpu/test_jax.py::test_native_library_builds_here tests/gpu/test_jax.py::test_features_forward_lse_and_gradients} \
  2>&1 | tee $OUT/tests.txt | grep -E "passed|failed|^FAILED|^E " | head -20
'
bash bench/diag/gpu_suite.sh 2>&1 | grep -v "leaked\|nanobind\|remainder\|refleaks"
