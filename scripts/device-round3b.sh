#!/usr/bin/env bash
# Round three, second stop, on the GPU machine (one H200: multi-rank runs put several
# ranks on it), after scripts/device-build.sh and
# `BEFORE=6efb4a7 NAME=pre19 bash scripts/device-build-before.sh`, with .device-bin
# carried. Logs are packed into $OUT/round3b-logs.tgz; a summary is printed last.
#   bash scripts/device-round3b.sh [stages]    stages: core group tests perrank
#   core     the single-controller benchmark of the commit before the one-core work
#            (.device-bin/pre19) and of this tree, interleaved twice, world 2, bf16,
#            graph and eager, auto dispatch, 1 KiB to 16 MiB
#   group    a group of 8 all-reduces against 8 calls and one call (graph, world 2)
#   fused    the fused all-reduce + RMSNorm, one-stage against Lamport against the pair
#   tests    every CUDA test binary but the per-rank one (fuzzers at 2000 calls)
#   perrank  the per-rank CUDA suite
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-core group tests perrank}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }

for stage in $stages; do
  case $stage in
  core)
    args="--sizes 1024,8192,65536,262144,1048576,4194304,16777216 --dtypes bf16 --no-nccl --auto-only --batches 15"
    for round in 1 2; do
      for which in pre19 now; do
        bin=.device-bin/peercomm-bench
        [ "$which" = pre19 ] && bin=.device-bin/pre19/peercomm-bench
        timeout 150 "$bin" --world 2 $args --out "$OUT/core-$which-$round" > "$OUT/core-$which-$round.log" 2>&1
        summary+=("core $which round $round rc=$?")
      done
    done
    ;;
  group)
    timeout 150 .device-bin/peercomm-bench --world 2 --sizes 1024 --dtypes bf16 --no-nccl \
      --auto-only --batches 15 --group-calls --out "$OUT/group" > "$OUT/group.log" 2>&1
    summary+=("group rc=$?")
    ;;
  fused)
    # The fused all-reduce + residual + RMSNorm: one-stage, Lamport, and all-reduce then
    # RMSNorm, 1-256 tokens of hidden 4096 and 8192 (collectives.rs; the other
    # collectives only at 1 KiB).
    timeout 200 .device-bin/peercomm-bench --world 2 --sizes 1024 --dtypes bf16 --no-nccl \
      --auto-only --batches 15 --collectives --out "$OUT/fused" > "$OUT/fused.log" 2>&1
    summary+=("fused rc=$?")
    ;;
  tests)
    for t in .device-bin/test-*; do
      name=$(basename "$t")
      [ "$name" = test-cuda_per_rank ] && continue
      PEERCOMM_FUZZ_CALLS=2000 timeout 300 "$t" --test-threads=1 > "$OUT/$name.log" 2>&1
      summary+=("$name rc=$?: $(result "$OUT/$name.log")")
    done
    ;;
  perrank)
    timeout 300 .device-bin/test-cuda_per_rank --test-threads=1 --nocapture > "$OUT/test-cuda_per_rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda_per_rank.log")")
    ;;
  esac
done
grep -hE "FAILED|panicked|WRONG" "$OUT"/*.log 2>/dev/null | head -40
grep -hE "group of 8 /" "$OUT"/group.log 2>/dev/null
grep -hE "^fused .*graph" "$OUT"/fused.log 2>/dev/null
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3b-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
