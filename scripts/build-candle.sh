#!/usr/bin/env bash
# Builds the candle integration (integrations/candle: lib, tests, the tp-mlp example)
# on a machine with no CUDA install and no GPU, as CI does: the link libraries from
# scripts/candle-cuda-libs.sh (outside the repository), the pinned nvcc on PATH, candle's kernels for
# CUDA_COMPUTE_CAP (default 90). Nothing is run. Arguments replace the default cargo
# command, e.g. `bash scripts/build-candle.sh clippy --release --all-targets -- -D warnings`.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
CUDA_ROOT=$(bash scripts/candle-cuda-libs.sh | tail -1)
export CUDA_ROOT
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
PATH="$(dirname "$(ls "$root"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)"):$PATH"
export PATH
cd integrations/candle
if [ $# -eq 0 ]; then
  set -- build --release --lib --tests --example tp-mlp
fi
cargo "$@"
