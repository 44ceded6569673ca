#!/usr/bin/env bash
# Builds, on this (GPU-less) machine, everything the GPU machine runs, into .device-bin/
# (ignored by git; name it in the device tool's `carry`). Then, on the GPU machine:
#   bash scripts/device-run.sh [tests|bench|all]
set -euo pipefail
cd "$(dirname "$0")/.."
# cudarc binds the CUDA version the application chooses; the GPU machine's driver runs 13.0.
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
bash scripts/install-toolchains.sh >/dev/null
mkdir -p .device-bin && find .device-bin -maxdepth 1 -type f -delete
cargo test --release --features cuda --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys, shutil
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        name = m["target"]["name"]
        if name.startswith("cuda") or name == "peercomm":
            shutil.copy(m["executable"], ".device-bin/test-" + name)
            print("test binary:", name)
'
if [ -f examples/peercomm-bench/main.rs ]; then
  cargo build --release --features cuda --example peercomm-bench
  cp target/release/examples/peercomm-bench .device-bin/
  echo "bench binary: peercomm-bench"
fi
ls -la .device-bin
