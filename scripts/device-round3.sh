#!/usr/bin/env bash
# Round three on the GPU machine (one H200 is enough: multi-rank tests put several ranks
# on it), after scripts/device-build.sh and scripts/device-build-round3-before.sh, with
# .device-bin carried. Logs go to $OUT; a short table is printed last.
#   bash scripts/device-round3.sh [stages]    stages: cost tests perrank fuzz memcheck
#   cost      the call descriptor's cost: peercomm-bench of the commit before it
#             (.device-bin/before/peercomm-bench) and of this tree, interleaved, graph
#             and eager, bf16, 1 KiB and 1 MiB, single controller (world 2) and per rank
#   tests     every CUDA test binary but the per-rank one (fuzzers at 2000 calls)
#   perrank   the per-rank CUDA suite (trust tests included)
#   fuzz      the single-controller fuzzer at world 2 and 4, mismatches included
#   memcheck  compute-sanitizer memcheck over the per-rank trust tests
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
# Logs are written to a folder, then packed into one file ($OUT/round3-logs.tgz): the
# device tool brings back only a few files.
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-cost tests perrank memcheck}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }

for stage in $stages; do
  case $stage in
  cost)
    args="--sizes 1024,1048576 --dtypes bf16 --no-nccl --batches 15 --algorithms auto,one_stage,lamport"
    for round in 1 2; do
      for which in before after; do
        bin=.device-bin/peercomm-bench
        [ "$which" = before ] && bin=.device-bin/before/peercomm-bench
        timeout 120 "$bin" --world 2 $args > "$OUT/cost-$which-world2-$round.log" 2>&1
        summary+=("cost $which world2 round $round rc=$?")
        timeout 120 "$bin" --per-rank 2 $args > "$OUT/cost-$which-perrank2-$round.log" 2>&1
        summary+=("cost $which per-rank2 round $round rc=$?")
      done
    done
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
  fuzz)
    PEERCOMM_FUZZ_CALLS=${FUZZ_CALLS:-4000} timeout 300 .device-bin/test-cuda --test-threads=1 \
      fuzz_schedule --nocapture > "$OUT/fuzz.log" 2>&1
    summary+=("fuzz rc=$?: $(result "$OUT/fuzz.log")")
    ;;
  memcheck)
    timeout 240 /usr/local/cuda/bin/compute-sanitizer --tool memcheck --print-limit 20 \
      .device-bin/test-cuda_per_rank --test-threads=1 mismatched sign_of_zero never_came \
      > "$OUT/memcheck.log" 2>&1
    summary+=("memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1) $(result "$OUT/memcheck.log")")
    ;;
  esac
done
grep -hE "FAILED|panicked" "$OUT"/*.log 2>/dev/null | head -40
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
