#!/usr/bin/env python3
"""The zero-copy comparison of a `peercomm-bench --per-rank N --with-single` results.json
as a Markdown table: per size and mode, the single controller (peercomm-auto), the
per-rank staged path, the per-rank symmetric path, and (graph mode) the staged path's
plain buffers captured registered (`Comm::capture_registered`), with the ratios to single.
Usage: scripts/zero-copy-table.py results.json [mode ...]"""
import json, sys

def human(b):
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            v = b / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{b} B"

report = json.load(open(sys.argv[1]))
modes = sys.argv[2:] or ["graph", "eager"]
rows = {}
for r in report["records"]:
    rows[(r["mode"], r["bytes"], r["implementation"])] = r
names = {
    "single": "peercomm-auto",
    "staged": next((i for (_, _, i) in rows if i.startswith("peercomm-per-rank-") and not i.endswith(("symmetric", "registered"))), None),
    "symmetric": next((i for (_, _, i) in rows if i.endswith("-symmetric")), None),
}
registered = next((i for (_, _, i) in rows if i.endswith("-registered")), None)
world = report["records"][0]["world"]
print(f"world {world}, {report.get('api', '')}, {', '.join(report.get('devices', [])[:1])}")
print("| mode | bytes per rank | single controller | per rank, staged | per rank, symmetric | symmetric / single | staged / single | registered capture / single |")
print("|---|---|---|---|---|---|---|---|")
for mode in modes:
    for b in sorted({b for (m, b, _) in rows if m == mode}):
        got = {k: rows.get((mode, b, n)) for k, n in names.items()}
        if not all(got.values()):
            continue
        s, st, sy = (got[k]["latency_us"] for k in ("single", "staged", "symmetric"))
        alg = lambda k: got[k]["algorithm"].replace("_", "-")
        reg = rows.get((mode, b, registered)) if registered else None
        reg_text = f"{reg['latency_us'] / s:.2f} ({reg['algorithm'].replace('_', '-')})" if reg else "-"
        print(f"| {mode} | {human(b)} | {s:.2f} us ({alg('single')}) | {st:.2f} us ({alg('staged')}) | {sy:.2f} us ({alg('symmetric')}) | {sy / s:.2f} | {st / s:.2f} | {reg_text} |")
