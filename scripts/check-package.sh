#!/usr/bin/env bash
# What `cargo publish` would upload, checked without uploading (needs the crates.io
# index; runs in a clean checkout, so no --allow-dirty):
# - peercomm: `cargo package` (the .crate is made, unpacked and built with the default
#   features, so the shipped files are enough to build the library), then
#   `cargo publish --dry-run` (the same, plus the checks an upload makes). The
#   verification builds in the dev profile in the same target dir, so it reuses the
#   build dependencies of the clippy steps.
# - peercomm-candle: `cargo package --no-verify --exclude-lockfile`: the .crate is made
#   and its manifest normalised (the path to peercomm dropped, `peercomm = "0.1"` kept),
#   but it is neither built nor given a lockfile: both would look peercomm 0.1 up on
#   crates.io, where it is not published yet (`no matching package named peercomm`).
#   Once peercomm is published, drop both flags (and build it: candle's CUDA kernels
#   make that the expensive part, so weigh it against CI time). Its Cargo.lock is not
#   shipped, and an earlier step that builds candle may have re-locked it (when a
#   dependency added to peercomm was not locked there yet): so --allow-dirty, after
#   checking that nothing else in integrations/candle differs from the commit.
set -euo pipefail
cd "$(dirname "$0")/.."

# A dependent builds no build dependency of peercomm (the signal bindings are committed;
# tools/signal-bindings regenerates them).
build_deps=$(cargo metadata --no-deps --format-version 1 | python3 -c '
import json, sys
pkg = next(p for p in json.load(sys.stdin)["packages"] if p["name"] == "peercomm")
print(" ".join(d["name"] for d in pkg["dependencies"] if d["kind"] == "build"))')
if [ -n "$build_deps" ]; then
  echo "check-package: peercomm has build dependencies: $build_deps" >&2
  exit 1
fi
cargo package
cargo publish --dry-run
dirty=$(git status --porcelain -- integrations/candle ':!integrations/candle/Cargo.lock')
if [ -n "$dirty" ]; then
  echo "check-package: uncommitted changes in integrations/candle:" >&2
  echo "$dirty" >&2
  exit 1
fi
(cd integrations/candle && cargo package --no-verify --exclude-lockfile --allow-dirty)
echo "check-package: passed"
