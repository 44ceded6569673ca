#!/usr/bin/env bash
# Fails when a package's `rust-version` is below what its dependencies need: the highest
# `rust-version` over every package the library builds with (normal and build
# dependencies, transitively, with all features on, for every target platform; dev
# dependencies are not counted), as locked in Cargo.lock.
#
#   bash scripts/check-msrv.sh [MANIFEST...]   (default: ./Cargo.toml)
#
# This bounds the MSRV from below; the crate's own use of the standard library is
# checked by clippy's `incompatible_msrv` lint (on by default) against the same field.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -gt 0 ] || set -- Cargo.toml

meta=$(mktemp)
trap 'rm -f "$meta"' EXIT
status=0
for manifest in "$@"; do
  cargo metadata --format-version 1 --all-features --manifest-path "$manifest" >"$meta"
  python3 - "$meta" <<'PY' || status=1
import json, sys

def version(v):  # "1.88" and "1.88.0" compare equal
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

def show(v):
    return ".".join(map(str, v[:2] if v[2] == 0 else v))

m = json.load(open(sys.argv[1]))
packages = {p["id"]: p for p in m["packages"]}
nodes = {n["id"]: n for n in m["resolve"]["nodes"]}
root = m["resolve"]["root"]
seen, stack = set(), [root]
while stack:
    for dep in nodes[stack.pop()]["deps"]:
        if any(k["kind"] in (None, "build") for k in dep["dep_kinds"]) and dep["pkg"] not in seen:
            seen.add(dep["pkg"])
            stack.append(dep["pkg"])
needs = sorted(
    (
        (version(packages[i]["rust_version"]), packages[i]["name"], packages[i]["version"])
        for i in seen
        if packages[i].get("rust_version")
    ),
    reverse=True,
)
name, manifest = packages[root]["name"], packages[root]["manifest_path"]
declared = packages[root].get("rust_version")
if not needs:
    print(f"check-msrv: {name}: no dependency declares a rust-version")
    sys.exit(0)
top = needs[0][0]
heaviest = ", ".join(f"{n} {v} needs {show(r)}" for r, n, v in needs[:3])
if declared is None or version(declared) < top:
    print(
        f"check-msrv: {name}: rust-version is {declared}, below what its dependencies need "
        f"({heaviest}): set rust-version = \"{show(top)}\" in {manifest}"
    )
    sys.exit(1)
print(f"check-msrv: {name}: rust-version {declared} covers its dependencies ({heaviest})")
PY
done
exit $status
