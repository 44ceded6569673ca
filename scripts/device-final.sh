#!/usr/bin/env bash
# The run behind results/h200x2/: CUDA tests, the full benchmark against NCCL, and the
# Lamport-beyond-1-MiB probe used for the dispatch boundary. Runs on the GPU machine
# after scripts/device-build.sh; OUT is set by the device tool.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/peercomm-out}
bash scripts/device-run.sh tests 2>&1 | tail -3
.device-bin/peercomm-bench --dtypes bf16 --groups 2 --no-nccl --algorithms lamport,one_stage \
  --sizes 1048576,2097152,4194304 --lamport-slot-bytes 4194304 --batches 11 2>&1 \
  | grep graph | tee "$OUT/lamport-probe.log"
timeout 420 bash scripts/device-run.sh bench --batches 11 > "$OUT/bench-stdout.log" 2>&1
grep -A200 "^summary" "$OUT/bench.log" | grep -E " 2 .*graph| 2 .*eager" | head -120
grep -E "^link|peak" "$OUT/bench.log"
