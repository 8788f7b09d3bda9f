"""What the bench/*_vs_*.py peer scripts share: running `smelt bench` in a
subprocess, the common options, case selection, timing a peer with CUDA
events over rotated inputs, and appending result rows to bench/results.jsonl
(which bench/perf_report.py turns into docs/PERF.md's tables and plots).

Run from any folder: each script puts bench/ first on sys.path, as Python
does for the script's own folder. Nothing here imports torch at module level,
so every script's --help works without it."""

import argparse
import datetime
import json
import math
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results.jsonl")

# Units whose larger value is the faster one; for the others (times) the
# ratio is the peer's value over smelt's, so a ratio above 1 always means
# smelt is ahead.
RATE_UNITS = ("TF/s", "GB/s", "%")


def git_commit(override=None):
    """The short HEAD of the repository, "-dirty" when tracked files changed.
    A tree copied without .git (as the GPU runs use) names its commit through
    `override` (a --commit argument) or SMELT_COMMIT, else "unknown"."""
    if override:
        return override
    if os.environ.get("SMELT_COMMIT"):
        return os.environ["SMELT_COMMIT"]
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else "unknown"
    except Exception:
        return "unknown"


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def fmt(v, spec, width=0):
    """v formatted, or "-" (right-aligned in `width`) when there is no number."""
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "-".rjust(width)


# ---------------------------------------------------------------- options


def case_parser(doc, cases, quick, default):
    """The parser of a script with a case table: its docstring's first
    paragraph, the case names, --quick (`quick` says which), --cases, --list."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="cases: " + ", ".join(c["name"] for c in cases) + "\n")
    ap.add_argument("--quick", action="store_true",
                    help=f"{quick}: " + ", ".join(c["name"] for c in cases if c["quick"]))
    ap.add_argument("--cases", help=f"comma-separated case names (default: {default})")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    return ap


def add_common_args(ap, warmup, iters, results=True):
    """The options every peer script takes, with its own run counts."""
    ap.add_argument("--json-out", metavar="PATH", help="write the results (and the raw smelt JSON) here")
    ap.add_argument("--smelt", default=os.path.join(REPO, "build", "smelt"),
                    help="the smelt binary (default build/smelt)")
    ap.add_argument("--device", default="cuda", help="smelt --device (default cuda: never fall back to the CPU)")
    ap.add_argument("--warmup", type=int, default=warmup, help=f"untimed runs on every side (default {warmup})")
    ap.add_argument("--iters", type=int, default=iters, help=f"timed runs on every side, at least 20 (default {iters})")
    ap.add_argument("--timeout", type=int, default=300, help="seconds one smelt run may take (default 300)")
    if results:
        ap.add_argument("--results", metavar="PATH", default=RESULTS,
                        help="append one JSON row per result here (default bench/results.jsonl)")
        ap.add_argument("--no-results", action="store_true", help="append no rows")
        ap.add_argument("--commit", help="the commit the rows name (default: git, else $SMELT_COMMIT, else unknown)")


def prepare(ap, opts, cases, default, script):
    """Checks the run count and the smelt binary and returns the cases to
    run (select_cases), or None after a message when the binary is missing."""
    if opts.iters < 20:
        ap.error("--iters must be at least 20 (the acceptance asks for a median of >= 20 runs)")
    selected = select_cases(ap, opts, cases, default)
    if not os.access(opts.smelt, os.X_OK):
        print(f"{script}: {opts.smelt} is not an executable (build first: cmake -S . -B build && "
              f"cmake --build build -j)", file=sys.stderr)
        return None
    return selected


def cuda_torch(script):
    """torch, imported only now (so --help and --list work without it), or
    None after a message when it sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: torch sees no CUDA device", file=sys.stderr)
        return None
    return torch


def select_cases(ap, opts, cases, default):
    """The cases --cases names (an unknown name is a usage error), else those
    `default(case)` keeps."""
    if not opts.cases:
        return [c for c in cases if default(c)]
    names = {c["name"] for c in cases}
    wanted = [s.strip() for s in opts.cases.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in names]
    if unknown:
        ap.error(f"unknown case(s): {', '.join(unknown)} (known: {', '.join(sorted(names))})")
    return [c for c in cases if c["name"] in wanted]


# ---------------------------------------------------------------- smelt


def run_smelt(opts, op, args):
    """Runs `smelt bench <op> <args>` and returns its JSON object (with 'rc',
    'wall_s', 'command'), or raises RuntimeError with the command's own error
    message."""
    cmd = [opts.smelt, "bench", op, *args, "--device", opts.device, "--json"]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"smelt timed out after {opts.timeout} s: {' '.join(cmd)}")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        err = (p.stderr.strip() or p.stdout.strip() or "no output").splitlines()
        raise RuntimeError(f"smelt exited {p.returncode}: {' | '.join(err[-3:])}")
    res = json.loads(lines[-1])
    res["rc"] = p.returncode
    res["wall_s"] = round(time.time() - t0, 2)
    res["command"] = " ".join(cmd[:1] + [a if "," not in a else "<list>" for a in cmd[1:]])
    if p.returncode != 0:
        res["stderr"] = p.stderr.strip()[-2000:]
    return res


# ---------------------------------------------------------------- peers


def rotation_sets(torch, set_bytes, mem_share, cap):
    """How many input sets of set_bytes to rotate through: enough to pass 2x
    L2, at most mem_share of the free memory and at most cap."""
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    free, _ = torch.cuda.mem_get_info()
    return max(1, min(2 * l2 // set_bytes + 1, int(mem_share * free) // set_bytes, cap))


def time_rotated(torch, call, data, opts):
    """Median and min ms of call(set) over the input sets in data, taken in
    turn: one untimed first call (it may compile or autotune), opts.warmup
    more, then opts.iters between CUDA events. Returns (sorted ms, seconds of
    the first call)."""
    sets = len(data)
    t0 = time.time()
    call(data[0])
    torch.cuda.synchronize()
    first_call_s = time.time() - t0
    for i in range(opts.warmup):
        call(data[i % sets])
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(opts.iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(opts.iters)]
    # Keep the GPU busy while Python enqueues the timed calls, so launch
    # overhead between the events is not measured (it would flatter smelt on
    # the short cases).
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(50_000_000)
    for i in range(opts.iters):
        start[i].record()
        call(data[(opts.warmup + i) % sets])
        end[i].record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in zip(start, end)), first_call_s


# ---------------------------------------------------------------- the run's report


def print_kernels(results, width, failed):
    """Which smelt kernel each case ran (failed(r) where none did)."""
    print("\nsmelt kernels:")
    for r in results:
        chk = f" [check {r['check']}]" if r.get("check") else ""
        print(f"  {r['case']:{width}s} {r.get('kernel') or failed(r)}{chk}")


def write_json(opts, torch, record, date, results, **versions):
    """The results (with each case's raw smelt JSON) to --json-out, if given."""
    if not opts.json_out:
        return
    doc = dict(gpu=record.gpu, torch=torch.__version__, cuda=torch.version.cuda, **versions, commit=record.commit,
               date=date, iters=opts.iters, warmup=opts.warmup, results=results)
    with open(opts.json_out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"\nresults written to {opts.json_out}")


# ---------------------------------------------------------------- results file


def ratio_of(smelt, peer, unit):
    """smelt's speed over the peer's: above 1 when smelt is ahead."""
    if not all(isinstance(v, (int, float)) and v > 0 for v in (smelt, peer)):
        return None
    return smelt / peer if unit in RATE_UNITS else peer / smelt


class Recorder:
    """Appends result rows to opts.results (unless opts.no_results), each
    with the run's date, commit and GPU: one JSON object a line with the keys
    date, commit, gpu, op, case, dtype, smelt, peer, peer_value, unit, ratio
    (and note where given). Values are rounded to 4 significant digits."""

    def __init__(self, opts, gpu, commit=None):
        self.path = None if getattr(opts, "no_results", True) else opts.results
        self.gpu, self.commit = gpu, commit or git_commit(getattr(opts, "commit", None))
        self.date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")

    def __call__(self, op, case, dtype, smelt, peer, peer_value, unit, ratio=None, note=None):
        if not self.path or (smelt is None and peer_value is None and ratio is None):
            return
        row = dict(date=self.date, commit=self.commit, gpu=self.gpu, op=op, case=case, dtype=dtype,
                   smelt=sig(smelt), peer=peer, peer_value=sig(peer_value), unit=unit,
                   ratio=sig(ratio if ratio is not None else ratio_of(smelt, peer_value, unit)))
        if note:
            row["note"] = note
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            print(f"could not append to {self.path}: {e}")
            self.path = None


def sig(v, digits=4):
    """v to `digits` significant digits but at least one decimal (None and
    non-numbers unchanged)."""
    if not isinstance(v, (int, float)) or not math.isfinite(v) or v == 0:
        return v
    return round(v, max(1, digits - 1 - int(math.floor(math.log10(abs(v))))))
