#!/usr/bin/env bash
# Round-two GPU pass on the GPU machine, after scripts/device-build.sh: every CUDA test
# binary, then benchmark sanity runs. Works on 1 GPU (ranks share it: timings mean
# nothing there) and on 2 (the benchmark then measures for real). Logs go to $OUT; a
# short summary is printed last.
#   bash scripts/device-round2.sh [tests] [bench]      (default: both)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/peercomm-out}
mkdir -p "$OUT"
stages=${*:-tests bench}
gpus=$(nvidia-smi -L | tee "$OUT/gpus.txt" | wc -l)
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
for stage in $stages; do
  case $stage in
  tests)
    for t in .device-bin/test-cuda*; do
      name=$(basename "$t")
      PEERCOMM_FUZZ_CALLS=${FUZZ_CALLS:-2000} timeout 420 "$t" --test-threads=1 --nocapture \
        > "$OUT/$name.log" 2>&1
      summary+=("$name rc=$?: $(result "$OUT/$name.log")")
      grep -E "SKIPPED|FAILED|panicked" "$OUT/$name.log" | head -20
    done
    ;;
  bench)
    b=.device-bin/peercomm-bench
    timeout 240 $b --per-rank 2 --processes --max-bytes 1048576 --batches 5 \
      --out "$OUT/bench-per-rank-processes" > "$OUT/bench-per-rank-processes.log" 2>&1
    summary+=("bench per-rank processes rc=$?")
    timeout 240 $b --per-rank 2 --max-bytes 1048576 --batches 5 \
      --out "$OUT/bench-per-rank-threads" > "$OUT/bench-per-rank-threads.log" 2>&1
    summary+=("bench per-rank threads rc=$?")
    if [ "$gpus" -ge 2 ]; then
      timeout 420 $b --dtypes bf16 --batches 11 --overlap --host-cost --out "$OUT/bench" > "$OUT/bench.log" 2>&1
      summary+=("bench all-reduce (2 GPUs) rc=$?")
      timeout 420 $b --collectives --auto-only --dtypes bf16 --max-bytes 16777216 \
        --out "$OUT/bench-collectives" > "$OUT/bench-collectives.log" 2>&1
    else
      # Two ranks sharing the GPU: sums checked at every size, host cost per eager call.
      timeout 240 $b --world 2 --dtypes bf16 --batches 5 --max-bytes 16777216 --overlap --host-cost \
        --out "$OUT/bench-1gpu" > "$OUT/bench.log" 2>&1
      summary+=("bench world 2 sharing the GPU rc=$?")
      # The other collectives and the fused kernel, checked before timing (2 ranks sharing).
      timeout 300 $b --world 2 --collectives --auto-only --dtypes bf16 --batches 3 \
        --max-bytes 1048576 --out "$OUT/bench-collectives-1gpu" > "$OUT/bench-collectives.log" 2>&1
      summary+=("bench collectives, world 2 sharing the GPU rc=$?")
      tail -20 "$OUT/bench-collectives.log"
      # World 1: NCCL and NCCL-symmetric plumbing (one rank: no link).
      timeout 120 $b --dtypes bf16 --batches 3 --max-bytes 65536 --auto-only \
        > "$OUT/bench-world1.log" 2>&1
    fi
    summary+=("bench single-controller (${gpus} GPU) rc=$?")
    tail -30 "$OUT/bench.log"
    ;;
  esac
done
printf '%s\n' "${summary[@]}"
