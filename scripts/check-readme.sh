#!/usr/bin/env bash
# The README's code is code that compiles: every ```rust block of README.md must be a
# doctest of the crate docs (src/lib.rs, run by `cargo test --release --doc`) with its
# hidden lines left out, and every line of the ```diff block (the switch from cudarc's
# NCCL) must be a line of examples/from-nccl.rs (built by clippy with `--features cuda`).
# Blocks marked `rust,ignore` are excerpts and say where they come from. Also checks that
# the README starts with the two commands of the task card, and that its relative links
# point at files the package ships (Cargo.toml's `include`): crates.io renders the packaged
# README, so anything else is an absolute link.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 - <<'EOF'
import re, sys

readme = open("README.md").read()
lines = readme.splitlines()
want_first = [
    "- Run (the benchmark; on the host reference backend when there is no GPU): `cargo run --release --example peercomm-bench`",
    "- Test: `cargo test --release`",
]
if lines[2:4] != want_first:
    sys.exit("check-readme: README.md must start with the run and test commands")

def doctests(path):
    """The ``` blocks of the //! docs of `path`, hidden (`# `) lines dropped."""
    out, block = [], None
    for line in open(path).read().splitlines():
        if not line.startswith("//!"):
            continue
        text = line[4:] if line.startswith("//! ") else line[3:]
        if text.startswith("```"):
            if block is None:
                block = []
            else:
                out.append("\n".join(block))
                block = None
        elif block is not None and not text.lstrip().startswith("# ") and text.strip() != "#":
            block.append(text)
    return out

docs = doctests("src/lib.rs")
example = {l.strip() for l in open("examples/from-nccl.rs").read().splitlines()}
failed = False
for m in re.finditer(r"^```(\S*)\n(.*?)^```", readme, re.S | re.M):
    kind, body = m.group(1), m.group(2).rstrip("\n")
    line = readme[: m.start()].count("\n") + 1
    if kind == "rust":
        if body not in docs:
            print(f"check-readme: README.md:{line}: this rust block is not a doctest of src/lib.rs")
            failed = True
    elif kind == "diff":
        for l in body.splitlines():
            code = l[1:].strip() if l[:1] in "+- " else l.strip()
            if code and code not in example:
                print(f"check-readme: README.md:{line}: `{code}` is not a line of examples/from-nccl.rs")
                failed = True
shipped = re.findall(r'^\s*"/([^"]+)",?\s*$', open("Cargo.toml").read().split("include = [", 1)[1].split("]", 1)[0], re.M)
for m in re.finditer(r"\]\(([^)\s]+)\)", readme):
    target = m.group(1).split("#", 1)[0]
    if not target or re.match(r"[a-z]+:", target):
        continue
    if not any(target == p or (p.endswith("/**") and target.startswith(p[:-2])) for p in shipped):
        line = readme[: m.start()].count("\n") + 1
        print(f"check-readme: README.md:{line}: `{target}` is not shipped by the package (link it absolutely)")
        failed = True
if failed:
    sys.exit(1)
print(f"check-readme: passed ({len(docs)} crate doctests, README blocks found in them)")
EOF
