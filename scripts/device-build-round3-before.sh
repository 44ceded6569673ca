#!/usr/bin/env bash
# Builds the benchmark of the commit before the call descriptor ($BEFORE, default
# 0f820a1) into .device-bin/before/peercomm-bench, for the descriptor-cost stage of
# scripts/device-round3.sh (the same run times both).
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
BEFORE=${BEFORE:-0f820a1}
dir=/tmp/pc-before
[ -d "$dir" ] || git worktree add -q --detach "$dir" "$BEFORE"
ln -sfn "$PWD/.venv-cuda" "$dir/.venv-cuda"
(cd "$dir" && CARGO_TARGET_DIR=${BEFORE_TARGET:-/work/target-before} cargo build --release \
  --features cuda --example peercomm-bench)
mkdir -p .device-bin/before
cp "${BEFORE_TARGET:-/work/target-before}/release/examples/peercomm-bench" .device-bin/before/
echo "before bench: .device-bin/before/peercomm-bench ($BEFORE)"
