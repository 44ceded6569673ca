#!/usr/bin/env bash
# Round three, third stop, on the GPU machine (one H200: multi-rank runs put several
# ranks on it), after scripts/device-build.sh with .device-bin carried. Logs are packed
# into $OUT/round3c-logs.tgz; a summary is printed last.
#   bash scripts/device-round3c.sh [stages]
#   group     a group of 8 all-reduces against 8 calls and one call (graph, world 2)
#   zc2, zc4  the single controller (peercomm-auto), the per-rank staged path and the
#             per-rank zero-copy path (symmetric inputs) in one run and one JSON,
#             world 2 / 4 sharing the GPU, bf16, graph and eager, 1 KiB to 64 MiB
#   fused     the fused all-reduce + RMSNorm: one-stage, Lamport and the unfused pair
#   hostcost  per-rank eager host time against an empty launch (worlds 2, 4)
#   zcproc    the per-rank sweep in processes (symmetric buffers mapped over CUDA IPC)
#   smoke     the zero-copy smoke test binary, if built
#   tests     every CUDA test binary but the per-rank one
#   perrank   the per-rank CUDA suite
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL_OUT=${OUT:-/tmp/peercomm-out}
OUT=$FINAL_OUT/logs
mkdir -p "$OUT"
stages=${*:-group zc2 zc4 zcproc tests perrank}
nvidia-smi -L | tee "$OUT/gpus.txt"
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
bench=.device-bin/peercomm-bench
sweep="--min-bytes 1024 --max-bytes 67108864 --dtypes bf16 --no-nccl --batches 10"

for stage in $stages; do
  case $stage in
  group)
    timeout 150 $bench --world 2 --sizes 1024 --dtypes bf16 --no-nccl \
      --auto-only --batches 15 --group-calls --out "$OUT/group" > "$OUT/group.log" 2>&1
    summary+=("group rc=$?")
    ;;
  zc2|zc4)
    w=${stage#zc}
    timeout 280 $bench --per-rank "$w" --with-single $sweep --out "$OUT/$stage" > "$OUT/$stage.log" 2>&1
    summary+=("$stage rc=$?")
    ;;
  fused)
    # The fused all-reduce + residual + RMSNorm: one-stage, Lamport, and all-reduce then
    # RMSNorm, 1-256 tokens of hidden 4096 and 8192 (collectives.rs); the Lamport slot
    # holds 256 x 8192 bf16 (4 MiB) and its header.
    timeout 250 $bench --world 2 --sizes 1024 --dtypes bf16 --no-nccl --auto-only --batches 10 \
      --collectives --lamport-slot-bytes 8388608 --out "$OUT/fused" > "$OUT/fused.log" 2>&1
    summary+=("fused rc=$?")
    ;;
  hostcost)
    # Host time of one per-rank eager call (staged and zero copy) against an empty
    # launch through the same path, 1-256 KiB, worlds 2 and 4 (threads).
    for w in 2 4; do
      timeout 120 $bench --per-rank $w --host-cost --sizes 1024,8192,65536,262144 --dtypes bf16 \
        --no-nccl --no-graph --batches 5 --out "$OUT/hostcost$w" > "$OUT/hostcost$w.log" 2>&1
      summary+=("hostcost$w rc=$?")
    done
    ;;
  zcproc)
    timeout 120 $bench --per-rank 2 --processes --sizes 1024,1048576,16777216 --dtypes bf16 \
      --no-nccl --batches 5 --out "$OUT/zcproc" > "$OUT/zcproc.log" 2>&1
    summary+=("zcproc rc=$?")
    ;;
  smoke)
    for t in .device-bin/test-cuda_zero_copy*; do
      [ -f "$t" ] || continue
      timeout 200 "$t" --test-threads=1 --nocapture > "$OUT/$(basename "$t").log" 2>&1
      summary+=("$(basename "$t") rc=$?: $(result "$OUT/$(basename "$t").log")")
    done
    ;;
  tests)
    for t in .device-bin/test-*; do
      name=$(basename "$t")
      case $name in test-cuda_per_rank|test-cuda_zero_copy*) continue;; esac
      PEERCOMM_FUZZ_CALLS=1000 timeout 300 "$t" --test-threads=1 > "$OUT/$name.log" 2>&1
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
grep -hE "^host cost" "$OUT"/hostcost*.log 2>/dev/null
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
tar czf "$FINAL_OUT/round3c-logs.tgz" -C "$OUT" . && rm -rf "$OUT"
