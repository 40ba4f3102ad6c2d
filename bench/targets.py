#!/usr/bin/env python3
"""Check `fp4moe bench --json` rows against the speed targets of the decode and prefill work.

  decode  (T <= 256):          layer median <= 1.15 x floor + 8 us
  prefill (T in 4096..16384):  whole-layer TFLOP/s >= 600 (stretch 650)
  prefill (T in 512..2048):    TFLOP/s >= 450 or median <= 1.3 x floor, whichever is easier

Prints one line per row (model, mode, T, hit, median, floor, the row's figure, target, PASS/MISS) and a
count per target. Exit status 0 always: a miss is data for the perf log, not an error; a file without
rows is an error (status 2).

  bench/targets.py BENCH_JSON [BENCH_JSON ...]
"""

from __future__ import annotations

import json
import sys

# The targets' numbers (bench/plot_targets.py draws the same lines).
DECODE_MAX_T, DECODE_RATIO, DECODE_SLACK_US = 256, 1.15, 8.0  # median <= 1.15 x floor + 8 us
PREFILL_MIN_T, PREFILL_TF = 4096, 600.0                       # TFLOP/s from T = 4096
MID_MIN_T, MID_TF, MID_RATIO = 512, 450.0, 1.3                 # T = 512..2048: 450 TF or 1.3 x floor


def classify(row):
    T = row["tokens"]
    if T <= DECODE_MAX_T:
        limit = DECODE_RATIO * row["floor_us"] + DECODE_SLACK_US
        ok = row["median_us"] <= limit
        return "decode", f"ratio {row['median_us'] / row['floor_us']:5.2f}", f"<= {limit:8.1f} us", ok
    if T >= PREFILL_MIN_T:
        return "prefill", f"{row['tflops']:6.1f} TF", f">= {PREFILL_TF:.0f} TF", row["tflops"] >= PREFILL_TF
    if T >= MID_MIN_T:
        ok = row["tflops"] >= MID_TF or row["median_us"] <= MID_RATIO * row["floor_us"]
        return "mid", f"{row['tflops']:6.1f} TF, {row['median_us'] / row['floor_us']:4.2f}x floor", \
            f">= {MID_TF:.0f} TF or <= {MID_RATIO}x", ok
    return None


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    rows, flushes = [], set()
    for path in argv[1:]:
        with open(path) as f:
            data = json.load(f)
        rows += data.get("rows", [])
        flushes.add(data.get("l2_flush", "write"))  # a file without the key was written with the memset flush
    if not rows:
        print("targets.py: no rows in " + ", ".join(argv[1:]), file=sys.stderr)
        return 2
    counts = {}
    print(f"{'model':18} {'mode':16} {'T':>6} {'hit':>4} {'median_us':>10} {'floor_us':>9}  {'figure':26} "
          f"{'target':22} result")
    for r in rows:
        c = classify(r)
        if c is None:
            continue
        kind, figure, target, ok = c
        n = counts.setdefault(kind, [0, 0])
        n[0] += ok
        n[1] += 1
        print(f"{r['model']:18} {r['mode']:16} {r['tokens']:6d} {r['experts_hit']:4d} {r['median_us']:10.1f} "
              f"{r['floor_us']:9.1f}  {figure:26} {target:22} {'PASS' if ok else 'MISS'}")
    # NOTE: "mid" and "prefill" are both issue 8's rows (T = 512..2048 and T >= 4096): their sum is the
    # prefill table's count.
    print(f"L2 flush before each replay: {', '.join(sorted(flushes))}")
    names = {"decode": "decode (T <= 256)", "mid": "prefill, T = 512..2048", "prefill": "prefill, T >= 4096"}
    for kind, (ok, n) in counts.items():
        print(f"{names[kind]}: {ok}/{n} rows meet the target")
    if "mid" in counts and "prefill" in counts:
        ok = counts["mid"][0] + counts["prefill"][0]
        n = counts["mid"][1] + counts["prefill"][1]
        print(f"prefill (T >= 512): {ok}/{n} rows meet the target")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
