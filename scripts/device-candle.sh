#!/usr/bin/env bash
# Runs on the GPU machine the candle binaries that scripts/device-build-candle.sh built
# (carry .device-bin), writing logs and results under $OUT/candle:
#   test.log                   the integration tests (must end in "test result: ok")
#   h200x2/tp-mlp.{json,png}   the example on two GPUs, NCCL against peercomm (2+ GPUs)
#   shared-1gpu/               the example with 2 ranks sharing GPU 0 (NCCL skipped)
# Extra arguments go to the two-GPU example run (e.g. --iters 100).
set -u
# NVLink multicast stays off (it can take the shared host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/peercomm-out}
out=$OUT/candle
bin=${TMPDIR:-/tmp}/peercomm-candle-bin
mkdir -p "$out" "$bin"
tar -C "$bin" -xJf .device-bin/candle/candle-bins.tar.xz || { echo "no .device-bin/candle/candle-bins.tar.xz (run scripts/device-build-candle.sh here first)"; exit 1; }
nvidia-smi -L | tee "$out/gpus.txt"
gpus=$(nvidia-smi -L | grep -c '^GPU')

# The binaries link libcuda (the driver's), cudart, cuBLAS, cuBLASLt, cuRAND, NVRTC (CUDA
# 13) and NCCL by soname: the toolkit's folder first, then any pip wheel's (torch's).
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && dirs+=("$d")
done
while IFS= read -r d; do dirs+=("$d"); done < <(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
for r in roots:
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
PY
)
[ -n "${LD_LIBRARY_PATH:-}" ] && dirs+=("$LD_LIBRARY_PATH")
LD_LIBRARY_PATH=$(IFS=:; echo "${dirs[*]}")
export LD_LIBRARY_PATH
echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$out/libs.txt"
for b in "$bin"/*; do
  ldd "$b" >> "$out/libs.txt" 2>&1
done
if grep -q 'not found' "$out/libs.txt"; then
  echo "missing libraries (see $out/libs.txt):"
  grep 'not found' "$out/libs.txt" | sort -u
fi

summary=()
timeout 900 "$bin/test-tp_mlp" --test-threads=1 --nocapture > "$out/test.log" 2>&1
rc=$?
summary+=("test-tp_mlp rc=$rc: $(grep -E '^test result' "$out/test.log" | tail -1)")
grep -E "SKIP|ranks on|tokens|FAILED|panicked" "$out/test.log" | head -30

if [ "$gpus" -ge 2 ]; then
  timeout 900 "$bin/tp-mlp" --ranks 2 --out "$out/h200x2" "$@" > "$out/h200x2.log" 2>&1
  summary+=("tp-mlp 2 GPUs rc=$?")
  tail -12 "$out/h200x2.log"
else
  summary+=("tp-mlp 2 GPUs: skipped, $gpus GPU(s) here")
fi
timeout 900 "$bin/tp-mlp" --ranks 2 --gpus 1 --iters 20 --rounds 3 --out "$out/shared-1gpu" \
  > "$out/shared-1gpu.log" 2>&1
summary+=("tp-mlp 2 ranks on GPU 0 rc=$?")
tail -10 "$out/shared-1gpu.log"
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
