#!/usr/bin/env bash
# Runs the issue-18 regression cases, written against the API of the commit before the
# fixes (0f820a1: no CallMismatch, no waiting_for), on that commit's host backend, to see
# which fail there. Output: the test harness's report.
set -euo pipefail
cd "$(dirname "$0")/../.."
BEFORE=${BEFORE:-0f820a1}
dir=/tmp/pc-trust-before
[ -d "$dir" ] || git worktree add -q --detach "$dir" "$BEFORE"
cp scripts/trust-before/trust_before.rs "$dir/tests/"
python3 - "$dir/Cargo.toml" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
if 'features = ["thread"]' not in s:
    s = s.replace("[target.'cfg(loom)'.dev-dependencies]",
                  "[target.'cfg(target_os = \"linux\")'.dev-dependencies]\n"
                  "rustix = { version = \"1\", features = [\"thread\"] }\n\n"
                  "[target.'cfg(loom)'.dev-dependencies]")
    open(p, "w").write(s)
PY
cd "$dir" && cargo test --release --test trust_before -- --test-threads 1
