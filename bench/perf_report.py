#!/usr/bin/env python3
"""docs/PERF.md's result tables and docs/perf/*.png from bench/results.jsonl.

The results file holds one JSON object a line (bench/benchlib.py's Recorder
appends them; the first rows were docs/PERF.md's figures at b1f2d2d): date,
commit, gpu, op, case, dtype, smelt, peer, peer_value, unit, ratio, and an
optional note. ratio is smelt's speed over the peer's (for times, the peer's
time over smelt's), so above 1 means smelt is ahead; a row may give only the
ratio, or no peer at all.

docs/PERF.md marks each generated table with a pair of comments:

    <!-- results:gemm -->            (or several ops: results:peer,peer_store)
    ...generated...
    <!-- /results -->

and gets, per op, the latest row of every (gpu, case, dtype, peer), latest by
date and then by place in the file, in the order the cases first appear.

Usage (from anywhere):
    python3 bench/perf_report.py             # rewrite the tables and the plots
    python3 bench/perf_report.py --no-plots  # tables only (no matplotlib needed)
    python3 bench/perf_report.py --check     # exit 1 when PERF.md's tables are stale
"""

import argparse
import json
import os
import re
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results.jsonl")
PERF_MD = os.path.join(REPO, "docs", "PERF.md")
PLOT_DIR = os.path.join(REPO, "docs", "perf")

# The value column's header where the value is not smelt's (the ceilings are
# probes and copies).
VALUE_HEADER = {"ceiling": "measured"}

MARKER = re.compile(r"(<!-- results:([a-z0-9_,]+) -->\n)(.*?)(<!-- /results -->)", re.S)

# The plots: one PNG an op, with the ops it draws and, where the history of
# one case says more than its latest value, that case's ratio over the rows.
PLOTS = {
    "gemm": dict(ops=["gemm"], title="GEMM against its peers"),
    "attention": dict(ops=["attention"], title="Attention against cuDNN and FlashAttention-2"),
    "peer": dict(ops=["peer"], title="PEER against torch eager", history="fwd", bar=5.0),
}


def load(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    sys.exit(f"{path}:{n}: not JSON: {e}")
    return rows


def latest(rows, ops):
    """The latest row of every (gpu, case, dtype, peer) of ops, in the order
    the cases first appear, then by GPU."""
    best, case_order = {}, {}
    for i, r in enumerate(rows):
        if r["op"] not in ops:
            continue
        case_order.setdefault((r["op"], r["case"]), len(case_order))
        key = (r["op"], r["gpu"], r["case"], r["dtype"], r.get("peer"))
        if key not in best or (r["date"][:10], i) >= (best[key][1]["date"][:10], best[key][0]):
            best[key] = (i, r)
    keyed = [(case_order[(r["op"], r["case"])], r["gpu"], i, r) for i, r in best.values()]
    return [r for *_, r in sorted(keyed, key=lambda t: t[:3])]


def num(v):
    """A value with the digits it was recorded with."""
    return "—" if v is None else f"{v:.6g}"


def gpu_short(name):
    return name.replace("NVIDIA ", "")


def table(rows, ops):
    sel = latest(rows, ops)
    if not sel:
        return "(no rows in bench/results.jsonl for " + ", ".join(ops) + ")\n"
    value = VALUE_HEADER.get(ops[0], "smelt")
    lines = [f"| case | dtype | GPU | {value} | peer | peer's | unit | ratio | date | commit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sel:
        ratio = f"{r['ratio']:.3f}".rstrip("0").rstrip(".") if r.get("ratio") is not None else "—"
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(f"| {r['case']}{note} | {r['dtype']} | {gpu_short(r['gpu'])} | {num(r.get('smelt'))} | "
                     f"{r.get('peer') or '—'} | {num(r.get('peer_value'))} | {r['unit']} | {ratio} | "
                     f"{r['date'][:10]} | {r['commit']} |")
    return "\n".join(lines) + "\n"


def render(text, rows):
    """PERF.md's text with every marked table regenerated."""
    return MARKER.sub(lambda m: m.group(1) + table(rows, m.group(2).split(",")) + m.group(4), text)


# ---------------------------------------------------------------- plots


def plot(name, spec, rows, out_dir=PLOT_DIR):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sel = [r for r in latest(rows, spec["ops"]) if r.get("smelt") is not None and r.get("peer_value") is not None]
    units = list(dict.fromkeys(r["unit"] for r in sel))
    hist = [r for r in rows if r["op"] in spec["ops"] and r["case"] == spec.get("history") and r.get("ratio")]
    panels = len(units) + (1 if hist else 0)
    # A panel of many cases (GEMM's 40-odd) widens and turns its labels upright, or they overlap.
    most = max((len({(r["case"], r["gpu"]) for r in sel if r["unit"] == u}) for u in units), default=0)
    dense = most > 16
    width_in = max(6.5, 0.32 * most) * len(units) + (6.5 if hist else 0)
    fig, axes = plt.subplots(1, panels, figsize=(max(7, width_in), 6.5 if dense else 5.2), squeeze=False)
    colors = {}
    for ax, unit in zip(axes[0], units):
        groups = list(dict.fromkeys((r["case"], r["gpu"]) for r in sel if r["unit"] == unit))
        peers = list(dict.fromkeys(r["peer"] for r in rows if r in sel and r["unit"] == unit))
        width = 0.8 / (1 + max(sum(1 for r in sel if (r["case"], r["gpu"], r["unit"]) == (*g, unit)) for g in groups))
        for gi, (case, gpu) in enumerate(groups):
            mine = [r for r in sel if (r["case"], r["gpu"], r["unit"]) == (case, gpu, unit)]
            smelt = mine[-1]["smelt"]
            mine.sort(key=lambda r: peers.index(r["peer"]))
            bars = [("smelt", smelt)] + [(r["peer"], r["peer_value"]) for r in mine]
            for bi, (label, v) in enumerate(bars):
                color = colors.setdefault(label, f"C{len(colors)}")
                ax.bar(gi + (bi - (len(bars) - 1) / 2) * width, v, width, color=color,
                       label=label if label not in ax.get_legend_handles_labels()[1] else None)
            ax.annotate(" / ".join(f"{r['ratio']:.2f}" for r in mine if r.get("ratio")), (gi, max(v for _, v in bars)),
                        ha="center", va="bottom", fontsize=7, rotation=90 if dense else 0)
        many_gpus = len({g for _, g in groups}) > 1
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([c + (f"\n{gpu_short(g)}" if many_gpus else "") for c, g in groups],
                           rotation=90 if dense else 35, ha="center" if dense else "right", fontsize=8)
        if dense:
            ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylabel(unit + (" (lower is faster)" if unit not in ("TF/s", "GB/s") else ""))
        ax.set_title(f"latest per case ({', '.join(sorted({gpu_short(g) for _, g in groups}))}); "
                     "numbers: smelt's speed over the peer's", fontsize=9)
        ax.legend(fontsize=8)
    if hist:
        ax = axes[0][-1]
        labels = list(dict.fromkeys(r.get("note") or r["commit"] for r in hist))
        for gpu in dict.fromkeys(r["gpu"] for r in hist):
            pts = [r for r in hist if r["gpu"] == gpu]
            ax.plot([labels.index(r.get("note") or r["commit"]) for r in pts], [r["ratio"] for r in pts], marker="o",
                    label=gpu_short(gpu))
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8)
        if spec.get("bar"):
            ax.axhline(spec["bar"], color="grey", linestyle="--", label=f"bar {spec['bar']:g}x")
        ax.set_xlabel("version (runs in the order recorded)")
        ax.set_ylabel(f"{spec['history']}: smelt's speed over {hist[-1].get('peer')}")
        ax.set_title(f"{spec['history']} by version", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(spec["title"] + " (bench/results.jsonl)")
    fig.tight_layout()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".png")
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


# ---------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--results", default=RESULTS, help="the results file (default bench/results.jsonl)")
    ap.add_argument("--perf", default=PERF_MD, help="the document to update (default docs/PERF.md)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 when the tables are stale")
    ap.add_argument("--no-plots", action="store_true", help="tables only (plots need matplotlib)")
    opts = ap.parse_args()

    rows = load(opts.results)
    with open(opts.perf) as f:
        text = f.read()
    if not MARKER.search(text):
        sys.exit(f"{opts.perf}: no <!-- results:OP --> ... <!-- /results --> markers")
    new = render(text, rows)
    if opts.check:
        if new != text:
            pairs = zip(MARKER.finditer(text), MARKER.finditer(new))
            stale = [m.group(2) for m, n in pairs if m.group(3) != n.group(3)]
            print(f"{opts.perf}: stale tables ({', '.join(stale)}); run python3 bench/perf_report.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        with open(opts.perf, "w") as f:
            f.write(new)
        print(f"updated {opts.perf}")
    if not opts.no_plots:
        for name, spec in PLOTS.items():
            print("wrote", plot(name, spec, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
