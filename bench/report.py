#!/usr/bin/env python3
"""bench/results.jsonl as one HTML page: per op, a plot of smelt against its
peers (the latest value of every case, and the history where PERF.md draws
one) and the table of those rows. The page is one file, plots included, to
open in a browser or attach to a note.

The rows and plots are perf_report.py's (the same selection as PERF.md's
tables); ops whose rows name no peer value get the table alone.

Usage (from anywhere):
    python3 bench/report.py                  # writes bench/report.html
    python3 bench/report.py -o /tmp/r.html --results other.jsonl
Needs matplotlib.
"""

import argparse
import base64
import html
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import perf_report as pr  # noqa: E402

STYLE = ("body{font-family:sans-serif;max-width:1400px;margin:2em auto;padding:0 1em}"
         "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:2px 6px}"
         "th{background:#eee}img{max-width:100%}")


def html_table(markdown):
    """perf_report's markdown table as HTML (header, separator, rows)."""
    lines = [ln.strip().strip("|").split("|") for ln in markdown.strip().splitlines()]
    if len(lines) < 2:
        return "<p>%s</p>" % html.escape(markdown)
    head = "".join("<th>%s</th>" % html.escape(c.strip()) for c in lines[0])
    body = "".join("<tr>%s</tr>" % "".join("<td>%s</td>" % html.escape(c.strip()) for c in r) for r in lines[2:])
    return "<table><tr>%s</tr>%s</table>" % (head, body)


def section(op, rows, tmp):
    spec = pr.PLOTS.get(op, dict(ops=[op], title=op))
    parts = ["<h2>%s</h2>" % html.escape(op)]
    if any(r.get("smelt") is not None and r.get("peer_value") is not None for r in pr.latest(rows, spec["ops"])):
        with open(pr.plot(op, spec, rows, tmp), "rb") as f:
            parts.append('<img alt="%s" src="data:image/png;base64,%s">' % (op, base64.b64encode(f.read()).decode()))
    parts.append(html_table(pr.table(rows, [op])))
    return "\n".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--results", default=pr.RESULTS, help="the results file (default bench/results.jsonl)")
    ap.add_argument("-o", "--output", default=os.path.join(pr.REPO, "bench", "report.html"),
                    help="the page to write (default bench/report.html)")
    opts = ap.parse_args()
    rows = pr.load(opts.results)
    ops = list(dict.fromkeys(r["op"] for r in rows))
    with tempfile.TemporaryDirectory() as tmp:
        body = "\n".join(section(op, rows, tmp) for op in ops)
    title = "smelt benchmarks (%s)" % html.escape(os.path.relpath(opts.results))
    page = ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>%s</title><style>%s</style></head>"
            "<body><h1>%s</h1><p>Per op, the latest row of every case, GPU, dtype and peer; ratio = smelt's "
            "speed over the peer's (above 1: smelt ahead).</p>\n%s\n</body></html>\n" % (title, STYLE, title, body))
    with open(opts.output, "w") as f:
        f.write(page)
    print("wrote", opts.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
