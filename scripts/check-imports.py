#!/usr/bin/env python3
"""Imports that point one way: checks the import graph of the crate's modules.

Usage: python3 scripts/check-imports.py [--strict-files] [--graph]

Reads every module of the crate, following the `mod` declarations from src/lib.rs
(a file under src/ that no declaration reaches, such as a test module or a file that
is include!d, is listed as a note), and builds the graph of imports between the
top-level modules (`backend`, `comm`, ...). It fails (exit status 1) on:

  (a) a cycle between top-level modules;
  (b) an import against LAYERS below: a module may import only modules of a lower
      layer (none of its own layer), except for the edges listed in EXCEPTIONS;
  (c) with `--strict-files` only: a cycle between the files of src/comm/ or of
      src/backend/ (a file's module and the inline modules in it are one node).
      Without the flag these cycles are printed as warnings;
  (d) an item defined in src/lib.rs: the crate root only declares modules and
      re-exports (so that no module reaches "up" into the root for a helper).

`--graph` prints every edge between top-level modules with the places that make it.

What counts as an import: every path of a `use` (groups, `self`, globs and renames
included), and every path in the code that starts with `crate::`, `$crate::`,
`super::`, `self::` or with the name of a child module or of a name that a `use` of
the same module brought in. A path is followed through `use` declarations (re-exports
at the crate root and in `mod.rs` files included) to the module that defines the item,
so `crate::Error` is an import of `error`, not of the root. Paths into other crates
(`std::`, `cudarc::`) and paths through generic parameters or `Self` are not imports.

The parser is a small tokenizer, not a Rust parser: comments (doc comments included)
and string and character literals are dropped first, then items behind `#[cfg(test)]`
or `#[cfg(all(test, ...))]` (test modules, inline or in their own file, and single
test-only items) are skipped. Every feature's code counts (`#[cfg(feature = ...)]` is
not evaluated), so the graph is the union over all builds. Standard library only.
"""

import os
import re
import sys
from collections import defaultdict

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
SRC = os.path.join(ROOT, "src")

# The layers, top to bottom. A module imports only modules of the layers below its own;
# the modules of one layer import nothing of each other. The crate docs (src/lib.rs)
# draw the same picture.
#
#   unstable   the internals re-exported for the crate's own tests (feature `unstable`)
#   comm       the communicators: planning, launching, routing, capture, the per-rank API
#   external   the external libraries (NCCL, RCCL, the host stand-in), each with the
#              backend it serves (external::HasExternalLibrary)
#   tensor     shaped views over a backend's buffers
#   os         operating-system plumbing (the descriptor channel between processes)
#   backend    the vendor trait, the host, CUDA and HIP backends, peer access and the
#              initialisation of signal buffers through a backend
#   dispatch   the dispatch table: data (algorithm per architecture, width and size)
#   protocol   the host model of the signal protocol (barriers, backoff)
#   signal     the signal layout, the kernels' argument block, the pure protocol helpers
#   error      the crate's error enum
#   dtype      element types
#   bootstrap  rendezvous between processes. Self-contained: it imports nothing of the
#              crate (it has its own error type, BootstrapError), so it sits at the
#              bottom; `error` wraps BootstrapError in Error::Bootstrap as it would a
#              std error, and `external` and `comm` use bootstrap from above.
LAYERS = [
    ["unstable"],
    ["comm"],
    ["external", "tensor", "os"],
    ["backend"],
    ["device"],
    ["dispatch", "protocol"],
    ["signal"],
    ["error"],
    ["dtype", "bootstrap"],
]

# Imports allowed against LAYERS, each with the reason: (from, to, reason). None is
# needed today; an entry that no import needs any more is itself an error.
EXCEPTIONS = []

# Top-level modules whose files are checked for cycles between them.
FILE_CYCLE_MODULES = ("comm", "backend")


# ---------------------------------------------------------------- tokenizer


IDENT_START = re.compile(r"[A-Za-z_]")
IDENT_CHAR = re.compile(r"[A-Za-z0-9_]")


def tokenize(text):
    """Tokens (kind, value, line) with comments and literals dropped. kinds: 'id'
    (identifiers, keywords, numbers), 'p' (punctuation; `::` is one token)."""
    toks = []
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif c == '"':
            i += 1
            while i < n and text[i] != '"':
                if text[i] == "\\":
                    i += 1
                line += i < n and text[i] == "\n"
                i += 1
            i += 1
        elif c == "'":
            # A character literal ('x', '\n', '\u{..}') or a lifetime ('a): dropped.
            if i + 1 < n and text[i + 1] == "\\":
                j = text.find("'", i + 3)  # after the escaped character
                i = n if j < 0 else j + 1
            elif i + 2 < n and text[i + 2] == "'":
                i += 3
            else:
                i += 1
                while i < n and IDENT_CHAR.match(text[i]):
                    i += 1
        elif IDENT_START.match(c) or c.isdigit():
            j = i
            while j < n and IDENT_CHAR.match(text[j]):
                j += 1
            word = text[i:j]
            # Raw strings: r"..", r#".."#, br#".."#.
            if word in ("r", "br", "cr") and j < n and text[j] in '"#':
                k = j
                while k < n and text[k] == "#":
                    k += 1
                if k < n and text[k] == '"':
                    end = '"' + "#" * (k - j)
                    e = text.find(end, k + 1)
                    e = n if e < 0 else e + len(end)
                    line += text.count("\n", i, e)
                    i = e
                    continue
                if word == "r" and k == j + 1 and k < n and IDENT_START.match(text[k]):
                    j = k  # a raw identifier: r#type
                    while j < n and IDENT_CHAR.match(text[j]):
                        j += 1
                    toks.append(("id", text[k:j], line))
                    i = j
                    continue
            if word in ("b", "c") and j < n and text[j] in "\"'":
                i = j  # byte and C strings: the literal follows
                continue
            toks.append(("id", word, line))
            i = j
        elif text.startswith("::", i):
            toks.append(("p", "::", line))
            i += 2
        else:
            toks.append(("p", c, line))
            i += 1
    return toks


# ---------------------------------------------------------------- parser


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names; () is the crate root
        self.file = file  # the file that defines it (inline modules: their file's)
        self.file_module = path  # the module of that file
        self.children = {}  # name -> "file" (`mod name;`) or "inline" (`mod name { .. }`)
        self.uses = {}  # name -> (segments, line): what a `use` brought in
        self.globs = []  # (segments, line): `use path::*`
        self.items = set()  # names defined here
        self.refs = []  # (segments, line, file, module of that file): every path


def is_test_cfg(attr):
    """Whether an attribute's tokens are cfg(test) or cfg(all(.., test, ..))."""
    v = [t[1] for t in attr]
    if v[:4] == ["cfg", "(", "test", ")"]:
        return True
    if v[:4] == ["cfg", "(", "all", "("]:
        depth = 0
        for t in v[3:]:
            if t == "(":
                depth += 1
            elif t == ")":
                depth -= 1
            elif depth == 1 and t == "test":
                return True
    return False


def skip_item(toks, i):
    """Index after the item starting at toks[i] (an item behind a test-only cfg)."""
    depth = 0
    n = len(toks)
    while i < n:
        v = toks[i][1] if toks[i][0] == "p" else None
        if v in ("(", "[", "{"):
            depth += 1
            if v == "{" and depth == 1:
                # The item's block: it ends with its closing brace.
                j = i + 1
                while j < n and depth:
                    w = toks[j][1] if toks[j][0] == "p" else None
                    depth += w in ("(", "[", "{")
                    depth -= w in (")", "]", "}")
                    j += 1
                return j
        elif v in (")", "]", "}"):
            if depth == 0:
                return i  # the enclosing block ends: not ours to take
            depth -= 1
        elif v in (";", ",") and depth == 0:
            return i + 1
        i += 1
    return i


def parse_use_tree(toks, i, prefix, out):
    """Parses a use tree at toks[i]; appends (segments, alias, glob) to out; returns
    the index after it."""
    segs = list(prefix)
    n = len(toks)
    if i < n and toks[i][1] == "::":
        segs.append("::")  # a path into another crate (leading ::)
        i += 1
    while i < n:
        kind, v, _ = toks[i]
        if v == "{":
            i += 1
            while i < n and toks[i][1] != "}":
                i = parse_use_tree(toks, i, segs, out)
                if i < n and toks[i][1] == ",":
                    i += 1
            return i + 1
        if v == "*":
            out.append((segs, None, True))
            return i + 1
        if kind == "id":
            segs.append("$crate" if v == "crate" and i > 0 and toks[i - 1][1] == "$" else v)
            i += 1
            if i < n and toks[i][1] == "::":
                i += 1
                continue
            alias = None
            if i + 1 < n and toks[i][1] == "as":
                alias = toks[i + 1][1]
                i += 2
            if segs[-1] == "self":
                segs = segs[:-1]
                name = alias or (segs[-1] if segs else None)
            else:
                name = alias or segs[-1]
            out.append((segs, None if name == "_" else name, False))
            return i
        if v == "$":
            i += 1
            continue
        return i
    return i


ITEM_KEYWORDS = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}


def parse_file(path, file, modules, problems):
    """Parses one file as module `path`; registers it and its inline modules."""
    with open(file, encoding="utf-8") as f:
        toks = tokenize(f.read())
    mod = Module(path, file)
    earlier = modules.get(path)
    if earlier is not None:
        # The same module inline under another cfg (`#[cfg(not(..))] mod shm { .. }`
        # beside `mod shm;`): one module, whose paths keep their own places.
        for name in ("children", "uses"):
            getattr(mod, name).update(getattr(earlier, name))
        mod.globs += earlier.globs
        mod.items |= earlier.items
        mod.refs += earlier.refs
    modules[path] = mod
    stack = [(mod, 0)]  # (module, brace depth its block opened at)
    depth = 0
    pending_test = False
    i, n = 0, len(toks)
    while i < n:
        kind, v, line = toks[i]
        cur = stack[-1][0]
        prev = toks[i - 1][1] if i else None
        if v == "#" and kind == "p":
            j = i + 1
            inner = j < n and toks[j][1] == "!"
            j += inner
            if j < n and toks[j][1] == "[":
                k, d = j + 1, 1
                while k < n and d:
                    d += toks[k][1] == "["
                    d -= toks[k][1] == "]"
                    k += 1
                attr = toks[j + 1 : k - 1]
                if is_test_cfg(attr):
                    if inner:
                        if depth == 0 and len(stack) == 1:
                            del modules[path]  # the whole file is test-only
                            return
                    else:
                        pending_test = True
                i = k
                continue
        if pending_test:
            pending_test = False
            i = skip_item(toks, i)
            continue
        if kind == "id" and v == "mod" and prev != "::" and i + 2 < n and toks[i + 1][0] == "id":
            name, after = toks[i + 1][1], toks[i + 2][1]
            if after == ";":
                cur.children[name] = "file"
                i += 3
                continue
            if after == "{":
                child = Module(cur.path + (name,), file)
                child.file_module = mod.path
                cur.children.setdefault(name, "inline")  # a file under another cfg wins
                if child.path in modules:  # the same module under another cfg
                    child = modules[child.path]
                modules[child.path] = child
                depth += 1
                stack.append((child, depth))
                i += 3
                continue
        if kind == "id" and v == "use" and prev not in ("::", "."):
            out = []
            j = parse_use_tree(toks, i + 1, [], out)
            for segs, name, glob in out:
                if segs and segs[0] == "::":
                    continue
                if glob:
                    cur.globs.append((segs, line))
                elif name:
                    cur.uses[name] = (segs, line)
                cur.refs.append((segs, line, file, mod.path))
            while j < n and toks[j][1] != ";":
                j += 1
            i = j + 1
            continue
        if kind == "id" and v in ITEM_KEYWORDS and i + 1 < n and toks[i + 1][0] == "id":
            cur.items.add(toks[i + 1][1])
        if kind == "id" and v == "macro_rules" and i + 2 < n and toks[i + 1][1] == "!":
            cur.items.add(toks[i + 2][1])
        if v == "{" and kind == "p":
            depth += 1
        elif v == "}" and kind == "p":
            depth -= 1
            while len(stack) > 1 and stack[-1][1] > depth:
                stack.pop()
        elif kind == "id" and prev not in ("::", ".") and i + 2 < n and toks[i + 1][1] == "::":
            # A path: crate::a::b, super::x, self::y, name::z.
            segs = ["$crate" if v == "crate" and prev == "$" else v]
            j = i + 1
            while j + 1 < n and toks[j][1] == "::" and toks[j + 1][0] == "id":
                segs.append(toks[j + 1][1])
                j += 2
            if len(segs) > 1:
                cur.refs.append((segs, line, file, mod.path))
            i = j
            continue
        i += 1

    # Child modules declared in this file (and its inline modules) with their files.
    base = os.path.dirname(file)
    stem = os.path.splitext(os.path.basename(file))[0]
    if stem not in ("mod", "lib"):
        base = os.path.join(base, stem)
    for m in [m for m in modules.values() if m.file == file]:
        sub = os.path.join(base, *m.path[len(path) :])
        for name, how in m.children.items():
            if how != "file":
                continue
            cands = [os.path.join(sub, name + ".rs"), os.path.join(sub, name, "mod.rs")]
            found = [c for c in cands if os.path.exists(c)]
            if not found:
                problems.append(f"{rel(file)}: mod {name}; has no file ({rel(cands[0])})")
                continue
            parse_file(m.path + (name,), found[0], modules, problems)


def rel(p):
    return os.path.relpath(p, ROOT)


# ---------------------------------------------------------------- resolution


def resolve(modules, mpath, segs, seen=None):
    """The module that defines what `segs` (written in module `mpath`) names, or None
    for another crate's path, a generic parameter and the like."""
    seen = set() if seen is None else seen
    key = (mpath, tuple(segs))
    if key in seen:
        return None
    seen.add(key)
    segs = list(segs)
    head = segs[0]
    if head in ("crate", "$crate"):
        cur, rest = (), segs[1:]
    elif head == "self":
        cur, rest = mpath, segs[1:]
    elif head == "super":
        cur = mpath
        while segs and segs[0] == "super":
            cur = cur[:-1]
            segs = segs[1:]
        rest = segs
    else:
        cur, rest = mpath, segs
        m = modules.get(cur)
        if m is None:
            return None
        if not (head in m.children or head in m.uses or head in m.items or m.globs):
            return None  # std::, cudarc::, B::, Self::
    return walk(modules, cur, rest, seen)


def walk(modules, cur, rest, seen):
    while rest:
        m = modules.get(cur)
        if m is None:
            return cur
        name = rest[0]
        if name in m.children and cur + (name,) in modules:
            cur, rest = cur + (name,), rest[1:]
            continue
        if name in m.uses:
            target = m.uses[name][0]
            r = resolve(modules, cur, target + rest[1:], seen)
            return r if r is not None else cur
        if name not in m.items:
            for gsegs, _ in m.globs:
                g = resolve(modules, cur, gsegs, seen)
                gm = modules.get(g) if g is not None else None
                if gm and (name in gm.items or name in gm.uses or name in gm.children):
                    return walk(modules, g, rest, seen)
        return cur
    return cur


def top(path):
    return path[0] if path else "(crate root)"


def sccs(nodes, edges):
    """Tarjan's strongly connected components of more than one node."""
    index, low, on, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def a_cycle(comp, edges):
    """One cycle through the smallest node of a strongly connected component (a
    shortest one, breadth first), as a list of nodes that ends where it starts."""
    comp = set(comp)
    start = min(comp)
    prev = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w not in comp:
                    continue
                if w == start:
                    cyc = [v]
                    while prev[cyc[-1]] is not None:
                        cyc.append(prev[cyc[-1]])
                    return list(reversed(cyc)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


# ---------------------------------------------------------------- checks


def main(argv):
    strict_files = "--strict-files" in argv
    show_graph = "--graph" in argv
    unknown = [a for a in argv if a not in ("--strict-files", "--graph")]
    if unknown:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    modules, problems = {}, []
    parse_file((), os.path.join(SRC, "lib.rs"), modules, problems)
    failures = list(problems)
    notes = []

    reached = {os.path.normpath(m.file) for m in modules.values()}
    for d, _, files in os.walk(SRC):
        for f in sorted(files):
            p = os.path.normpath(os.path.join(d, f))
            if f.endswith(".rs") and p not in reached:
                notes.append(f"not a module of the crate (test-only or include!d): {rel(p)}")

    tops = sorted({m.path[0] for m in modules.values() if m.path})
    layer_of = {}
    for k, layer in enumerate(LAYERS):
        for name in layer:
            layer_of[name] = k
    for t in tops:
        if t not in layer_of:
            failures.append(f"module `{t}` is in no layer: add it to LAYERS in {rel(__file__)}")
    for t in layer_of:
        if t not in tops:
            failures.append(f"LAYERS names `{t}`, which is no module of the crate")

    # Edges: module -> module, and file -> file (by the modules of the files), with
    # the places that make them.
    edges = defaultdict(lambda: defaultdict(list))
    file_edges = defaultdict(lambda: defaultdict(list))
    for m in modules.values():
        for segs, line, file, file_module in m.refs:
            target = resolve(modules, m.path, segs)
            if target is None or target == m.path:
                continue
            place = f"{rel(file)}:{line}"
            if place not in edges[m.path][target]:
                edges[m.path][target].append(place)
            to_file = modules[target].file_module if target in modules else target
            if to_file != file_module and place not in file_edges[file_module][to_file]:
                file_edges[file_module][to_file].append(place)

    # (d) The crate root defines nothing.
    root = modules[()]
    for name in sorted(root.items):
        failures.append(
            f"src/lib.rs defines `{name}`: the crate root only declares modules and "
            "re-exports; move it to the module that owns it"
        )
    for src, targets in edges.items():
        if src and () in targets:
            for place in targets[()]:
                failures.append(f"{place}: `{top(src)}` takes an item defined in src/lib.rs")

    # Top-level graph.
    top_edges = defaultdict(lambda: defaultdict(list))
    for src, targets in edges.items():
        for dst, places in targets.items():
            a, b = top(src), top(dst)
            if src and dst and a != b:
                top_edges[a][b].extend(p for p in places if p not in top_edges[a][b])
    if show_graph:
        print("imports between top-level modules:")
        for a in sorted(top_edges):
            for b in sorted(top_edges[a]):
                places = top_edges[a][b]
                more = f" (+{len(places) - 3})" if len(places) > 3 else ""
                print(f"  {a} -> {b}: {', '.join(places[:3])}{more}")

    # (a) Cycles between top-level modules.
    for comp in sccs(tops, {a: set(bs) for a, bs in top_edges.items()}):
        cyc = a_cycle(comp, top_edges)
        hops = [f"{x} -> {y} ({top_edges[x][y][0]})" for x, y in zip(cyc, cyc[1:])]
        failures.append(
            f"cycle between top-level modules ({', '.join(comp)}), for one: " + "; ".join(hops)
        )

    # (b) The layer order.
    allowed = {(a, b) for a, b, _ in EXCEPTIONS}
    for a, bs in sorted(top_edges.items()):
        for b, places in sorted(bs.items()):
            if a not in layer_of or b not in layer_of:
                continue
            if layer_of[b] <= layer_of[a] and (a, b) not in allowed:
                how = "within one layer" if layer_of[a] == layer_of[b] else "upwards"
                failures.append(
                    f"`{a}` imports `{b}` ({how} in LAYERS): " + ", ".join(places)
                )
    for a, b, _ in EXCEPTIONS:
        if b not in top_edges.get(a, {}):
            failures.append(f"EXCEPTIONS lists {a} -> {b}, which no import needs now")

    # (c) Cycles between files inside the modules checked per file.
    file_failures = []
    for t in FILE_CYCLE_MODULES:
        fedges = {
            a: {b: places for b, places in bs.items() if top(b) == t}
            for a, bs in file_edges.items()
            if top(a) == t
        }
        nodes = {m.file_module for m in modules.values() if top(m.path) == t}
        for comp in sccs(nodes, {a: set(bs) for a, bs in fedges.items()}):
            cyc = a_cycle(comp, fedges)
            hops = [
                f"{'::'.join(x)} -> {'::'.join(y)} ({fedges[x][y][0]})"
                for x, y in zip(cyc, cyc[1:])
            ]
            names = ", ".join("::".join(c) for c in comp)
            file_failures.append(f"cycle between files of `{t}` ({names}): " + "; ".join(hops))

    for note in notes:
        print("note:", note)
    for f in file_failures:
        print(("error: " if strict_files else "warning: ") + f)
    for f in failures:
        print("error:", f)
    if strict_files:
        failures += file_failures
    if failures:
        print(f"check-imports: {len(failures)} problem(s)")
        return 1
    order = " > ".join("{" + ", ".join(l) + "}" if len(l) > 1 else l[0] for l in LAYERS)
    print(
        f"check-imports: {len(modules)} modules, no cycle between top-level modules, "
        f"layers {order}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
