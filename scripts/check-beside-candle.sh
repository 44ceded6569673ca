#!/usr/bin/env bash
# Checks that a crate depending on both candle-core 0.11 (feature `cuda`) and peercomm
# (feature `cuda`) builds: cudarc's linking mode and CUDA version are the application's
# (candle asks for dynamic linking and the version from the build system). About 10
# minutes on 2 cores (candle-kernels compiles its CUDA kernels). Needs nvcc: the pinned
# PyPI one from scripts/install-toolchains.sh is put on PATH. CI checks the same through
# integrations/candle (scripts/build-candle.sh), which also links.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
nvcc=$(ls "$root"/.venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)
dir=${TMPDIR:-/tmp}/peercomm-beside-candle
mkdir -p "$dir/src"
cat > "$dir/Cargo.toml" <<TOML
[package]
name = "peercomm-beside-candle"
version = "0.1.0"
edition = "2021"

[dependencies]
candle-core = { version = "0.11", features = ["cuda"] }
peercomm = { path = "$root", features = ["cuda"] }
TOML
echo 'fn main() { let _ = (peercomm::MAX_GPUS, candle_core::Device::Cpu); }' > "$dir/src/main.rs"
cd "$dir"
PATH="$(dirname "$nvcc"):$PATH" CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} cargo check
cargo tree -e features -i cudarc | grep -E 'cudarc feature "(dynamic|fallback|cuda-)'
