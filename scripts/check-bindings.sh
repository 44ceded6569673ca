#!/usr/bin/env bash
# src/signal_bindings.rs is bindgen's Rust mirror of include/peercomm_signal.h,
# committed so that building peercomm needs neither bindgen nor libclang. This
# regenerates it (tools/signal-bindings: bindgen pinned, libclang from libclang-dev)
# and fails on any difference. After changing the header: `scripts/check-bindings.sh
# --write` replaces the committed copy.
set -euo pipefail
cd "$(dirname "$0")/.."
fresh=$(mktemp)
trap 'rm -f "$fresh"' EXIT
cargo run -q --locked --manifest-path tools/signal-bindings/Cargo.toml --target-dir target/tools \
  -- include/peercomm_signal.h "$fresh"
if [ "${1:-}" = --write ]; then
  cp "$fresh" src/signal_bindings.rs
  echo "check-bindings: src/signal_bindings.rs rewritten"
  exit 0
fi
if ! diff -u src/signal_bindings.rs "$fresh"; then
  echo "check-bindings: src/signal_bindings.rs differs from bindgen's output for" \
    "include/peercomm_signal.h (above: - committed, + generated); run" \
    "scripts/check-bindings.sh --write" >&2
  exit 1
fi
echo "check-bindings: passed"
