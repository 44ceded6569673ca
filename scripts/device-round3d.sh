#!/usr/bin/env bash
# Round three, fourth stop, on the GPU machine (one H200: multi-rank runs put several
# ranks on it), after scripts/device-build.sh with .device-bin carried. Logs are packed
# into $OUT/round3d-logs.tgz; a summary is printed last. Stages, in the order given:
#   bash scripts/device-round3d.sh [stages]
#   group     a group of 8 all-reduces against 8 calls and one call (graph, world 2),
#             with every variant bench binary present (peercomm-bench-<variant>)
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
    # The build's bench, then any variant builds beside it (peercomm-bench-<variant>:
    # the same tree with another batched kernel), interleaved twice, in one run.
    for round in ${GROUP_ROUNDS:-1 2}; do
      for b in $bench .device-bin/peercomm-bench-*; do
        [ -x "$b" ] || continue
        v=$(basename "$b"); v=${v#peercomm-bench}; v=${v#-}; v=${v:-build}
        timeout 60 $b --world 2 --sizes 1024 --dtypes bf16 --no-nccl \
          --auto-only --batches 15 --group-calls --out "$OUT/group-$v-$round" > "$OUT/group-$v-$round.log" 2>&1
        summary+=("group $v round $round rc=$?")
      done
    done
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
      case $name in test-cuda) limit=170;; test-cuda_overlap|test-cuda_driver_load) limit=40;; *) limit=70;; esac
      PEERCOMM_FUZZ_CALLS=1000 timeout $limit "$t" --test-threads=1 > "$OUT/$name.log" 2>&1
      summary+=("$name rc=$?: $(result "$OUT/$name.log")")
    done
    timeout 200 .device-bin/test-cuda_per_rank --test-threads=1 > "$OUT/test-cuda_per_rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda_per_rank.log")")
    ;;
  esac
  summary+=("  ($stage: $(( $(date +%s) - start )) s)")
done
grep -hE "FAILED|panicked|WRONG" "$OUT"/*.log 2>/dev/null | head -40
for f in "$OUT"/group-*.log; do [ -f "$f" ] && { echo "$(basename "$f"):"; grep -E "group of 8 /" "$f"; }; done
grep -hE "^ *host cost|host time|launch only|tracking" "$OUT"/schost*.log 2>/dev/null
grep -hE "^host cost" "$OUT"/hostcost*.log 2>/dev/null
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3d-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
