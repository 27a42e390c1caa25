#!/bin/bash
# One device call: the native libraries (carried prebuilt ones in .native-libs/, else built now and
# copied to $OUT/native-libs for the next call; BUILD=torch, or a comma list of kinds, builds those from
# this tree beside carried ones of the other kinds), then the GPU suite in WORKERS pytest-xdist processes
# (PYTEST_ARGS replaces its paths, word-split: node ids, no quotes; PYTEST_K, a -k expression, passes as one
# argument; SUITE=0 skips it) and any extra command (EXTRA). Carry .whl with pytest-xdist and execnet in it.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FUSEDATTN_CACHE_DIR=/tmp/fusedattn-cache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
names=(core:libfusedattn_core.so torch:libfusedattn_torch.so jax:libfusedattn_cudnn_call.so)
if [ -f .native-libs/libfusedattn_core.so ]; then  # carried: those present are used, the others built on first use
  for entry in "${names[@]}"; do
    kind=${entry%%:*}
    [ -f .native-libs/${entry#*:} ] && export FUSEDATTN_NATIVE_LIB_${kind^^}=$PWD/.native-libs/${entry#*:}
  done
  if [ -n "${BUILD:-}" ]; then  # built into a cache of their own, so each is found by its exact path
    fresh=/tmp/fusedattn-build-$$
    ( time FUSEDATTN_CACHE_DIR=$fresh python3 -m fusedattn build --kinds $BUILD ) > $OUT/build.txt 2>&1
    tail -4 $OUT/build.txt
    mkdir -p $OUT/native-libs
    for entry in "${names[@]}"; do
      kind=${entry%%:*}
      [[ ",$BUILD," == *",$kind,"* ]] || continue
      built=$(find $fresh -name ${entry#*:} | head -1)
      [ -n "$built" ] && export FUSEDATTN_NATIVE_LIB_${kind^^}=$built && cp $built $OUT/native-libs/
    done
  fi
  env | grep FUSEDATTN_NATIVE_LIB
else
  ( time python3 -m fusedattn build --kinds core,torch,jax ) 2>&1 | tee $OUT/build.txt
  mkdir -p $OUT/native-libs && find $FUSEDATTN_CACHE_DIR -name "*.so" -exec cp {} $OUT/native-libs/ \;
fi
if [ "${SUITE:-1}" = "1" ]; then  # the whole suite, fuzzer included, in WORKERS processes sharing the GPU
  FUZZ_SUMMARY=$OUT/fuzz-gpu.txt FUSEDATTN_GIT_REV=${FUSEDATTN_GIT_REV:-unknown} timeout ${SUITE_SECONDS:-420} \
    python3 -m pytest -v -m gpu -p no:cacheprovider -n ${WORKERS:-6} --durations=25 --tb=short ${PYTEST_K:+-k "$PYTEST_K"} ${PYTEST_ARGS:-tests/gpu} 2>&1 \
    | tee $OUT/gpu-tests.txt | grep -E "passed|failed| FAILED | ERROR |^FAILED|^ERROR|s call "
  # -v names each result as it lands: a suite cut off by the timeout still says which tests failed
  cat $OUT/fuzz-gpu-*of*.txt > $OUT/fuzz-gpu.txt 2>/dev/null && rm -f $OUT/fuzz-gpu-*of*.txt  # one file back
fi
if [ -n "${EXTRA:-}" ]; then eval "$EXTRA"; fi
