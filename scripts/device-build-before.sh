#!/usr/bin/env bash
# Builds the benchmark of an earlier commit ($BEFORE) into .device-bin/$NAME/peercomm-bench,
# so that one device call times it beside the current build (the same run, the same GPU).
#   BEFORE=6efb4a7 NAME=pre19 bash scripts/device-build-before.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
BEFORE=${BEFORE:?the commit to build}
NAME=${NAME:-before}
dir=/tmp/pc-$NAME
[ -d "$dir" ] || git worktree add -q --detach "$dir" "$BEFORE"
ln -sfn "$PWD/.venv-cuda" "$dir/.venv-cuda"
(cd "$dir" && CARGO_TARGET_DIR=${BEFORE_TARGET:-/work/target-before} cargo build --release \
  --features cuda --example peercomm-bench)
mkdir -p ".device-bin/$NAME"
cp "${BEFORE_TARGET:-/work/target-before}/release/examples/peercomm-bench" ".device-bin/$NAME/"
strip ".device-bin/$NAME/peercomm-bench" || true
echo "$NAME bench: .device-bin/$NAME/peercomm-bench ($BEFORE)"
