#!/usr/bin/env python3
"""Plots the JSON written by bench/peers.py: one PNG per model.

Left panel: layer time against the token count T (log-log) for fp4moe (median, with its min as small
markers), its floor and each peer (torch baselines; the reference numbers of the anchors file, when
peers.py was given one, as thin dotted lines). Right panel: percent of floor (floor / time) against
T (log x) for the same series; 100% is the floor.

    python3 bench/plot.py peers.json --out-dir DIR      -> DIR/bench-<model>.png
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator  # noqa: E402

# Measured in this run: (row key, label, colour, marker).
PEERS = [
    ("torch_bf16", "torch bf16 (_grouped_mm, eager)", "tab:blue", "s"),
    ("torch_fp8", "torch fp8 (_scaled_grouped_mm, eager)", "tab:orange", "^"),
    ("triton_mxfp4", "triton_kernels MXFP4 (matmul_ogs, vLLM's gpt-oss path)", "tab:green", "D"),
]
ANCHOR_COLOURS = ["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
# Anchor columns that are not a time of a peer implementation.
ANCHOR_SKIP = {"experts hit", "nvfp4 floor", "torch bf16", "torch fp8"}


def series(rows, key):
    pts = [(r["tokens"], r.get(key)) for r in rows]
    return [t for t, v in pts if v], [v for t, v in pts if v]


def ticks_T(ax, tokens):
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(tokens))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(round(v))}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("tokens T")


def us_fmt(v, _):
    if v >= 1000:
        return f"{v / 1000:g} ms"
    return f"{v:g} us"


def plot_model(doc, model, rows, out_dir, with_anchors):
    rows = sorted(rows, key=lambda r: r["tokens"])
    tokens = [r["tokens"] for r in rows]
    fig, (ax_t, ax_p) = plt.subplots(1, 2, figsize=(14, 6.6), gridspec_kw={"width_ratios": [1.15, 1]})

    # Left: time vs T.
    t, v = series(rows, "fp4moe_median_us")
    if t:
        ax_t.plot(t, v, "-o", color="tab:red", lw=2.4, ms=5, label=f"fp4moe {doc.get('mode', '')} (median)", zorder=5)
        tm, vm = series(rows, "fp4moe_min_us")
        ax_t.plot(tm, vm, linestyle="none", marker="_", ms=12, mew=1.5, color="tab:red", label="fp4moe (min)",
                  zorder=5)
    t, v = series(rows, "floor_us")
    if t:
        ax_t.plot(t, v, "--", color="black", lw=1.6, label="floor: max(FP4 bytes / copy rate, FLOPs / bf16 rate)")
    any_bad = False
    for key, label, colour, marker in PEERS:
        t, v = series(rows, f"{key}_us")
        if t:
            bad = {r["tokens"] for r in rows if r.get(f"{key}_refcheck", {}).get("ok") is False}
            ax_t.plot(t, v, "-", marker=marker, color=colour, lw=1.6, ms=5, label=label)
            for tt, vv in zip(t, v):
                if tt in bad:
                    any_bad = True
                    ax_t.plot([tt], [vv], "x", color="black", ms=10, mew=2, zorder=6)
    anchor_cols = []
    if with_anchors:
        cols = []
        for r in rows:
            for c in (r.get("anchor") or {}):
                if c not in cols and c not in ANCHOR_SKIP:
                    cols.append(c)
        for i, c in enumerate(cols):
            pts = [(r["tokens"], r["anchor"][c]) for r in rows if (r.get("anchor") or {}).get(c)]
            if pts:
                anchor_cols.append((c, ANCHOR_COLOURS[i % len(ANCHOR_COLOURS)]))
                ax_t.plot([p[0] for p in pts], [p[1] for p in pts], ":", marker=".", lw=1.2,
                          color=anchor_cols[-1][1], label=f"{c} (anchors)")
    ticks_T(ax_t, tokens)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(FuncFormatter(us_fmt))
    ax_t.set_ylabel("layer time (lower is better)")
    ax_t.grid(True, which="major", alpha=0.35)
    ax_t.grid(True, which="minor", axis="y", alpha=0.12)
    ax_t.set_title("time per MoE layer")

    # Right: percent of floor vs T.
    def pct_series(key):
        pts = [(r["tokens"], 100.0 * r["floor_us"] / r[key]) for r in rows if r.get(key) and r.get("floor_us")]
        return [p[0] for p in pts], [p[1] for p in pts]

    t, v = pct_series("fp4moe_median_us")
    if t:
        ax_p.plot(t, v, "-o", color="tab:red", lw=2.4, ms=5, label="fp4moe (median)", zorder=5)
        tm, vm = pct_series("fp4moe_min_us")
        ax_p.plot(tm, vm, linestyle="none", marker="_", ms=12, mew=1.5, color="tab:red", label="fp4moe (min)",
                  zorder=5)
    for key, label, colour, marker in PEERS:
        t, v = pct_series(f"{key}_us")
        if t:
            ax_p.plot(t, v, "-", marker=marker, color=colour, lw=1.6, ms=5)
    for c, colour in anchor_cols:
        pts = [(r["tokens"], 100.0 * r["floor_us"] / r["anchor"][c]) for r in rows
               if (r.get("anchor") or {}).get(c) and r.get("floor_us")]
        if pts:
            ax_p.plot([p[0] for p in pts], [p[1] for p in pts], ":", marker=".", lw=1.2, color=colour)
    ax_p.axhline(100, color="black", ls="--", lw=1.2)
    ticks_T(ax_p, tokens)
    ax_p.set_ylim(0, max(110, ax_p.get_ylim()[1]))
    ax_p.set_ylabel("percent of floor (higher is better)")
    ax_p.grid(True, alpha=0.35)
    ax_p.set_title("percent of floor = floor / time (100% = at the floor)")

    # One legend for both panels, under them.
    handles, labels = ax_t.get_legend_handles_labels()
    if any_bad:
        handles.append(Line2D([], [], linestyle="none", marker="x", color="black", ms=8, mew=2))
        labels.append("refcheck failed (not counted as a peer)")
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8.5, frameon=False)

    r0 = rows[0]
    shape = f"E{r0.get('E', '?')} H{r0.get('H', '?')} I{r0.get('I', '?')} top-{r0.get('k', '?')}"
    ceil = (doc.get("ceilings") or {}).get("fp4moe") or (doc.get("ceilings") or {}).get("torch") or {}
    ceil_txt = (f"   ceilings: copy {ceil['copy_tbps']:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f} TFLOP/s"
                if ceil.get("copy_tbps") and ceil.get("bf16_tflops") else "")
    fig.suptitle(f"{model} ({shape})  —  {doc.get('gpu') or 'unknown GPU'}  —  {doc.get('date', '')}\n"
                 f"fp4moe mode {doc.get('mode', '?')}, commit {doc.get('commit') or '?'}{ceil_txt}", fontsize=11)
    nrows = (len(labels) + 2) // 3
    fig.tight_layout(rect=(0, 0.045 * nrows + 0.01, 1, 0.95))
    path = Path(out_dir) / f"bench-{re.sub(r'[^A-Za-z0-9._-]', '_', model)}.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench/plot.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="the JSON written by bench/peers.py --json")
    ap.add_argument("--out-dir", default=".", help="where the PNGs go (default: the current folder)")
    ap.add_argument("--models", help="comma-separated models to plot (default: all in the JSON)")
    ap.add_argument("--no-anchors", action="store_true", help="leave out the reference numbers of the anchors file")
    args = ap.parse_args(argv)

    doc = json.loads(Path(args.json).read_text())
    by_model = {}
    for r in doc.get("rows", []):
        by_model.setdefault(r["model"], []).append(r)
    models = [m for m in args.models.split(",") if m] if args.models else list(by_model)
    missing = [m for m in models if m not in by_model]
    if missing:
        ap.error(f"no rows for {', '.join(missing)} in {args.json} (it has {', '.join(by_model) or 'none'})")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    for m in models:
        print(plot_model(doc, m, by_model[m], args.out_dir, not args.no_anchors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
