#!/usr/bin/env bash
# Round three, seventh stop, on the GPU machine (one GPU: multi-rank runs put several
# ranks on it), after scripts/device-build.sh with .device-bin carried. Logs are packed
# into $OUT/round3g-logs.tgz as each stage ends. Stages, in the order given:
#   bash scripts/device-round3g.sh [stages]
#   shareable   the per-rank test of memory CUDA exports only as a file descriptor (a
#               POSIX-fd pool, shareable virtual memory) registered across processes
#   perrank     the whole per-rank CUDA suite
#   tests       every other CUDA suite (runs scripts/device-round3e.sh's `tests`)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-shareable perrank tests}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
for stage in $stages; do
  start=$(date +%s)
  case $stage in
  shareable)
    timeout 200 .device-bin/test-cuda_per_rank --test-threads=1 --nocapture \
      register_shareable > "$OUT/shareable.log" 2>&1
    summary+=("shareable rc=$?: $(result "$OUT/shareable.log")")
    grep -E "rank [0-9].*(cycles|refused)|world 2|panicked|FAILED" "$OUT/shareable.log" | head -20
    ;;
  perrank)
    timeout 300 .device-bin/test-cuda_per_rank --test-threads=1 --nocapture > "$OUT/test-cuda_per_rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda_per_rank.log")")
    ;;
  tests)
    # scripts/device-round3e.sh's stage, its logs packed beside this script's.
    OUT=$FINAL_OUT/round3e bash scripts/device-round3e.sh tests > "$OUT/tests.log" 2>&1
    summary+=("tests rc=$? (each suite's result in $OUT/tests.log)")
    ;;
  *) summary+=("unknown stage $stage") ;;
  esac
  summary+=("  ($stage: $(( $(date +%s) - start )) s)")
  printf '%s\n' "${summary[@]: -2}"
  tar czf "$FINAL_OUT/round3g-logs.tgz" -C "$OUT" .
done
grep -hE "FAILED|panicked|WRONG|wrong sum" "$OUT"/*.log 2>/dev/null | head -40
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3g-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
