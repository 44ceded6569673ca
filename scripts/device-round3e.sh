#!/usr/bin/env bash
# Round three, fifth stop, on the GPU machine (one H200: multi-rank runs put several
# ranks on it), after scripts/device-build.sh with .device-bin carried. Logs are packed
# into $OUT/round3e-logs.tgz; a summary is printed last. Stages, in the order given:
#   bash scripts/device-round3e.sh [stages]
#   perrank   the per-rank CUDA suite (registered captures and the pool trim included)
#   tests     every other CUDA test binary
#   zc2, zc4  the single controller (peercomm-auto), the per-rank staged path, the
#             per-rank symmetric path and (graph) the staged buffers captured registered,
#             in one run and one JSON per world, ranks sharing the GPU, bf16, graph and
#             eager, 1 KiB to 64 MiB (`scripts/zero-copy-table.py` prints the table)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-perrank tests zc2 zc4}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
bench=.device-bin/peercomm-bench
sweep="--min-bytes 1024 --max-bytes 67108864 --dtypes bf16 --no-nccl --batches ${ZC_BATCHES:-10}"

for stage in $stages; do
  start=$(date +%s)
  case $stage in
  perrank)
    timeout 200 .device-bin/test-cuda_per_rank --test-threads=1 --nocapture > "$OUT/test-cuda_per_rank.log" 2>&1
    summary+=("test-cuda_per_rank rc=$?: $(result "$OUT/test-cuda_per_rank.log")")
    ;;
  tests)
    for t in .device-bin/test-*; do
      name=$(basename "$t")
      [ "$name" = test-cuda_per_rank ] && continue
      case $name in test-cuda) limit=170;; test-cuda_overlap|test-cuda_driver_load) limit=40;; *) limit=70;; esac
      PEERCOMM_FUZZ_CALLS=1000 timeout $limit "$t" --test-threads=1 > "$OUT/$name.log" 2>&1
      summary+=("$name rc=$?: $(result "$OUT/$name.log")")
    done
    ;;
  zc2|zc4)
    w=${stage#zc}
    timeout 280 $bench --per-rank "$w" --with-single $sweep --out "$OUT/$stage" > "$OUT/$stage.log" 2>&1
    summary+=("$stage rc=$?")
    ;;
  esac
  summary+=("  ($stage: $(( $(date +%s) - start )) s)")
done
grep -hE "FAILED|panicked|WRONG|wrong sum" "$OUT"/*.log 2>/dev/null | head -40
for z in zc2 zc4; do
  [ -f "$OUT/$z/results.json" ] && python3 scripts/zero-copy-table.py "$OUT/$z/results.json" graph
done
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3e-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
