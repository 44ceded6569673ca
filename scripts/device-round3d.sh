#!/usr/bin/env bash
# Round three, fourth stop, on the GPU machine (one H200: multi-rank runs put several
# ranks on it), after scripts/device-build.sh with .device-bin carried. Logs are packed
# into $OUT/round3d-logs.tgz; a summary is printed last. Stages, in the order given:
#   bash scripts/device-round3d.sh [stages]
#   group     a group of 8 all-reduces against 8 calls and one call (graph, world 2)
#   schost    single-controller eager host time, parallel launches off and on, against
#             an empty launch through the same path (worlds 2, 4)
#   hostcost  per-rank eager host time (staged, symmetric, staged with cudarc's event
#             tracking off) against an empty launch (worlds 2, 4)
#   tests     every CUDA test binary (the per-rank suite last)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-group schost hostcost tests}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
bench=.device-bin/peercomm-bench

for stage in $stages; do
  start=$(date +%s)
  case $stage in
  group)
    timeout 150 $bench --world 2 --sizes 1024 --dtypes bf16 --no-nccl \
      --auto-only --batches 15 --group-calls --out "$OUT/group" > "$OUT/group.log" 2>&1
    summary+=("group rc=$?")
    ;;
  schost)
    for w in 2 4; do
      timeout 120 $bench --world $w --host-cost --sizes 1024 --dtypes bf16 --no-nccl \
        --auto-only --no-graph --batches 11 --out "$OUT/schost$w" > "$OUT/schost$w.log" 2>&1
      summary+=("schost$w rc=$?")
    done
    ;;
  hostcost)
    for w in 2 4; do
      timeout 120 $bench --per-rank $w --host-cost --sizes 1024,8192,65536,262144 --dtypes bf16 \
        --no-nccl --no-graph --batches 5 --out "$OUT/hostcost$w" > "$OUT/hostcost$w.log" 2>&1
      summary+=("hostcost$w rc=$?")
    done
    ;;
  tests)
    for t in .device-bin/test-*; do
      name=$(basename "$t")
      [ "$name" = test-cuda_per_rank ] && continue
      PEERCOMM_FUZZ_CALLS=1000 timeout 200 "$t" --test-threads=1 > "$OUT/$name.log" 2>&1
      summary+=("$name rc=$?: $(result "$OUT/$name.log")")
    done
    timeout 240 .device-bin/test-cuda_per_rank --test-threads=1 > "$OUT/test-cuda_per_rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda_per_rank.log")")
    ;;
  esac
  summary+=("  ($stage: $(( $(date +%s) - start )) s)")
done
grep -hE "FAILED|panicked|WRONG" "$OUT"/*.log 2>/dev/null | head -40
grep -hE "group of 8 /|group-of-8|1-call " "$OUT"/group.log 2>/dev/null
grep -hE "^ *host cost|host time|launch only|tracking" "$OUT"/schost*.log 2>/dev/null
grep -hE "^host cost" "$OUT"/hostcost*.log 2>/dev/null
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3d-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
