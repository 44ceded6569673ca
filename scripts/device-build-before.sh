#!/usr/bin/env bash
# Builds the CUDA test binary of the code BEFORE the trust fixes (kernels and src/ at
# $BEFORE, default c248c05: the testing aids without the fixes) with TODAY's tests/, into
# .device-bin/before/. scripts/device-trust.sh runs its regression tests, which must fail.
set -euo pipefail
cd "$(dirname "$0")/.."
# cudarc binds the CUDA version the application chooses; the GPU machine's driver runs 13.0.
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-13000}
BEFORE=${BEFORE:-c248c05}
dir=/tmp/peercomm-before
rm -rf "$dir" && git worktree prune
git worktree add -q --detach "$dir" "$BEFORE"
cp -r tests/. "$dir/tests/"
ln -sfn "$PWD/.venv-cuda" "$dir/.venv-cuda"
(cd "$dir" && CARGO_TARGET_DIR="$PWD/target-before" cargo test --release --features cuda \
  --test cuda --no-run --message-format=json 2>/dev/null) | python3 -c '
import json, sys, shutil, os
os.makedirs(".device-bin/before", exist_ok=True)
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["profile"]["test"]:
        shutil.copy(m["executable"], ".device-bin/before/test-cuda")
        print("before binary: test-cuda")
'
git worktree remove --force "$dir"
