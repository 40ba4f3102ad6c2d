#!/usr/bin/env python3
"""Plots `fp4moe bench --json` rows against the speed targets: one PNG, a panel per model.

--set decode (default, rows with T <= 256): layer time / floor against the token count T (log x) for
every mode found in the files, and the target 1.15 + 8 us / floor; a row meets it when its point lies
on or below the target's line.
--set prefill (rows with T >= 512): whole-layer TFLOP/s against T, and the target: 600 TFLOP/s from
T = 4096, and for T = 512..2048 the easier of 450 TFLOP/s and 1.3 x floor (drawn as the TFLOP/s that
1.3 x floor means for the row); a row meets it when its point lies on or above the line.
The panel titles count the rows that meet the target by bench/targets.py's rule (classify).

    python3 bench/plot_targets.py BENCH_JSON [BENCH_JSON ...] --out FILE.png [--set decode|prefill]
                                  [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import (DECODE_MAX_T, DECODE_RATIO, DECODE_SLACK_US, MID_MIN_T, MID_RATIO, MID_TF,  # noqa: E402
                     PREFILL_MIN_T, PREFILL_TF, classify)

MODE_STYLE = {"w4a16": ("tab:blue", "o"), "w4a4_scalar": ("tab:orange", "s"), "w4a4_per_expert": ("tab:green", "^")}


def in_set(row, which):
    return row["tokens"] <= DECODE_MAX_T if which == "decode" else row["tokens"] >= MID_MIN_T


def load(paths, which):
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += [r for r in data.get("rows", []) if in_set(r, which)]
    return rows


def decode_figure(r):
    return r["median_us"] / r["floor_us"]


def decode_target(r):
    return DECODE_RATIO + DECODE_SLACK_US / r["floor_us"]


def prefill_target(r):
    if r["tokens"] >= PREFILL_MIN_T:
        return PREFILL_TF
    return min(MID_TF, r["flops"] / (MID_RATIO * r["floor_us"]) / 1e6)  # TFLOP/s of a layer at 1.3 x floor


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--set", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv[1:])
    rows = load(args.json, args.set)
    if not rows:
        span = "T <= 256" if args.set == "decode" else "T >= 512"
        print(f"plot_targets: no rows with {span} in the files", file=sys.stderr)
        return 2
    if args.set == "decode":
        figure, target = decode_figure, decode_target
        ylabel, target_label = "layer time / floor", "target 1.15 + 8 us / floor"
    else:
        figure, target = (lambda r: r["tflops"]), prefill_target
        ylabel, target_label = "whole-layer TFLOP/s", "target (600; T < 4096: min(450, 1.3 x floor))"
    by_model = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    models = list(by_model)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mrows = by_model[model]
        modes = sorted({r["mode"] for r in mrows})
        for mode in modes:
            pts = sorted((r["tokens"], figure(r)) for r in mrows if r["mode"] == mode)
            colour, marker = MODE_STYLE.get(mode, ("tab:gray", "x"))
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker=marker, color=colour, label=mode)
        line = {}
        for r in mrows:  # one line per model: the first mode's floor (the modes' floors differ < 1%)
            line.setdefault(r["tokens"], target(r))
        met = sum(bool(classify(r)[3]) for r in mrows)
        ts = sorted(line)
        ax.plot(ts, [line[t] for t in ts], color="black", linestyle="--", label=target_label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts)
        ax.set_xticklabels([str(t) for t in ts], fontsize=7)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(ylabel)
        if args.set == "decode":
            ax.axhline(1.0, color="gray", linewidth=0.8)
            ax.set_ylim(bottom=0.9)
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(f"{model}: {met}/{len(mrows)} rows meet", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    if args.title:
        fig.suptitle(args.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot_targets: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
