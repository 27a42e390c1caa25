#!/bin/bash
# One device call: build the native libraries, run the whole GPU suite (fuzz file apart), keep the
# built libraries for the next call (carry .native-cache with FUSEDATTN_CACHE_DIR=.native-cache).
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 FUSEDATTN_CACHE_DIR=${FUSEDATTN_CACHE_DIR:-$PWD/.native-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( time python3 -m fusedattn build --kinds core,torch,jax ) 2>&1 | tee $OUT/build.txt
timeout ${SUITE_SECONDS:-420} python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider --ignore=tests/gpu/test_fuzz_gpu.py ${PYTEST_ARGS:-} 2>&1 | tee $OUT/gpu-tests.txt | tail -40
mkdir -p $OUT/native-cache && cp -r $FUSEDATTN_CACHE_DIR/native $OUT/native-cache/ 2>/dev/null
du -sh $OUT/native-cache
if [ "${FUZZ:-1}" = "1" ]; then
  FUZZ_SUMMARY=$OUT/fuzz-gpu.txt FUSEDATTN_GIT_REV=${FUSEDATTN_GIT_REV:-unknown} timeout ${FUZZ_SECONDS:-120} \
    python3 -m pytest -q -m gpu tests/gpu/test_fuzz_gpu.py -p no:cacheprovider 2>&1 | tail -5 | tee $OUT/fuzz-pytest.txt
fi
