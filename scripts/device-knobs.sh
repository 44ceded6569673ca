#!/usr/bin/env bash
# Block-count and block-size sweep of the bandwidth-bound algorithms (graph mode, bf16,
# whole world), used to set the dispatch table's grid sizes. Runs on the GPU machine.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/peercomm-out}
mkdir -p "$OUT"
sizes=${SIZES:-262144,1048576,4194304,16777216,268435456,1073741824}
for cfg in "132 512" "264 512" "528 256" "66 1024" "264 1024" "528 512"; do
  set -- $cfg
  echo "== max_blocks $1 threads $2"
  .device-bin/peercomm-bench --no-nccl --dtypes bf16 --groups 2 --batches 7 \
    --algorithms one_stage,two_stage --sizes "$sizes" --max-blocks "$1" --threads "$2" 2>&1 \
    | grep -E "peercomm-(one|two).* graph " | awk -v b="$1" -v t="$2" '{print b, t, $3, $4, $7, $8, $10}' | sort -u
done | tee "$OUT/knobs.log"
