#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, the candle integration's GPU binaries into
# .device-bin/candle/ (ignored by git; carry it to the GPU machine, which has no Rust):
#   candle-bins.tar.xz, holding
#     test-tp_mlp   the integration tests (tensor-parallel block = single-GPU block, errors)
#     tp-mlp        the tensor-parallel Llama-3-8B MLP example (NCCL against peercomm)
# Then, on the GPU machine: bash scripts/device-candle.sh
# Binds CUDA 13.0 (the pinned nvcc; the GPU machine runs 13.0) and builds candle's kernels for
# sm_90 (H100/H200); override with CUDA_COMPUTE_CAP.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
bash scripts/build-candle.sh build --release --tests --example tp-mlp
export CUDA_ROOT=$root/.candle-cuda
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
PATH="$(dirname "$(ls "$root"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)"):$PATH"
export PATH
out=$root/.device-bin/candle
mkdir -p "$out" && find "$out" -maxdepth 1 -type f -delete
cd integrations/candle
cargo build --release --tests --example tp-mlp --message-format=json 2>/dev/null \
  | OUT="$out" python3 -c '
import json, os, shutil, sys
out = os.environ["OUT"]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    name, kinds = m["target"]["name"], m["target"]["kind"]
    if m["profile"]["test"] and name == "tp_mlp":
        dst = "test-tp_mlp"
    elif "example" in kinds and name == "tp-mlp":
        dst = "tp-mlp"
    else:
        continue
    shutil.copy(m["executable"], os.path.join(out, dst))
    print("binary:", dst)
'
# Each binary is about 45 MB (candle's kernels are inside); the carry to the GPU machine
# is limited, and the two share most of their bytes: one xz archive holds both in ~6 MB.
strip "$out"/test-tp_mlp "$out"/tp-mlp
tar -C "$out" -cf - test-tp_mlp tp-mlp | xz -9 > "$out/candle-bins.tar.xz"
rm "$out"/test-tp_mlp "$out"/tp-mlp
ls -la "$out"
