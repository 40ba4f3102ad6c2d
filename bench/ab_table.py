#!/usr/bin/env python3
"""The rows of a `scripts/bench-ab` run as one Markdown table, every variant beside the base.

Reads OUTPUT_DIR/bench-<variant>-<mode>.json (the base's and each variant's `fp4moe bench --json`) and
prints, per mode, one row per (model, T) present in the base: the base's median layer time, then per
variant its time, its ratio to the base and the GEMM stages' ratios ("g1 0.97 g2 0.99"; --stages
STAGE[,STAGE] picks others), and a last row with each variant's geometric-mean ratio over the rows
it has. Variants come in the order of summary.txt's "== bench" lines, else by name; `base-again`
(scripts/bench-ab --rebase) is a variant like the others: its ratios are the run's drift.

  bench/ab_table.py OUTPUT_DIR [--mode MODE] [--stages gemm1,gemm2]

Exit status 0; 2 when the folder has no base table.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys


def load_rows(path):
    with open(path) as f:
        return {(r["model"], r["tokens"]): r for r in json.load(f).get("rows", [])}


def variant_order(out_dir, mode, found):
    order = []
    summary = os.path.join(out_dir, "summary.txt")
    if os.path.exists(summary):
        with open(summary) as f:
            for line in f:
                m = re.match(r"== bench (\S+) (\S+)$", line.strip())
                if m and m.group(2) == mode and m.group(1) in found and m.group(1) not in order:
                    order.append(m.group(1))
    return order + sorted(v for v in found if v not in order)


def table(out_dir, mode, stages):
    base_path = os.path.join(out_dir, f"bench-base-{mode}.json")
    base = load_rows(base_path)
    prefix, suffix = os.path.join(out_dir, "bench-"), f"-{mode}.json"
    found = [p[len(prefix):-len(suffix)] for p in glob.glob(prefix + "*" + suffix)]
    variants = [v for v in variant_order(out_dir, mode, found) if v != "base"]
    tables = {v: load_rows(os.path.join(out_dir, f"bench-{v}-{mode}.json")) for v in variants}
    short = {"gemm1": "g1", "gemm2": "g2", "finalize": "fin", "route": "rt", "permute": "perm", "quantize": "q"}
    lines = [f"{mode}: layer us (ratio to base) [stage ratios]", "",
             "| preset | T | base | " + " | ".join(variants) + " |",
             "|---|---|---|" + "---|" * len(variants)]
    logs = {v: [] for v in variants}
    for key in sorted(base, key=lambda k: (k[0], k[1])):
        rb = base[key]
        cells = []
        for v in variants:
            ro = tables[v].get(key)
            if ro is None:
                cells.append("-")
                continue
            ratio = ro["median_us"] / rb["median_us"]
            logs[v].append(math.log(ratio))
            sb, so = rb.get("stages_us", {}), ro.get("stages_us", {})
            parts = [f"{short.get(s, s)} {so[s] / sb[s]:.2f}" for s in stages if sb.get(s, 0) > 0 and so.get(s, 0) > 0]
            cells.append(f"{ro['median_us']:.1f} ({ratio:.3f})" + (f" [{' '.join(parts)}]" if parts else ""))
        lines.append(f"| {key[0]} | {key[1]} | {rb['median_us']:.1f} | " + " | ".join(cells) + " |")
    geo = [f"**{math.exp(sum(l) / len(l)):.3f}**" if l else "-" for l in logs.values()]
    lines.append("| geomean | | | " + " | ".join(geo) + " |")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--mode", help="one mode (default: every mode with a base table)")
    ap.add_argument("--stages", default="gemm1,gemm2", help="stages whose ratios follow each cell")
    a = ap.parse_args(argv[1:])
    modes = [a.mode] if a.mode else sorted(
        p[len(os.path.join(a.out_dir, "bench-base-")):-len(".json")]
        for p in glob.glob(os.path.join(a.out_dir, "bench-base-*.json")))
    modes = [m for m in modes if not m.startswith("again-")]  # bench-base-again-<mode>.json is a variant
    if not modes:
        print(f"ab_table.py: no bench-base-<mode>.json in {a.out_dir}", file=sys.stderr)
        return 2
    stages = [s for s in a.stages.split(",") if s]
    print("\n\n".join(table(a.out_dir, m, stages) for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
