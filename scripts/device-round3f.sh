#!/usr/bin/env bash
# Round three, sixth stop, on the GPU machine (one GPU: multi-rank runs put several
# ranks on it), after scripts/device-build.sh with .device-bin carried. Logs are packed
# into $OUT/round3f-logs.tgz; a summary is printed last. Stages, in the order given:
#   bash scripts/device-round3f.sh [stages]
#   perrank       the per-rank CUDA suite (registered captures across processes included;
#                 the other CUDA suites are scripts/device-round3e.sh's `tests` stage)
#   base4, base2  world 4 / 2: single controller against the per-rank paths, as the
#                 fifth stop ran them (50 calls a batch, no gate), 1 KiB to 64 MiB
#   calls4        world 4, 200 calls a batch (--batch-calls 200), 1 KiB to 1 MiB: a cost
#                 paid once per batch shrinks 4x per call, one paid per call does not
#   gate4, gate2  world 4 / 2, graph windows gated (--gate-us 500): every rank's batch
#                 enqueued before any window opens, 1 KiB to 64 MiB
#   gatecalls4    world 4, gated and 200 calls a batch, 1 KiB to 1 MiB
# Every sweep: bf16, graph and eager, --per-rank N --with-single, no NCCL (ranks share
# the GPU). `scripts/zero-copy-table.py` prints each JSON's table.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-perrank base4 calls4 gate4 gatecalls4 base2 gate2}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
bench=.device-bin/peercomm-bench
common="--min-bytes 1024 --dtypes bf16 --no-nccl --batches ${ZC_BATCHES:-15}"
sweep() { # name world extra-args...
  local name=$1 w=$2
  shift 2
  timeout 280 $bench --per-rank "$w" --with-single $common "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  summary+=("$name rc=$?")
}

for stage in $stages; do
  start=$(date +%s)
  case $stage in
  perrank)
    timeout 240 .device-bin/test-cuda_per_rank --test-threads=1 --nocapture > "$OUT/test-cuda_per_rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda_per_rank.log")")
    ;;
  base4) sweep base4 4 --max-bytes 67108864 ;;
  base2) sweep base2 2 --max-bytes 67108864 ;;
  calls4) sweep calls4 4 --max-bytes 1048576 --batch-calls 200 ;;
  gate4) sweep gate4 4 --max-bytes 67108864 --gate-us 500 ;;
  gate2) sweep gate2 2 --max-bytes 67108864 --gate-us 500 ;;
  gatecalls4) sweep gatecalls4 4 --max-bytes 1048576 --gate-us 500 --batch-calls 200 ;;
  *) summary+=("unknown stage $stage") ;;
  esac
  summary+=("  ($stage: $(( $(date +%s) - start )) s)")
  # Each stage's result as it ends, and the logs packed so far: a run cut short by the
  # device's time limit still brings back what it finished.
  echo "${summary[-2]}"
  [ -f "$OUT/$stage/results.json" ] && python3 scripts/zero-copy-table.py "$OUT/$stage/results.json" graph
  [ "$stage" = perrank ] && grep -E "capture_registered_processes|killed_peer|^test result" "$OUT/test-cuda_per_rank.log"
  tar czf "$FINAL_OUT/round3f-logs.tgz" -C "$OUT" .
done
grep -hE "FAILED|panicked|WRONG|wrong sum" "$OUT"/*.log 2>/dev/null | head -40
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3f-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
