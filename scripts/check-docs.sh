#!/usr/bin/env bash
# The docs.rs build, checked: `DOCS_RS=1 cargo doc --no-deps --features cuda,hip` with
# rustdoc warnings as errors, and no CUDA or HIP compiler reachable (docs.rs has none).
#
# - NVCC, CUDA_HOME, CUDA_PATH, HIP_PATH, ROCM_PATH, PEERCOMM_HIPCC and the other
#   variables build.rs/build_hip.rs read are unset.
# - A folder of stand-ins that fail at once (nvcc, hipcc, clang++-19, clang++) goes first
#   on PATH: build.rs would find them before the pinned nvcc in .venv-cuda or Debian's
#   hipcc in /usr/bin (which cannot be dropped from PATH), so a build that tried to
#   compile device code fails here instead of passing because this machine has a
#   compiler.
# - Afterwards the build script's OUT_DIR must hold an empty CUDA fatbin and a HIP
#   manifest without code objects (what build.rs writes when DOCS_RS is set).
#
# `--cfg docsrs` is added as docs.rs adds it to every build. Reuses the target dir of the
# other steps (dev profile, features cuda,hip: the clippy step's dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."

stand_ins=$(mktemp -d)
trap 'rm -rf "$stand_ins"' EXIT
for tool in nvcc hipcc clang++-19 clang++; do
  printf '#!/bin/sh\necho "check-docs: %s called ($*), but DOCS_RS builds need no device compiler" >&2\nexit 127\n' \
    "$tool" >"$stand_ins/$tool"
  chmod +x "$stand_ins/$tool"
done

unset NVCC CUDA_HOME CUDA_PATH CUDA_ROOT CUDA_TOOLKIT_ROOT_DIR CUDARC_CUDA_VERSION \
  PEERCOMM_CUDA_ARCHS HIP_PATH ROCM_PATH PEERCOMM_HIPCC PEERCOMM_HIP_ARCHS PEERCOMM_HIP_FLAGS
export PATH="$stand_ins:$PATH"
export DOCS_RS=1
export RUSTDOCFLAGS="-D warnings --cfg docsrs"

messages="$stand_ins/messages.json"
start=$SECONDS
cargo doc --no-deps --features cuda,hip --message-format json-render-diagnostics >"$messages"
echo "check-docs: cargo doc took $((SECONDS - start)) s"

package_id=$(cargo metadata --no-deps --format-version 1 |
  python3 -c 'import json, sys; print(next(p["id"] for p in json.load(sys.stdin)["packages"] if p["name"] == "peercomm"))')
python3 - "$messages" "$package_id" <<'EOF'
import json, os, sys

out_dir = None
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "build-script-executed" and m["package_id"] == sys.argv[2]:
        out_dir = m["out_dir"]
if out_dir is None:
    sys.exit("check-docs: no build-script-executed message for peercomm")
fatbin = os.path.join(out_dir, "peercomm_cuda.fatbin")
manifest = open(os.path.join(out_dir, "hip_code_objects.rs")).read()
if os.path.getsize(fatbin) != 0:
    sys.exit(f"check-docs: {fatbin} is not empty: the CUDA kernels were compiled")
if "include_bytes!" in manifest:
    sys.exit("check-docs: hip_code_objects.rs embeds code objects: the HIP kernels were compiled")
print(f"check-docs: device compilation skipped (empty fatbin and HIP manifest in {out_dir})")
EOF
echo "check-docs: passed"
