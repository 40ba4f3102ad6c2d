#!/usr/bin/env python3
"""The rows of `fp4moe bench --json` tables that miss their speed target (bench/targets.py), as one
Markdown table per target with the measured figures that say where each row's time goes.

  prefill rows (T >= 512): TFLOP/s, x floor, and per GEMM its TFLOP/s from its stage time (the
    presets of the tables are gated: GEMM1 does 2/3 of the layer's FLOPs, GEMM2 1/3), the finalize's
    share of the stage sum, the SM clock and the fraction of power-capped clock samples, the tactic.
  decode rows (T <= 256): median, target, median / target, the GEMM stages against the weight bytes
    (TB/s, and the copy ceiling of the same run), the other stages (route, quantize, permute,
    finalize) in us, the tactic.

Stage times come from the bench's separate event-timed run, so their sum can exceed the layer's
median (dependent launches overlap); a stage with no kernel of its own in that row (quantize in w4a16,
permute when the routing launch permutes) reads ~1.3 us, the cost of its pair of event records.
Exit status 0 (2 for a file without rows).

  bench/misses.py BENCH_JSON [BENCH_JSON ...]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import DECODE_RATIO, DECODE_SLACK_US, classify  # noqa: E402  (the targets' one definition)

# Presets with a gated activation (GEMM1 has 2I rows): FLOPs split 2/3 : 1/3 between the GEMMs.
GATED = {"deepseek-r1", "qwen3-30b-a3b", "qwen3-235b-a22b", "llama4-scout", "gpt-oss-120b", "kimi-k2",
         "glm-4.6", "qwen3-next-80b-a3b"}
OTHER_STAGES = ("route", "quantize", "permute", "finalize")


def gemm_tflops(row, stage, share):
    us = row.get("stages_us", {}).get(stage)
    if row["model"] not in GATED or not us:
        return "-"
    return f"{row['flops'] * share / (us * 1e-6) / 1e12:.0f}"


def clock(row):
    c = row.get("clock") or {}
    if "sm_mhz" not in c:
        return "-"
    return f"{c['sm_mhz']:.0f} ({100 * c.get('power_capped_fraction', 0.0):.0f}%)"


def prefill_line(row, target):
    st = row.get("stages_us", {})
    total = sum(st.values()) or 1.0
    fin = st.get("finalize", 0.0)
    return (f"| {row['model']} | {row['mode']} | {row['tokens']} | {row['tflops']:.1f} | "
            f"{row['median_us'] / row['floor_us']:.2f} | {target} | {gemm_tflops(row, 'gemm1', 2 / 3)} | "
            f"{gemm_tflops(row, 'gemm2', 1 / 3)} | {100 * fin / total:.1f} | {clock(row)} | {row.get('tactic', '-')} |")


def decode_line(row, target_us, copy_tbps):
    st = row.get("stages_us", {})
    gemm_us = st.get("gemm1", 0.0) + st.get("gemm2", 0.0)
    rate = f"{row['weight_bytes'] / (gemm_us * 1e-6) / 1e12:.2f}" if gemm_us > 0 else "-"
    other = " / ".join(f"{st.get(s, 0.0):.1f}" for s in OTHER_STAGES)
    return (f"| {row['model']} | {row['mode']} | {row['tokens']} | {row['median_us']:.1f} | {target_us:.1f} | "
            f"{row['median_us'] / target_us:.2f} | {gemm_us:.1f} | {rate} of {copy_tbps} | {other} | "
            f"{row.get('tactic', '-')} |")


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    prefill, decode = [], []
    for path in argv[1:]:
        with open(path) as f:
            data = json.load(f)
        rows = data.get("rows", [])
        if not rows:
            print(f"misses.py: no rows in {path}", file=sys.stderr)
            return 2
        copy = data.get("ceilings", {}).get("copy_tbps")
        copy_tbps = f"{copy:.2f}" if isinstance(copy, (int, float)) else "-"
        for r in rows:
            c = classify(r)
            if c is None or c[3]:
                continue
            kind, _, target, _ = c
            if kind == "decode":
                decode.append(decode_line(r, DECODE_RATIO * r["floor_us"] + DECODE_SLACK_US, copy_tbps))
            else:
                prefill.append(prefill_line(r, target))
    if prefill:
        print(f"Prefill rows that miss ({len(prefill)}):\n")
        print("| preset | mode | T | TFLOP/s | x floor | target | GEMM1 TF | GEMM2 TF | finalize % | SM MHz (capped) | tactic |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(prefill))
    if decode:
        if prefill:
            print()
        print(f"Decode rows that miss ({len(decode)}):\n")
        print("| preset | mode | T | median us | target us | / target | GEMM us | GEMM TB/s | route / quantize / permute / finalize us | tactic |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(decode))
    if not prefill and not decode:
        print("every row meets its target")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
