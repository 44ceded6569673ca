#!/usr/bin/env bash
# The trust run (issue 9) on the GPU machine, after scripts/device-build.sh (and, for the
# "before" evidence, scripts/device-build-before.sh). Logs go to $OUT; a short table is
# printed last. Works on 1 GPU (worlds 2, 4 and 8 run with several ranks per GPU) and on
# 2 GPUs (world 2 on real NVLink, plus the shared-device worlds).
#   bash scripts/device-trust.sh            # everything
#   FUZZ_CALLS=20000 bash scripts/device-trust.sh
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/peercomm-out}
mkdir -p "$OUT"
export PEERCOMM_FUZZ_CALLS=${FUZZ_CALLS:-20000}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()

# 1. Evidence that the regression tests fail on the code before the fixes.
if [ -x .device-bin/before/test-cuda ]; then
  timeout 300 .device-bin/before/test-cuda --test-threads=1 "${BEFORE_FILTER:-hazard}" \
    > "$OUT/before.log" 2>&1
  summary+=("before (old kernels + new regression tests) rc=$?: $(grep -E '^test result' "$OUT/before.log" | tail -1)")
  grep -E "^test .*(FAILED|ok)$|panicked" "$OUT/before.log" | head -20
fi

# 2. The CUDA suite with the fixes, the fuzzer asking for $PEERCOMM_FUZZ_CALLS calls.
timeout 420 .device-bin/test-cuda --test-threads=1 > "$OUT/test-cuda.log" 2>&1
summary+=("test-cuda rc=$?: $(grep -E '^test result' "$OUT/test-cuda.log" | tail -1)")
grep -E "SKIPPED|FAILED|panicked|checked|replays|fuzz" "$OUT/test-cuda.log" | head -60

# 3. compute-sanitizer memcheck over the hazard tests (out-of-bounds, misaligned).
if [ -x /usr/local/cuda/bin/compute-sanitizer ] && [ -z "${NO_SANITIZER:-}" ]; then
  PEERCOMM_FUZZ_CALLS=200 timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
    --print-limit 20 .device-bin/test-cuda --test-threads=1 hazard > "$OUT/memcheck.log" 2>&1
  summary+=("memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)")
fi
printf '%s\n' "${summary[@]}"
