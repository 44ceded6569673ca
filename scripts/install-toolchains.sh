#!/usr/bin/env bash
# Installs what the feature builds and checks need on a Debian 12 machine (idempotent):
# libclang (scripts/check-bindings.sh runs bindgen), the pinned PyPI nvcc (CUDA 13.0) in
# .venv-cuda, and Debian's HIP toolchain plus clang-19 for gfx942, which the HIP build
# reaches through PEERCOMM_HIPCC=scripts/hipcc-debian.sh (docs/amd.md).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

need_apt=()
dpkg -s libclang-dev >/dev/null 2>&1 || need_apt+=(libclang-dev)
for p in hipcc libamdhip64-dev clang-19 lld-19 llvm-19; do
  dpkg -s "$p" >/dev/null 2>&1 || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${need_apt[@]}"
fi

if ! ls .venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc >/dev/null 2>&1; then
  python3 -m venv .venv-cuda
  .venv-cuda/bin/pip install -q "nvidia-cuda-nvcc==13.0.88" "nvidia-nvvm==13.0.88" \
    "nvidia-cuda-crt==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85"
fi
# NVRTC, which compiles the device API's header at run time in tests/device_api.rs (no
# GPU needed).
if ! ls .venv-cuda/lib/python3*/site-packages/nvidia/cu13/lib/libnvrtc.so.13 >/dev/null 2>&1; then
  .venv-cuda/bin/pip install -q "nvidia-cuda-nvrtc==13.0.88"
fi
# The device-library folder with the derived gfx942 ISA file (the wrapper also makes it
# on demand).
bash scripts/hipcc-debian.sh --prepare gfx942 >/dev/null
echo "toolchains ready: $(ls .venv-cuda/lib/python3*/site-packages/nvidia/cu13/bin/nvcc)," \
  "PEERCOMM_HIPCC=$PWD/scripts/hipcc-debian.sh for --features hip"
