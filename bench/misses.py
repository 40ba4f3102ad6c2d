#!/usr/bin/env python3
"""The rows of `fp4moe bench --json` tables that miss their speed target (bench/targets.py), as one
Markdown table per target with the measured figures that say where each row's time goes.

  prefill rows (T >= 512): TFLOP/s, x floor, and per GEMM its TFLOP/s from its stage time (the
    presets of the tables are gated: GEMM1 does 2/3 of the layer's FLOPs, GEMM2 1/3), the finalize's
    share of the stage sum, the SM clock and the fraction of power-capped clock samples, the tactic.
  decode rows (T <= 256): median, target, median / target, the GEMM stages against the weight bytes
    (TB/s, and the copy ceiling of the same run), the other stages (route, quantize, permute,
    finalize) in us, the tactic.
  Each row's "why": the measured causes of misses (docs/performance.md, "What limits each regime") that apply to it, each with the row's figure
    (GEMM rate against the bf16 ceiling, token rows per expert, the finalize's share, the capped clock,
    K = 768; decode: the GEMMs' time over the weights' copy time, the other stages, the T regime).

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
GATED = {"deepseek-r1", "qwen3-30b-a3b", "qwen3-235b-a22b", "llama4-scout", "gpt-oss-120b", "gpt-oss-20b",
         "gpt-oss-120b-nvfp4", "kimi-k2", "glm-4.6", "qwen3-next-80b-a3b"}
OTHER_STAGES = ("route", "quantize", "permute", "finalize")
# Routed experts per token of the presets (format/presets.cpp): token rows per hit expert = T * k / hit.
TOP_K = {"deepseek-r1": 8, "qwen3-30b-a3b": 8, "qwen3-235b-a22b": 8, "llama4-scout": 1, "gpt-oss-120b": 4,
         "gpt-oss-20b": 4, "gpt-oss-120b-nvfp4": 4, "kimi-k2": 8, "glm-4.6": 8, "qwen3-next-80b-a3b": 10}


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


def prefill_why(row, g1, g2, finalize_pct, bf16_tflops):
    """The causes the perf log measured (docs/performance.md, "What limits each regime"), each with this row's figure."""
    why = []
    if g1 != "-" and bf16_tflops:
        lo, hi = sorted((float(g1), float(g2)))
        why.append(f"GEMMs at {100 * lo / bf16_tflops:.0f}-{100 * hi / bf16_tflops:.0f}% of bf16" +
                   (" (FP4-decode-bound main loops, exposed epilogues)" if row["tokens"] >= 4096 else ""))
    k = TOP_K.get(row["model"])
    if row["tokens"] < 4096 and k and row.get("experts_hit"):
        why.append(f"{row['tokens'] * k / row['experts_hit']:.0f} rows/expert: partial tiles, a fill and "
                   "epilogue per tile")
    if finalize_pct >= 3.0:
        why.append(f"fp32-y finalize {finalize_pct:.0f}%")
    c = row.get("clock") or {}
    if c.get("power_capped_fraction", 0.0) >= 0.25 and c.get("sm_mhz", 1980.0) < 1950.0:
        why.append(f"power cap: {c['sm_mhz']:.0f} MHz")
    if row["model"] == "qwen3-30b-a3b":
        why.append("GEMM2 K = 768: 6 K chunks per tile")
    return "; ".join(why) or "-"


def decode_why(row, gemm_us, other_us, copy):
    """The decode causes the perf log measured, each with this row's figure."""
    why = []
    if copy and gemm_us > 0:
        copy_us = row["weight_bytes"] / (copy * 1e12) * 1e6
        why.append(f"GEMMs {gemm_us - copy_us:+.0f} us over the weights' copy time")
    why.append(f"route..finalize {other_us:.0f} us")
    if row["tokens"] <= 16:
        why.append("fixed cost of 3 dependent launches")
    elif row["tokens"] >= 128:
        why.append("GEMMs issue-bound on the FP4 decode")
    return "; ".join(why)


def prefill_line(row, target, bf16_tflops):
    st = row.get("stages_us", {})
    finalize_pct = 100 * st.get("finalize", 0.0) / (sum(st.values()) or 1.0)
    g1, g2 = gemm_tflops(row, "gemm1", 2 / 3), gemm_tflops(row, "gemm2", 1 / 3)
    return (f"| {row['model']} | {row['mode']} | {row['tokens']} | {row['tflops']:.1f} | "
            f"{row['median_us'] / row['floor_us']:.2f} | {target} | {g1} | {g2} | {finalize_pct:.1f} | {clock(row)} | "
            f"{row.get('tactic', '-')} | {prefill_why(row, g1, g2, finalize_pct, bf16_tflops)} |")


def decode_line(row, target_us, copy):
    copy_tbps = f"{copy:.2f}" if copy else "-"
    st = row.get("stages_us", {})
    gemm_us = st.get("gemm1", 0.0) + st.get("gemm2", 0.0)
    rate = f"{row['weight_bytes'] / (gemm_us * 1e-6) / 1e12:.2f}" if gemm_us > 0 else "-"
    other = " / ".join(f"{st.get(s, 0.0):.1f}" for s in OTHER_STAGES)
    return (f"| {row['model']} | {row['mode']} | {row['tokens']} | {row['median_us']:.1f} | {target_us:.1f} | "
            f"{row['median_us'] / target_us:.2f} | {gemm_us:.1f} | {rate} of {copy_tbps} | {other} | "
            f"{row.get('tactic', '-')} | "
            f"{decode_why(row, gemm_us, sum(st.get(s, 0.0) for s in OTHER_STAGES), copy)} |")


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
        copy = copy if isinstance(copy, (int, float)) else None
        bf16 = data.get("ceilings", {}).get("bf16_tflops")
        bf16 = bf16 if isinstance(bf16, (int, float)) else None
        for r in rows:
            c = classify(r)
            if c is None or c[3]:
                continue
            kind, _, target, _ = c
            if kind == "decode":
                decode.append(decode_line(r, DECODE_RATIO * r["floor_us"] + DECODE_SLACK_US, copy))
            else:
                prefill.append(prefill_line(r, target, bf16))
    if prefill:
        print(f"Prefill rows that miss ({len(prefill)}):\n")
        print("| preset | mode | T | TFLOP/s | x floor | target | GEMM1 TF | GEMM2 TF | finalize % | SM MHz (capped) | tactic | why |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(prefill))
    if decode:
        if prefill:
            print()
        print(f"Decode rows that miss ({len(decode)}):\n")
        print("| preset | mode | T | median us | target us | / target | GEMM us | GEMM TB/s | route / quantize / permute / finalize us | tactic | why |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(decode))
    if not prefill and not decode:
        print("every row meets its target")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
