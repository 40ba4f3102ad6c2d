#!/usr/bin/env python3
"""Compare two `fp4moe bench --json` files row by row (an A/B of two builds or two tactic sets).

For every (model, mode, T) present in both files: the base and other median layer times, their ratio
(other / base: below 1 is faster), both tactics, and with --stages the ratio of every stage time.
Then a summary: rows faster / slower by more than --noise (default 2%), the geometric-mean ratio and
the summed times; with --stages also each stage's geometric-mean ratio over the rows, marked "!" where
it lies outside the noise (a stage that moved on every row, while the layer times hide it in the
board's noise: the separate finalize's 1.381 over the w4a16 rows of the d5cad21 table against
2d397f7's). Rows present in only one file are listed and not compared.

  bench/compare.py BASE_JSON OTHER_JSON [--stages] [--noise PCT]

Exit status 0; 2 for a missing or row-less file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


def load(path):
    try:
        with open(path) as f:
            rows = json.load(f).get("rows", [])
    except (OSError, ValueError) as e:
        print(f"compare.py: cannot read {path}: {e}", file=sys.stderr)
        sys.exit(2)
    if not rows:
        print(f"compare.py: {path} has no rows", file=sys.stderr)
        sys.exit(2)
    return {(r["model"], r["mode"], r["tokens"]): r for r in rows}


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("other")
    ap.add_argument("--stages", action="store_true", help="also compare the per-stage times")
    ap.add_argument("--noise", type=float, default=2.0, help="percent within which a row counts as equal")
    a = ap.parse_args(argv[1:])
    base, other = load(a.base), load(a.other)
    common = [k for k in base if k in other]
    print(f"{'model':18s} {'mode':12s} {'T':>6s} {'base us':>10s} {'other us':>10s} {'ratio':>6s}  tactic base -> other")
    faster = slower = 0
    log_sum = 0.0
    stage_logs = {}  # stage -> [log(other / base)] over the rows that have it in both files
    tot_b = tot_o = 0.0
    for k in common:
        rb, ro = base[k], other[k]
        ratio = ro["median_us"] / rb["median_us"]
        log_sum += math.log(ratio)
        tot_b += rb["median_us"]
        tot_o += ro["median_us"]
        if ratio < 1 - a.noise / 100:
            faster += 1
        elif ratio > 1 + a.noise / 100:
            slower += 1
        tactic = rb["tactic"] if rb["tactic"] == ro["tactic"] else f"{rb['tactic']} -> {ro['tactic']}"
        line = f"{k[0]:18s} {k[1]:12s} {k[2]:6d} {rb['median_us']:10.1f} {ro['median_us']:10.1f} {ratio:6.3f}  {tactic}"
        if a.stages:
            sb, so = rb.get("stages_us", {}), ro.get("stages_us", {})
            stages = [s for s in sb if s in so and sb[s] > 0 and so[s] > 0]
            for s in stages:
                stage_logs.setdefault(s, []).append(math.log(so[s] / sb[s]))
            line += "   stages: " + ", ".join(f"{s} {so[s] / sb[s]:.2f}" for s in stages)
        print(line)
    for name, only in (("base", [k for k in base if k not in other]), ("other", [k for k in other if k not in base])):
        for k in only:
            print(f"only in {name}: {k[0]} {k[1]} T={k[2]}")
    if common:
        n = len(common)
        print(f"{n} rows: {faster} faster, {slower} slower, {n - faster - slower} within {a.noise:g}%; "
              f"geomean ratio {math.exp(log_sum / n):.3f}; sum {tot_b:.1f} -> {tot_o:.1f} us")
    if stage_logs:
        parts = []
        for s, logs in stage_logs.items():
            g = math.exp(sum(logs) / len(logs))
            mark = "!" if abs(g - 1) > a.noise / 100 else ""
            parts.append(f"{s} {g:.3f}{mark}")
        print(f"stage geomean ratios ('!': beyond {a.noise:g}%): " + ", ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
