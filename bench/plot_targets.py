#!/usr/bin/env python3
"""Plots `fp4moe bench --json` rows against the decode target: one PNG, a panel per model.

Each panel: layer time / floor against the token count T (log x) for every mode found in the files,
and the target 1.15 + 8 us / floor of the decode work (bench/targets.py), which a row meets when its
point lies on or below the target's line. Rows with T > 256 are left out (the prefill targets are
TFLOP/s; see bench/targets.py).

    python3 bench/plot_targets.py BENCH_JSON [BENCH_JSON ...] --out FILE.png [--title TEXT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MODE_STYLE = {"w4a16": ("tab:blue", "o"), "w4a4_scalar": ("tab:orange", "s"), "w4a4_per_expert": ("tab:green", "^")}


def load(paths):
    rows = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += [r for r in data.get("rows", []) if r["tokens"] <= 256]
    return rows


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv[1:])
    rows = load(args.json)
    if not rows:
        print("plot_targets: no rows with T <= 256 in the files", file=sys.stderr)
        return 2
    by_model = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    models = list(by_model)
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mrows = by_model[model]
        modes = sorted({r["mode"] for r in mrows})
        met = total = 0
        for mode in modes:
            pts = sorted((r["tokens"], r["median_us"] / r["floor_us"]) for r in mrows if r["mode"] == mode)
            colour, marker = MODE_STYLE.get(mode, ("tab:gray", "x"))
            ax.plot([t for t, _ in pts], [v for _, v in pts], marker=marker, color=colour, label=mode)
        target = {}
        for r in mrows:
            target[r["tokens"]] = 1.15 + 8.0 / r["floor_us"]
            total += 1
            met += r["median_us"] <= 1.15 * r["floor_us"] + 8.0
        ts = sorted(target)
        ax.plot(ts, [target[t] for t in ts], color="black", linestyle="--", label="target 1.15 + 8 us / floor")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ts)
        ax.set_xticklabels([str(t) for t in ts], fontsize=7)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("layer time / floor")
        ax.set_ylim(bottom=0.9)
        ax.set_title(f"{model}: {met}/{total} rows meet", fontsize=9)
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
