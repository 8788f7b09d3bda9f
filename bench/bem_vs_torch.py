#!/usr/bin/env python3
"""smelt's BEM update against torch eager on one GPU, in one run: issue 23's acceptance table.

ΔY = s·((X·V)∘codes)·Uᵀ, X [M, d_in], V [d_in, r], codes [M, r], U [d_out, r],
s = 2 (alpha 32 over rank 16; the same s at every rank). Both sides run in
this process on torch tensors (smelt through its Python binding, on
torch's current stream), timed with CUDA events over input sets rotated
past 2x L2 (benchlib.time_rotated: X, codes, the output and dy rotate; V,
U and the base weight W are one copy, as a layer's weights are), medians of
the timed runs, after one checked run (smelt against torch in float64; a
case beyond the dtype's bound is reported as failed rather than timed).

  update     smelt.bem_update against torch eager's update as PEFT-style
             code writes it: A = X @ V, H = A * codes * s (on [M, r]),
             ΔY = H @ U.T (three launches, A and H in memory). GB/s count
             the bytes of X, codes, V, U and ΔY once; copy is torch's device
             copy of the same number of bytes, measured in the same run.
  fused      the layer Y = X·Wᵀ + ΔY against smelt's own plain base GEMM
             X·Wᵀ (W [d_out, d_in], smelt.gemm with B = Wᵀ as a view), and
             against torch (F.linear, then the eager update added in place).
             TODAY SMELT'S "FUSED" FORM IS TWO LAUNCHES: smelt.gemm, then
             smelt.bem_update(accumulate=True) into its output. The one-launch
             fusion into the GEMM (issue 23) is not built; the overhead shown
             is what that fusion has to beat.
  adapters   the fused form with A adapters over equal row segments
             (Punica-style offsets on the device), against the base GEMM;
             torch's eager form is a host loop over the segments.
  backward   smelt.bem_backward (dx, dV, dU, dcodes; composed of GEMMs and
             Hadamard passes on CUDA) against torch eager autograd of the
             update (torch.autograd.grad over the retained graph of X, V,
             codes and U; the forward is outside the timing on both sides).
  errors     max abs, max rel (max abs / max |ref|) and relative L2 error of
             smelt and of torch eager against a float64 reference on the same
             inputs: X and codes ~ N(0, 1), V ~ N(0, 1/d_in), U ~ N(0, 1/r),
             s = 2, rounded to the dtype.

Bars (issue 23, H100): update M16384 d4096 r16 >= 85% of copy bandwidth and
>= 2x torch eager; M16384 d768 r8 >= 2.5x torch eager; fused overhead over
the base GEMM <= 5% at d4096 r16 and <= 10% at d768 r8, and the layer >=
1.3x torch's; 16 adapters of rank 16 over M16384 d4096: overhead <= 10%;
backward >= 2x torch eager autograd; errors no worse than torch eager's
(within 5%).

Usage (from the repository root, after python/build_inplace.py --lib build):
    PYTHONPATH=python python3 bench/bem_vs_torch.py                  # every case, f16 and bf16
    PYTHONPATH=python python3 bench/bem_vs_torch.py --quick          # the d4096 r16 cases, bf16
    PYTHONPATH=python python3 bench/bem_vs_torch.py --cases update_d4096_r16 --dtypes f16
    python3 bench/bem_vs_torch.py --dry-run                          # what would run, without a GPU
Each result is appended to bench/results.jsonl as rows of op "bem"
(--results PATH elsewhere, --no-results for none). Exit status: 0 when every
case ran, passed its check and met its bars, 1 otherwise.
"""

import gc
import sys

import benchlib as bench
from benchlib import fmt

SCALE = 2.0
DTYPES = {"f16": "float16", "bf16": "bfloat16"}
# ‖smelt − torch‖ / ‖torch‖ of the checked run (both round H to the input type).
CHECK = {"f16": 4e-3, "bf16": 3e-2}
FUSED_NOTE = "smelt.gemm then smelt.bem_update(accumulate=True): two launches, the one-launch fusion is not built"


def case(name, kind, m, d, r, bars, adapters=0, quick=False):
    return dict(name=name, kind=kind, m=m, d=d, r=r, adapters=adapters, bars=bars, quick=quick,
                title=f"M{m} d{d} r{r}" + (f" A{adapters}" if adapters else ""))


# bars: pct_of_copy (%), vs_torch (x), overhead_pct (%, at most), error_ratio (smelt / torch, at most).
CASES = [
    case("update_d4096_r16", "update", 16384, 4096, 16, {"pct_of_copy": 85.0, "vs_torch": 2.0}, quick=True),
    case("update_d768_r8", "update", 16384, 768, 8, {"vs_torch": 2.5}),
    case("fused_d4096_r16", "fused", 16384, 4096, 16, {"overhead_pct": 5.0, "vs_torch": 1.3}, quick=True),
    case("fused_d768_r8", "fused", 16384, 768, 8, {"overhead_pct": 10.0, "vs_torch": 1.3}),
    case("adapters16_d4096_r16", "fused", 16384, 4096, 16, {"overhead_pct": 10.0}, adapters=16, quick=True),
    case("backward_d4096_r16", "backward", 16384, 4096, 16, {"vs_torch": 2.0}, quick=True),
    case("errors_d4096_r16", "errors", 16384, 4096, 16, {"error_ratio": 1.05}, quick=True),
]


def traffic_bytes(c, esize):
    """Bytes the update moves once: X, codes and ΔY per row, V and U once."""
    A = max(1, c["adapters"])
    return (c["m"] * (2 * c["d"] + c["r"]) + 2 * A * c["d"] * c["r"]) * esize


# ---------------------------------------------------------------- inputs


def weights(torch, c, dtype):
    """V, U (A of each with adapters) and the base W [d, d], seeded."""
    g = torch.Generator(device="cuda")
    g.manual_seed(2300)
    d, r, A = c["d"], c["r"], c["adapters"]
    w = (A,) if A else ()
    v = (torch.randn(w + (d, r), generator=g, device="cuda") * d ** -0.5).to(dtype)
    u = (torch.randn(w + (d, r), generator=g, device="cuda") * r ** -0.5).to(dtype)
    base = (torch.randn((d, d), generator=g, device="cuda") * d ** -0.5).to(dtype)
    return v, u, base


def make_sets(torch, c, dtype, per_set, with_dy=False):
    """Input sets of X and codes (and dy), enough to pass 2x L2."""
    M, d, r = c["m"], c["d"], c["r"]
    sets = bench.rotation_sets(torch, per_set, 0.3, 8)
    g = torch.Generator(device="cuda")
    g.manual_seed(2301)
    out = []
    for _ in range(sets):
        s = dict(x=torch.randn((M, d), generator=g, device="cuda").to(dtype),
                 codes=torch.randn((M, r), generator=g, device="cuda").to(dtype))
        if with_dy:
            s["dy"] = torch.randn((M, d), generator=g, device="cuda").to(dtype)
        out.append(s)
    return out


def segment_offsets(torch, c):
    A, M = c["adapters"], c["m"]
    return torch.tensor([a * M // A for a in range(A + 1)], dtype=torch.int64, device="cuda")


# ---------------------------------------------------------------- the two sides


def torch_update(x, v, codes, u):
    """torch eager's update: A = X @ V, H = A * codes * s, ΔY = H @ U.T."""
    return ((x @ v) * codes * SCALE) @ u.T


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def timed(torch, call, data, opts):
    ms, _ = bench.time_rotated(torch, call, data, opts)
    return ms[len(ms) // 2]


def copy_gbps(torch, nbytes, opts):
    """GB/s of torch's device copy moving nbytes (half read, half written)."""
    half = max(1, nbytes // 2)
    src = [torch.empty(half, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    ms = timed(torch, lambda i: dst[i].copy_(src[i]), [0, 1], opts)
    del src, dst
    return 2 * half / (ms * 1e-3) / 1e9


def forward_inputs(torch, c, dt):
    """The weights (V, U, W), the element size and the input sets, each with
    an output y of its own, of a forward case."""
    dtype = getattr(torch, DTYPES[dt])
    esize = torch.empty((), dtype=dtype).element_size()
    data = make_sets(torch, c, dtype, c["m"] * (2 * c["d"] + c["r"]) * esize)
    for s in data:
        s["y"] = torch.empty((c["m"], c["d"]), dtype=dtype, device="cuda")
    return weights(torch, c, dtype), esize, data


def run_update(torch, smelt, c, dt, opts, r):
    (v, u, _), esize, data = forward_inputs(torch, c, dt)

    def ours(s):
        return smelt.bem_update(s["x"], v, s["codes"], u, scale=SCALE, out=s["y"])

    def theirs(s):
        return torch_update(s["x"], v, s["codes"], u)

    r["check"] = rel_err(ours(data[0]), theirs(data[0]))
    if not r["check"] <= CHECK[dt]:
        raise RuntimeError(f"smelt differs from torch: rel err {r['check']:.3g}")
    r["smelt_ms"], r["torch_ms"] = timed(torch, ours, data, opts), timed(torch, theirs, data, opts)
    nbytes = traffic_bytes(c, esize)
    r["copy_gbps"] = copy_gbps(torch, nbytes, opts)
    r["smelt_gbps"] = nbytes / (r["smelt_ms"] * 1e-3) / 1e9
    r["pct_of_copy"] = 100.0 * r["smelt_gbps"] / r["copy_gbps"]
    r["vs_torch"] = bench.ratio_of(r["smelt_ms"], r["torch_ms"], "ms")


def run_fused(torch, smelt, c, dt, opts, r):
    F = torch.nn.functional
    (v, u, w), _, data = forward_inputs(torch, c, dt)
    offsets = segment_offsets(torch, c) if c["adapters"] else None
    bounds = [int(o) for o in offsets.cpu()] if offsets is not None else None

    def base(s):
        return smelt.gemm(s["x"], w.T, out=s["y"])

    def ours(s):
        y = smelt.gemm(s["x"], w.T, out=s["y"])
        return smelt.bem_update(s["x"], v, s["codes"], u, scale=SCALE, offsets=offsets, accumulate=True, out=y)

    def theirs(s):
        x, codes = s["x"], s["codes"]
        y = F.linear(x, w)
        if bounds is None:
            return y.add_(((x @ v) * codes) @ u.T, alpha=SCALE)
        for a in range(c["adapters"]):  # Punica-style segments, host-known bounds
            lo, hi = bounds[a], bounds[a + 1]
            y[lo:hi].add_(((x[lo:hi] @ v[a]) * codes[lo:hi]) @ u[a].T, alpha=SCALE)
        return y

    r["check"] = rel_err(ours(data[0]), theirs(data[0]))
    if not r["check"] <= CHECK[dt]:
        raise RuntimeError(f"smelt differs from torch: rel err {r['check']:.3g}")
    r["base_ms"] = timed(torch, base, data, opts)
    r["smelt_ms"], r["torch_ms"] = timed(torch, ours, data, opts), timed(torch, theirs, data, opts)
    r["overhead_pct"] = 100.0 * (r["smelt_ms"] - r["base_ms"]) / r["base_ms"]
    r["vs_torch"] = bench.ratio_of(r["smelt_ms"], r["torch_ms"], "ms")


def run_backward(torch, smelt, c, dt, opts, r):
    dtype = getattr(torch, DTYPES[dt])
    esize = torch.empty((), dtype=dtype).element_size()
    v, u, _ = weights(torch, c, dtype)
    data = make_sets(torch, c, dtype, c["m"] * (3 * c["d"] + 2 * c["r"]) * esize, with_dy=True)
    leaves_w = [v.clone().requires_grad_(), u.clone().requires_grad_()]
    for s in data:  # torch's graph of each set, retained across the timed backward runs
        s["xl"], s["cl"] = s["x"].clone().requires_grad_(), s["codes"].clone().requires_grad_()
        s["leaves"] = [s["xl"], leaves_w[0], s["cl"], leaves_w[1]]
        s["graph"] = torch_update(s["xl"], leaves_w[0], s["cl"], leaves_w[1])

    def ours(s):
        return smelt.bem_backward(s["dy"], s["x"], v, s["codes"], u, scale=SCALE)

    def theirs(s):
        return torch.autograd.grad(s["graph"], s["leaves"], s["dy"], retain_graph=True)

    got, want = ours(data[0]), theirs(data[0])
    r["check"] = max(rel_err(got[n], t) for n, t in zip(("dx", "dv", "dcodes", "du"), want))
    if not r["check"] <= 2 * CHECK[dt]:  # the composed backward keeps [M, r] intermediates in the input type
        raise RuntimeError(f"smelt's gradients differ from torch's: rel err {r['check']:.3g}")
    del got, want
    r["smelt_ms"], r["torch_ms"] = timed(torch, ours, data, opts), timed(torch, theirs, data, opts)
    r["vs_torch"] = bench.ratio_of(r["smelt_ms"], r["torch_ms"], "ms")


def run_errors(torch, smelt, c, dt, opts, r):
    dtype = getattr(torch, DTYPES[dt])
    v, u, _ = weights(torch, c, dtype)
    s = make_sets(torch, c, dtype, 1 << 40)[0]  # one set: nothing is timed
    x, codes = s["x"], s["codes"]
    ref = SCALE * ((x.double() @ v.double()) * codes.double()) @ u.double().T
    for side, y in (("smelt", smelt.bem_update(x, v, codes, u, scale=SCALE)), ("torch", torch_update(x, v, codes, u))):
        diff = (y.double() - ref).abs()
        r[f"{side}_max_abs"] = diff.max().item()
        r[f"{side}_max_rel"] = r[f"{side}_max_abs"] / ref.abs().max().item()
        r[f"{side}_rel_l2"] = (diff.norm() / ref.norm()).item()
        del y, diff
    r["ref_max"] = ref.abs().max().item()
    r["error_ratio"] = max(r["smelt_max_rel"] / r["torch_max_rel"], r["smelt_rel_l2"] / r["torch_rel_l2"])


RUNNERS = {"update": run_update, "fused": run_fused, "backward": run_backward, "errors": run_errors}


def met_bars(c, r):
    met = {}
    for bar, v in c["bars"].items():
        got = r.get(bar)
        at_most = bar in ("overhead_pct", "error_ratio")
        met[bar] = got is not None and (got <= v if at_most else got >= v)
    return met


# ---------------------------------------------------------------- report


def report(record, c, dt, r):
    t = f"{c['name']} {dt}"
    if r.get("error"):
        print(f"{t:30s} FAILED: {r['error']}", flush=True)
        return
    k = c["kind"]
    if k == "errors":
        print(f"{t:30s} vs f64 (|ref| max {r['ref_max']:.3g}): smelt max abs {r['smelt_max_abs']:.3g}, max rel "
              f"{r['smelt_max_rel']:.3g}, rel L2 {r['smelt_rel_l2']:.3g} | torch eager max abs {r['torch_max_abs']:.3g}"
              f", max rel {r['torch_max_rel']:.3g}, rel L2 {r['torch_rel_l2']:.3g}", flush=True)
        record("bem", f"error {c['title']}", dt, r["smelt_rel_l2"], "torch eager", r["torch_rel_l2"], "rel L2",
               note="X, codes ~ N(0,1), V ~ N(0,1/d_in), U ~ N(0,1/r), s = 2; vs float64")
        record("bem", f"error {c['title']}", dt, r["smelt_max_rel"], "torch eager", r["torch_max_rel"], "max rel",
               note="max abs / max |ref|")
        return
    line = (f"{t:30s} smelt {fmt(r.get('smelt_ms'), '8.4f', 8)} ms | torch {fmt(r.get('torch_ms'), '8.4f', 8)} ms "
            f"({fmt(r.get('vs_torch'), '.2f')}x)")
    if k == "update":
        line += (f" | {fmt(r.get('smelt_gbps'), '.0f')} GB/s = {fmt(r.get('pct_of_copy'), '.1f')}% of copy "
                 f"({fmt(r.get('copy_gbps'), '.0f')} GB/s)")
        record("bem", f"update {c['title']}", dt, r["smelt_ms"], "torch eager", r["torch_ms"], "ms")
        record("bem", f"update {c['title']}", dt, r["smelt_gbps"], "device copy", r["copy_gbps"], "GB/s")
    elif k == "fused":
        line += f" | base GEMM {fmt(r.get('base_ms'), '.4f')} ms, overhead {fmt(r.get('overhead_pct'), '.1f')}%"
        label = f"{'adapters' if c['adapters'] else 'base+update'} {c['title']}"
        record("bem", label, dt, r["smelt_ms"], "smelt base GEMM", r["base_ms"], "ms",
               note=f"overhead {r['overhead_pct']:.1f}%; {FUSED_NOTE}")
        record("bem", label, dt, r["smelt_ms"], "torch linear + eager update" + (" (segment loop)" if c["adapters"]
                                                                                  else ""), r["torch_ms"], "ms",
               note=FUSED_NOTE)
    else:
        record("bem", f"backward {c['title']}", dt, r["smelt_ms"], "torch eager autograd", r["torch_ms"], "ms")
    print(line + f" | check {r['check']:.2e}", flush=True)


# ---------------------------------------------------------------- main


def list_cases():
    for c in CASES:
        bars = ", ".join(f"{k} {'<=' if k in ('overhead_pct', 'error_ratio') else '>='} {v}" for k, v in c["bars"].items())
        print(f"{c['name']:22s} {c['kind']:9s} {c['title']:22s} bars: {bars}{' (quick)' if c['quick'] else ''}")


def dry_run(cases, dtypes, opts):
    """What a run would do, without running anything."""
    for c in cases:
        M, d, r, A = c["m"], c["d"], c["r"], c["adapters"]
        v = f"[{A}, {d}, {r}]" if A else f"[{d}, {r}]"
        steps = {
            "update": [f"smelt.bem_update(x [{M}, {d}], v {v}, codes [{M}, {r}], u {v}, scale={SCALE}, out=y)",
                       "torch eager: ((x @ v) * codes * s) @ u.T",
                       f"device copy of {traffic_bytes(c, 2)} bytes (16-bit) for the share of copy bandwidth"],
            "fused": [f"smelt base: smelt.gemm(x [{M}, {d}], W.T [{d}, {d}], out=y)",
                      "smelt layer: smelt.gemm(...) then smelt.bem_update(..., " +
                      (f"offsets [{A + 1}] (equal segments), " if A else "") + f"accumulate=True, out=y)  ({FUSED_NOTE})",
                      "torch: F.linear(x, W) then .add_(((x @ v) * codes) @ u.T, alpha=s)" +
                      (f" for each of {A} segments (host loop)" if A else "")],
            "backward": [f"smelt.bem_backward(dy [{M}, {d}], x, v, codes, u, scale={SCALE}) -> dx, dv, du, dcodes",
                         "torch eager autograd: torch.autograd.grad(retained update graph, (x, v, codes, u), dy)"],
            "errors": [f"smelt.bem_update and torch eager on x, codes ~ N(0,1), V ~ N(0,1/{d}), U ~ N(0,1/{r}), "
                       f"s = {SCALE}, against float64: max abs, max rel, rel L2"],
        }[c["kind"]]
        print(f"# {c['name']}: {c['title']}, {', '.join(dtypes)}; {opts.warmup} warm-up + {opts.iters} timed runs")
        print("\n".join(steps), end="\n\n")
    return 0


def main():
    ap = bench.case_parser(__doc__, CASES, "the d4096 r16 cases, bf16", "every case")
    ap.add_argument("--dry-run", action="store_true", help="print what each case runs and exit (no GPU, no torch)")
    ap.add_argument("--dtypes", help="comma-separated, of f16 and bf16 (default both; --quick: bf16)")
    bench.add_common_args(ap, warmup=10, iters=50)
    opts = ap.parse_args()
    dtypes = [s.strip() for s in (opts.dtypes or ("bf16" if opts.quick else "f16,bf16")).split(",") if s.strip()]
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        ap.error(f"unknown dtype(s): {', '.join(bad)} (known: f16, bf16)")

    def default(c):
        return c["quick"] or not opts.quick

    if opts.list:
        return list_cases() or 0
    if opts.iters < 20:
        ap.error("--iters must be at least 20 (the acceptance asks for a median of >= 20 runs)")
    cases = bench.select_cases(ap, opts, CASES, default)
    if opts.dry_run:  # needs no GPU, torch or smelt
        return dry_run(cases, dtypes, opts)
    torch = bench.cuda_torch("bem_vs_torch")
    if torch is None:
        return 1
    import smelt

    record, date = bench.Recorder(opts, torch.cuda.get_device_name(0)), bench.utc_now()
    print("\n".join([f"smelt BEM vs torch {torch.__version__} (CUDA {torch.version.cuda}) on {record.gpu}; smelt "
                     f"{record.commit}; {date}",
                     f"median of {opts.iters} timed runs after {opts.warmup} warm-up runs on every side, s = {SCALE},"
                     " inputs rotated past 2x L2", f"note: the fused rows are {FUSED_NOTE}", ""]))
    results = []
    for c in cases:
        for dt in dtypes:
            r = dict(case=c["name"], title=c["title"], dtype=dt)
            try:
                RUNNERS[c["kind"]](torch, smelt, c, dt, opts, r)
            except Exception as e:  # one case's failure must not hide the others
                r["error"] = f"{type(e).__name__}: {e}"
            r["met"] = {} if r.get("error") else met_bars(c, r)
            results.append(r)
            report(record, c, dt, r)
            gc.collect()
            torch.cuda.empty_cache()

    print("\nbars:")
    for r in results:
        c = next(x for x in CASES if x["name"] == r["case"])
        for bar, v in c["bars"].items():
            sign = "<=" if bar in ("overhead_pct", "error_ratio") else ">="
            unit = "%" if bar in ("pct_of_copy", "overhead_pct") else "x"
            state = "pass" if r["met"].get(bar) else "FAIL"
            print(f"  {r['case']:22s} {r['dtype']:4s} {bar:12s} {fmt(r.get(bar), '.2f')}{unit} ({sign} {v}{unit}) -> "
                  f"{state}")
    bench.write_json(opts, torch, record, date, results)
    ok = results and not any(r.get("error") for r in results) and all(all(r["met"].values()) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
