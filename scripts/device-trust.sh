#!/usr/bin/env bash
# The trust run (issue 9) on the GPU machine, after scripts/device-build.sh (and, for the
# "before" evidence, scripts/device-build-before.sh). Logs go to $OUT; a short table is
# printed last. Works on 1 GPU (worlds 2, 4 and 8 run with several ranks per GPU) and on
# 2 GPUs (world 2 on real NVLink, plus the shared-device worlds).
#   bash scripts/device-trust.sh before suite      # stages, in order; default: all
#   stages: before suite fuzz perrank memcheck
#   FUZZ_CALLS=20000 (the world-2 fuzzer's calls)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/peercomm-out}
mkdir -p "$OUT"
stages=${*:-before suite fuzz perrank memcheck}
nvidia-smi -L | tee -a "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }

for stage in $stages; do
  case $stage in
  before)
    # Evidence that the regression tests fail on the code before the fixes.
    PEERCOMM_FUZZ_CALLS=400 timeout 300 .device-bin/before/test-cuda --test-threads=1 \
      lamport_after_width_change_with_late_rank sign_of_zero_in_groups_of_one \
      late_peer_after_timeout fuzz_schedule_world_4_shared_gpus > "$OUT/before.log" 2>&1
    summary+=("before (old code, new regression tests) rc=$?: $(result "$OUT/before.log")")
    grep -E "^test .*(FAILED|ok)$|panicked at|got |differs" "$OUT/before.log" | head -24
    ;;
  suite)
    # The CUDA suite with the fixes (the fuzzers at their default 2000 calls; world 2
    # gets its long run in the next stage).
    PEERCOMM_FUZZ_CALLS=2000 timeout 480 .device-bin/test-cuda --test-threads=1 \
      --skip fuzz_schedule_world_2 --nocapture > "$OUT/test-cuda.log" 2>&1
    summary+=("test-cuda rc=$?: $(result "$OUT/test-cuda.log")")
    grep -E "SKIPPED|FAILED|panicked|checked|replays|fuzz" "$OUT/test-cuda.log" | head -60
    ;;
  fuzz)
    PEERCOMM_FUZZ_CALLS=${FUZZ_CALLS:-20000} timeout 480 .device-bin/test-cuda \
      --test-threads=1 fuzz_schedule_world_2 --nocapture > "$OUT/fuzz-world2.log" 2>&1
    summary+=("fuzz world 2 rc=$?: $(result "$OUT/fuzz-world2.log")")
    grep -E "fuzz|checked|SEED|panicked" "$OUT/fuzz-world2.log" | tail -8
    ;;
  perrank)
    timeout 300 .device-bin/test-cuda_per_rank --test-threads=1 --nocapture > "$OUT/test-cuda-per-rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda-per-rank.log")")
    grep -E "SKIPPED|FAILED|panicked|checked" "$OUT/test-cuda-per-rank.log" | head -20
    ;;
  memcheck)
    # compute-sanitizer memcheck (out-of-bounds, misaligned accesses) over the hazards.
    PEERCOMM_FUZZ_CALLS=200 timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
      --print-limit 20 .device-bin/test-cuda --test-threads=1 lamport_after_width \
      sign_of_zero algorithms_agree drop_buffers > "$OUT/memcheck.log" 2>&1
    summary+=("memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(result "$OUT/memcheck.log")")
    ;;
  esac
done
printf '%s\n' "${summary[@]}"
