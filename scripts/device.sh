#!/usr/bin/env bash
# The GPU runs, in named stages. `build` runs here (no GPU needed) and packs what the GPU
# machine runs into .device-pack/ (git-ignored; name it in the device tool's `carry`);
# every other stage runs there, over the unpacked binaries, writing logs under $OUT.
#
#   bash scripts/device.sh build [BASE_REV]   here: CUDA test binaries and the bench, xz-packed;
#                                             with BASE_REV, also that revision's bench (as
#                                             peercomm-bench-base) for before/after rows
#                                             (BASE_BENCH=path takes one already built)
#   bash scripts/device.sh build-candle       here, after `build`: the candle integration's
#                                             test and tp-mlp example, xz-packed beside it
#   bash scripts/device.sh STAGE...           there, in the order given:
#     tests      every CUDA test binary but the per-rank suite
#     per-rank   the per-rank CUDA suite (ranks as threads and processes, sharing the GPU)
#     shareable  the per-rank tests of memory CUDA exports only as a file descriptor (a
#                POSIX-fd pool, shareable virtual memory) registered across processes
#     memcheck   the per-rank CUDA suite under compute-sanitizer --tool memcheck, in
#                MEMCHECK_SHARDS parallel processes (MEMCHECK_FILTER: names containing it)
#     repeat     one per-rank test (REPEAT_TEST) REPEAT_COUNT times
#     bench      per-rank (threads) against the single controller at worlds 2 and 4
#                (BENCH_WORLDS), graph and eager, bf16; the base bench first where one
#                was packed; BENCH_OPS adds those reduction operators beside the sum,
#                BENCH_TYPES the sum over those element types beside f32's,
#                BENCH_EXCHANGE=1 the point-to-point calls against a D2D copy (with
#                any of the three, parity.md and parity.png beside results.json);
#                BENCH_SIZES (bytes, comma-separated) replaces the four sizes
#     zero-copy  per rank (threads) staged, symmetric and registered capture against the
#                single controller, 1 KiB-64 MiB, graph and eager, bf16, at worlds
#                ZC_WORLDS (2 4), one sweep per ZC_SWEEPS entry: base, gate (windows
#                gated, --gate-us 500), calls and gatecalls (200 calls a batch, to
#                1 MiB); each JSON's table by scripts/zero-copy-table.py
#     device-api the device API's example (examples/device-api): its kernels compiled by
#                NVRTC, checked against f64, then timed against the library's one-stage
#                all-reduce and the unfused pair, at worlds DEVICE_API_WORLDS (2 4)
#     candle     the candle integration's test and the tensor-parallel MLP example
#                (on two GPUs where there are two, NCCL against peercomm; and two ranks
#                sharing GPU 0); CANDLE_ARGS go to the two-GPU run
#
# With one GPU every multi-rank test puts several ranks on it (allow_shared_devices).
# NVLink multicast stays off. Each stage's summary line is printed as it ends, and the
# logs are packed into $OUT/logs.tgz after every stage, so a run cut short keeps them.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PACK=.device-pack
BIN=.device-bin

build() {
  set -e
  # cudarc binds the CUDA version the application chooses; the GPU machine runs 13.0.
  export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
  export PEERCOMM_KERNEL_CACHE=${PEERCOMM_KERNEL_CACHE:-$PWD/target/kernel-cache}
  bash scripts/install-toolchains.sh >/dev/null
  rm -rf "$BIN" "$PACK" && mkdir -p "$BIN" "$PACK"
  cargo test --release --features cuda --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"]
        if name.startswith("cuda") or name == "peercomm":
            shutil.copy(m["executable"], sys.argv[1] + "/test-" + name)
' "$BIN"
  cargo build --release --features cuda --example peercomm-bench --example device-api
  cp "${CARGO_TARGET_DIR:-target}/release/examples/peercomm-bench" "$BIN/"
  cp "${CARGO_TARGET_DIR:-target}/release/examples/device-api" "$BIN/"
  if [ -n "${BASE_BENCH:-}" ]; then
    cp "$BASE_BENCH" "$BIN/peercomm-bench-base"
  elif [ -n "${1:-}" ]; then
    local tree
    tree=$(mktemp -d)/base
    git worktree add --detach "$tree" "$1" >/dev/null
    ln -s "$PWD/.venv-cuda" "$tree/.venv-cuda"
    (cd "$tree" && CARGO_TARGET_DIR=${BASE_TARGET:-$tree/target} \
      cargo build --release --features cuda --example peercomm-bench)
    cp "${BASE_TARGET:-$tree/target}/release/examples/peercomm-bench" "$BIN/peercomm-bench-base"
    git worktree remove --force "$tree"
  fi
  tar cf - -C "$BIN" . | xz -6 -T2 > "$PACK/bins.tar.xz"
  ls -la "$BIN" "$PACK"
}

# The candle binaries link candle's kernels (about 45 MB each, mostly shared): stripped
# and packed together they take about 6 MB of the carry.
build_candle() {
  set -e
  local dir=$BIN/candle
  rm -rf "$dir" && mkdir -p "$dir" "$PACK"
  bash scripts/build-candle.sh build --release --tests --example tp-mlp --message-format=json |
    python3 -c '
import json, os, shutil, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name, kinds = m["target"]["name"], m["target"]["kind"]
    if m["profile"]["test"] and name == "tp_mlp":
        shutil.copy(m["executable"], os.path.join(sys.argv[1], "test-tp_mlp"))
    elif "example" in kinds and name == "tp-mlp":
        shutil.copy(m["executable"], os.path.join(sys.argv[1], "tp-mlp"))
' "$dir"
  strip "$dir/test-tp_mlp" "$dir/tp-mlp"
  tar cf - -C "$dir" test-tp_mlp tp-mlp | xz -9 -T2 > "$PACK/candle-bins.tar.xz"
  ls -la "$PACK"
}

case ${1:-} in
build)
  shift
  build "$@"
  exit
  ;;
build-candle)
  build_candle
  exit
  ;;
esac

OUT=${OUT:-/tmp/peercomm-out}
LOGS=$OUT/logs
mkdir -p "$LOGS"
if [ ! -x "$BIN/peercomm-bench" ]; then
  mkdir -p "$BIN" && xz -dc "$PACK/bins.tar.xz" | tar xf - -C "$BIN"
fi
nvidia-smi -L | tee "$LOGS/gpus.txt"
git log -1 --format='%h %s' > "$LOGS/commit.txt" 2>/dev/null || true
summary=()
result() { grep -E '^test result' "$1" | tail -1; }
note() {
  summary+=("$1")
  echo "$1"
}
sizes=1024,65536,1048576,16777216

# The candle integration's test and example (packed by `build-candle`).
candle() {
  local dir=$BIN/candle d libs=()
  mkdir -p "$dir" "$LOGS/candle"
  if ! xz -dc "$PACK/candle-bins.tar.xz" | tar xf - -C "$dir"; then
    note "candle: no $PACK/candle-bins.tar.xz (run \`bash scripts/device.sh build-candle\` here first)"
    return
  fi
  # The binaries link libcuda (the driver's), cudart, cuBLAS, cuBLASLt, cuRAND, NVRTC
  # and NCCL by soname: the toolkit's folders first, then any pip wheel's.
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -d "$d" ] && libs+=("$d")
  done
  while IFS= read -r d; do libs+=("$d"); done < <(python3 -c '
import glob, os, site
for r in site.getsitepackages() + [site.getusersitepackages()]:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
' 2>/dev/null)
  [ -n "${LD_LIBRARY_PATH:-}" ] && libs+=("$LD_LIBRARY_PATH")
  LD_LIBRARY_PATH=$(
    IFS=:
    echo "${libs[*]}"
  )
  export LD_LIBRARY_PATH
  ldd "$dir/test-tp_mlp" "$dir/tp-mlp" >"$LOGS/candle/libs.txt" 2>&1
  grep 'not found' "$LOGS/candle/libs.txt" | sort -u
  timeout 900 "$dir/test-tp_mlp" --test-threads=1 --nocapture >"$LOGS/candle/test.log" 2>&1
  note "candle test-tp_mlp rc=$?: $(result "$LOGS/candle/test.log")"
  if [ "$(nvidia-smi -L | grep -c '^GPU')" -ge 2 ]; then
    # shellcheck disable=SC2086 # CANDLE_ARGS is a list of arguments
    timeout 900 "$dir/tp-mlp" --ranks 2 --out "$LOGS/candle/two-gpus" ${CANDLE_ARGS:-} \
      >"$LOGS/candle/two-gpus.log" 2>&1
    note "candle tp-mlp on 2 GPUs rc=$?"
  else
    note "candle tp-mlp on 2 GPUs: skipped, one GPU here"
  fi
  timeout 900 "$dir/tp-mlp" --ranks 2 --gpus 1 --iters 20 --rounds 3 --out "$LOGS/candle/shared-1gpu" \
    >"$LOGS/candle/shared-1gpu.log" 2>&1
  note "candle tp-mlp, 2 ranks on GPU 0 rc=$?"
}

for stage in "$@"; do
  start=$(date +%s)
  case $stage in
  tests)
    for t in "$BIN"/test-*; do
      name=$(basename "$t")
      [ "$name" = test-cuda_per_rank ] && continue
      case $name in test-cuda) limit=170 ;; test-cuda_overlap | test-cuda_driver_load) limit=40 ;; *) limit=90 ;; esac
      PEERCOMM_FUZZ_CALLS=1000 timeout $limit "$t" --test-threads=1 >"$LOGS/$name.log" 2>&1
      note "$name rc=$?: $(result "$LOGS/$name.log")"
    done
    ;;
  per-rank)
    timeout 300 "$BIN/test-cuda_per_rank" --test-threads=1 --nocapture >"$LOGS/test-cuda_per_rank.log" 2>&1
    note "test-cuda_per_rank rc=$?: $(result "$LOGS/test-cuda_per_rank.log")"
    ;;
  shareable)
    timeout 200 "$BIN/test-cuda_per_rank" --test-threads=1 --nocapture register_shareable \
      >"$LOGS/shareable.log" 2>&1
    note "shareable rc=$?: $(result "$LOGS/shareable.log")"
    ;;
  memcheck)
    # In MEMCHECK_SHARDS processes at once (default 8), each under its own sanitizer:
    # the sanitizer slows every kernel, and most tests wait on peers. Without the NCCL
    # fallback (PEERCOMM_TEST_NO_FALLBACK): NCCL's own kernels do not load under it.
    shards=${MEMCHECK_SHARDS:-8}
    "$BIN/test-cuda_per_rank" --list 2>/dev/null | sed -n 's/: test$//p' |
      grep -- "${MEMCHECK_FILTER:-}" >"$LOGS/memcheck-list.txt"
    for s in $(seq 0 $((shards - 1))); do
      mapfile -t names < <(awk -v s="$s" -v n="$shards" '(NR - 1) % n == s' "$LOGS/memcheck-list.txt")
      [ ${#names[@]} -gt 0 ] || continue
      (
        PEERCOMM_TEST_NO_FALLBACK=1 timeout "${MEMCHECK_LIMIT:-520}" /usr/local/cuda/bin/compute-sanitizer --tool memcheck \
          --print-limit 1000000 --target-processes all --log-file "$LOGS/memcheck-$s-%p.txt" \
          "$BIN/test-cuda_per_rank" --test-threads=1 --nocapture --exact "${names[@]}" \
          >"$LOGS/memcheck-tests-$s.log" 2>&1
        echo "shard $s rc=$?" >>"$LOGS/memcheck-shards.txt"
      ) &
    done
    wait
    errors=$(grep -h "ERROR SUMMARY" "$LOGS"/memcheck-*-*.txt | sort | uniq -c | tr '\n' ';')
    # Memory errors apart from failed API calls ("Program hit ..."), which include the
    # refusals the tests provoke on purpose.
    access=$(cat "$LOGS"/memcheck-*-*.txt | grep -cE '^========= (Invalid|Misaligned|Out-of-range|Cuda (illegal|misaligned)|Leaked|Malloc|Free)')
    api=$(cat "$LOGS"/memcheck-*-*.txt | grep -h '^========= Program hit' | sed 's/^========= Program hit //' | sort | uniq -c | sort -rn | tr '\n' ';')
    # From libtest's result lines and failure lists (--nocapture interleaves the rest).
    passed=$(cat "$LOGS"/memcheck-tests-*.log | awk '/^test result/ {n += $4} END {print n + 0}')
    failed=$(cat "$LOGS"/memcheck-tests-*.log | sed -n '/^failures:$/,/^test result/p' |
      sed -n 's/^    \([^ ]\+\)$/\1/p' | sort -u | tr '\n' ' ')
    note "memcheck: $(wc -l <"$LOGS/memcheck-list.txt") tests in $shards shards ($(sort "$LOGS/memcheck-shards.txt" | tr '\n' ' ')); $passed ok; failed: ${failed:-none}; sanitizer: $errors memory errors: $access; failed API calls: $api"
    ;;
  repeat)
    # REPEAT_TEST (an exact per-rank test name) REPEAT_COUNT times (default 5).
    for i in $(seq 1 "${REPEAT_COUNT:-5}"); do
      timeout 120 "$BIN/test-cuda_per_rank" --test-threads=1 --nocapture --exact "$REPEAT_TEST" >"$LOGS/repeat-$i.log" 2>&1
      note "repeat $i of $REPEAT_TEST rc=$?: $(grep -h "took" "$LOGS/repeat-$i.log" | tr '\n' ' ')"
    done
    ;;
  bench)
    for b in peercomm-bench-base peercomm-bench; do
      [ -x "$BIN/$b" ] || continue
      for w in ${BENCH_WORLDS:-2 4}; do
        # BENCH_OPS (e.g. prod,max,min,avg): each operator beside the sum (this build's bench).
        ops=()
        [ "$b" = peercomm-bench ] && [ -n "${BENCH_OPS:-}" ] && ops=(--ops "$BENCH_OPS")
        # BENCH_EXCHANGE=1: all-to-all, all-to-all-v and send/recv against a D2D copy.
        [ "$b" = peercomm-bench ] && [ -n "${BENCH_EXCHANGE:-}" ] && ops+=(--exchange)
        # BENCH_TYPES (e.g. i8,u8,i32,i64,f64): the sum over each type beside f32's.
        [ "$b" = peercomm-bench ] && [ -n "${BENCH_TYPES:-}" ] && ops+=(--sum-types "$BENCH_TYPES")
        timeout "${BENCH_LIMIT:-150}" "$BIN/$b" --per-rank $w --with-single --sizes ${BENCH_SIZES:-$sizes} --dtypes bf16 --no-nccl \
          --batches 10 "${ops[@]}" --out "$LOGS/$b-w$w" >"$LOGS/$b-w$w.log" 2>&1
        note "$b world $w rc=$?"
      done
    done
    ;;
  zero-copy)
    for w in ${ZC_WORLDS:-2 4}; do
      for sweep in ${ZC_SWEEPS:-base gate}; do
        case $sweep in
        base) extra=(--max-bytes 67108864) ;;
        gate) extra=(--max-bytes 67108864 --gate-us 500) ;;
        calls) extra=(--max-bytes 1048576 --batch-calls 200) ;;
        gatecalls) extra=(--max-bytes 1048576 --gate-us 500 --batch-calls 200) ;;
        *)
          note "unknown zero-copy sweep $sweep"
          continue
          ;;
        esac
        name=zero-copy-$sweep-w$w
        timeout "${ZC_LIMIT:-280}" "$BIN/peercomm-bench" --per-rank "$w" --with-single --min-bytes 1024 \
          "${extra[@]}" --dtypes bf16 --no-nccl --batches "${ZC_BATCHES:-15}" --out "$LOGS/$name" \
          >"$LOGS/$name.log" 2>&1
        note "$name rc=$?"
        [ -f "$LOGS/$name/results.json" ] &&
          python3 scripts/zero-copy-table.py "$LOGS/$name/results.json" graph | tee "$LOGS/$name.md"
      done
    done
    ;;
  device-api)
    # The device API's example: NVRTC (the machine's CUDA 13.0) compiles its kernels at
    # run time; worlds DEVICE_API_WORLDS (2 4), ranks sharing the GPU; checked, then timed.
    for w in ${DEVICE_API_WORLDS:-2 4}; do
      LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} timeout "${DEVICE_API_LIMIT:-200}" \
        "$BIN/device-api" --backend cuda --world "$w" >"$LOGS/device-api-w$w.log" 2>&1
      note "device-api world $w rc=$?: $(grep -c 'match the f64 reference' "$LOGS/device-api-w$w.log") ranks checked"
    done
    LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} timeout "${DEVICE_API_LIMIT:-200}" \
      "$BIN/device-api" --backend cuda --world 2 --processes >"$LOGS/device-api-processes.log" 2>&1
    note "device-api world 2, processes rc=$?: $(tail -1 "$LOGS/device-api-processes.log")"
    ;;
  candle) candle ;;
  *) note "unknown stage $stage" ;;
  esac
  note "  ($stage: $(($(date +%s) - start)) s)"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
done
grep -hE "FAILED|panicked|WRONG|wrong sum" "$LOGS"/*.log 2>/dev/null | head -40
printf '%s\n' "${summary[@]}" | tee "$LOGS/summary.txt"
tar czf "$OUT/logs.tgz" -C "$LOGS" .
