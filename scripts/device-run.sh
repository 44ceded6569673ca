#!/usr/bin/env bash
# Runs on the GPU machine (see scripts/device-build.sh), writing logs under $OUT.
#   bash scripts/device-run.sh tests   # CUDA reference suite + graph replays
#   bash scripts/device-run.sh bench   # benchmark against NCCL
#   bash scripts/device-run.sh all
set -u
# NVLink multicast stays off (it can take the shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/peercomm-out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi -L | tee "$OUT/gpus.txt"
nvidia-smi topo -m >> "$OUT/gpus.txt" 2>&1
summary=()
if [ "$what" = tests ] || [ "$what" = all ]; then
  for t in .device-bin/test-*; do
    name=$(basename "$t")
    # One test thread: two communicators spinning on the same GPUs at once could
    # starve each other of SMs.
    timeout 900 "$t" --test-threads=1 > "$OUT/$name.log" 2>&1
    rc=$?
    summary+=("$name rc=$rc: $(grep -E '^test result' "$OUT/$name.log" | tail -1)")
    grep -E "SKIPPED|FAILED|panicked|checked|replays" "$OUT/$name.log" | head -40
  done
fi
if { [ "$what" = bench ] || [ "$what" = all ]; } && [ -x .device-bin/peercomm-bench ]; then
  shift || true
  .device-bin/peercomm-bench --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -80
  summary+=("bench rc=${PIPESTATUS[0]}")
fi
printf '%s\n' "${summary[@]}"
