#!/usr/bin/env python3
"""smelt conv2d against cuDNN (torch conv2d, channels_last) on one GPU, in one run: issue 24's acceptance table.

For each ResNet-50 layer (batch 64, bf16) and pass (fprop, dgrad, wgrad),
`smelt bench conv2d ... --json` runs in a subprocess (its own CUDA context,
device events, inputs rotated past L2, median of the timed runs), then
torch runs the same pass in this process under the same rules, once with
torch.backends.cudnn.benchmark off (cuDNN's heuristics pick the algorithm)
and once with it on (cuDNN times its algorithms on the first call, which
is not timed): random data, warm-up, CUDA events around every call, median
of the same number of runs, input sets rotated past 2x L2. Tensors are
NCHW with channels_last memory (NHWC, as smelt takes them). The passes are
F.conv2d (fprop) and aten.convolution_backward with only the input's
(dgrad) or the weight's (wgrad) gradient asked for. TFLOP/s on every side
are smelt's count, 2*N*P*Q*K*R*S*C for every pass, over the median time.

Each layer is also reported as a fraction of the GEMM ceiling: `smelt bench
gemm` of the implicit GEMM's M x N x K (smelt/conv2d.h's table: fprop
NPQ x K x RSC, dgrad NHW x C x RSK, wgrad K x RSC x NPQ) with the operand
layouts an explicit im2col would give (RC, RR, CR); the fraction is the
conv's TFLOP/s over the GEMM's.

Bars (acceptance, H100, against cuDNN with benchmark mode on):
  fprop: geometric mean >= 0.9x, no layer below 0.75x
  dgrad and wgrad: geometric mean >= 1.0x, no layer below 0.8x each

Usage (from the repository root, after building build/smelt):
    python3 bench/conv2d_vs_cudnn.py                   # every layer and pass
    python3 bench/conv2d_vs_cudnn.py --quick           # two layers, every pass
    python3 bench/conv2d_vs_cudnn.py --cases r50_14x14x256_3x3_fprop --json-out /tmp/conv.json
    python3 bench/conv2d_vs_cudnn.py --dry-run         # the commands, without a GPU
Each result (smelt against cuDNN benchmark on and off, and against its own
GEMM) is also appended to bench/results.jsonl (--results PATH elsewhere,
--no-results for none), the rows bench/perf_report.py turns into docs/PERF.md.
Exit status: 0 when every case ran and every pass met its bars, 1 otherwise.
"""

import math
import statistics
import sys
import time

import benchlib as bench
from benchlib import fmt

# ---------------------------------------------------------------- cases

BATCH = 64
PASSES = ("fprop", "dgrad", "wgrad")
BARS = {"fprop": (0.9, 0.75), "dgrad": (1.0, 0.8), "wgrad": (1.0, 0.8)}  # (geometric mean, every layer)
PEERS = {"bench": "cuDNN (benchmark)", "heur": "cuDNN (heuristics)"}
GEMM_LAYOUT = {"fprop": "RC", "dgrad": "RR", "wgrad": "CR"}

# ResNet-50's layers: (name, H = W, C, K, R = S, stride, padding, quick).
LAYERS = [
    ("56x56x64_3x3", 56, 64, 64, 3, 1, 1, True),
    ("28x28x128_3x3", 28, 128, 128, 3, 1, 1, False),
    ("56x56x128_3x3s2", 56, 128, 128, 3, 2, 1, True),  # the stride-2 entry to the 28x28 stage
    ("14x14x256_3x3", 14, 256, 256, 3, 1, 1, False),
    ("7x7x512_3x3", 7, 512, 512, 3, 1, 1, False),
    ("56x56x64_1x1_256", 56, 64, 256, 1, 1, 0, False),
    ("224x224x3_7x7s2", 224, 3, 64, 7, 2, 3, False),  # the stem
]


def make_case(layer, pas):
    name, hw, c, k, rs, stride, pad, quick = layer
    pq = (hw + 2 * pad - rs) // stride + 1
    return dict(name=f"r50_{name}_{pas}", layer=name, pass_=pas, n=BATCH, h=hw, w=hw, c=c, k=k, r=rs, s=rs,
                stride=stride, pad=pad, p=pq, q=pq, quick=quick,
                title=f"{pas} {hw}x{hw}x{c}->{k} {rs}x{rs}{f' s{stride}' if stride > 1 else ''}")


CASES = [make_case(layer, pas) for layer in LAYERS for pas in PASSES]


def flops_of(c):
    return 2.0 * c["n"] * c["p"] * c["q"] * c["k"] * c["r"] * c["s"] * c["c"]


def gemm_mnk(c):
    """The implicit GEMM's M, N, K (smelt/conv2d.h)."""
    rs = c["r"] * c["s"]
    return {"fprop": (c["n"] * c["p"] * c["q"], c["k"], rs * c["c"]),
            "dgrad": (c["n"] * c["h"] * c["w"], c["c"], rs * c["k"]),
            "wgrad": (c["k"], rs * c["c"], c["n"] * c["p"] * c["q"])}[c["pass_"]]


# ---------------------------------------------------------------- smelt


def run_counts(opts):
    return ["--warmup", str(opts.warmup), "--iters", str(opts.iters)]


def conv_args(c, opts):
    a = []
    for key in ("n", "h", "w", "c", "k", "r", "s", "stride", "pad"):
        a += [f"--{key}", str(c[key])]
    return a + ["--pass", c["pass_"], "--dtype", "bf16", *run_counts(opts)]


def gemm_args(c, opts):
    m, n, k = gemm_mnk(c)
    return ["--m", str(m), "--n", str(n), "--k", str(k), "--dtype", "bf16", "--layout", GEMM_LAYOUT[c["pass_"]],
            *run_counts(opts)]


def smelt_command(opts, op, args):
    """The command bench.run_smelt runs, as text (for --dry-run)."""
    return " ".join([opts.smelt, "bench", op, *args, "--device", opts.device, "--json"])


# ---------------------------------------------------------------- cuDNN through torch


def torch_call(torch, c):
    """The pass as torch runs it on a set (x, w, dy), NCHW channels_last."""
    F = torch.nn.functional
    stride, pad = [c["stride"]] * 2, [c["pad"]] * 2
    if c["pass_"] == "fprop":
        return lambda s: F.conv2d(s[0], s[1], stride=stride, padding=pad)
    mask = [c["pass_"] == "dgrad", c["pass_"] == "wgrad", False]
    return lambda s: torch.ops.aten.convolution_backward(s[2], s[0], s[1], None, stride, pad, [1, 1], False, [0, 0],
                                                          1, mask)


def time_torch(torch, c, benchmark, opts):
    """Median and min ms of the pass with cudnn.benchmark on or off, over
    input sets rotated past 2x L2."""
    torch.backends.cudnn.benchmark = benchmark
    shapes = ((c["n"], c["c"], c["h"], c["w"]), (c["k"], c["c"], c["r"], c["s"]), (c["n"], c["k"], c["p"], c["q"]))
    sets = bench.rotation_sets(torch, 2 * sum(math.prod(s) for s in shapes), 0.3, 64)

    def make():
        return [torch.empty(s, device="cuda", dtype=torch.bfloat16, memory_format=torch.channels_last).uniform_(-1, 1)
                for s in shapes]

    try:
        data = [make() for _ in range(sets)]
        ms, first_s = bench.time_rotated(torch, torch_call(torch, c), data, opts)
    finally:
        data = None
        torch.backends.cudnn.benchmark = False
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the next smelt process needs the memory
    return dict(median_ms=statistics.median(ms), min_ms=ms[0], sets=sets, first_call_s=first_s)


# ---------------------------------------------------------------- main


def run_case(torch, c, opts):
    r = dict(case=c["name"], title=c["title"], pass_=c["pass_"], flops=flops_of(c), smelt_tflops=None,
             gemm_tflops=None, errors=[], notes=[])
    t0 = time.time()
    for op, args, key in (("conv2d", conv_args(c, opts), "smelt"), ("gemm", gemm_args(c, opts), "gemm")):
        try:
            s = bench.run_smelt(opts, op, args)
            r[key] = s
            r[f"{key}_tflops"] = s.get("tflops")
            if key == "smelt":
                r["kernel"] = s.get("kernel")
            if s["rc"] != 0:
                raise RuntimeError(s.get("stderr") or f"smelt exited {s['rc']}")
        except Exception as e:  # noqa: BLE001 - one case's failure must not stop the table
            # The GEMM is the ceiling, not the acceptance: its failure is a note.
            r[f"{key}_tflops"] = None
            r["errors" if key == "smelt" else "notes"].append(f"smelt {op}: {e}")
    for peer, benchmark in (("heur", False), ("bench", True)):  # heuristics first: benchmark mode caches its picks
        try:
            r[f"{peer}_median_ms"] = time_torch(torch, c, benchmark, opts)["median_ms"]
            r[f"{peer}_tflops"] = r["flops"] / (r[f"{peer}_median_ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001
            r["errors"].append(f"{PEERS[peer]}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    st = r["smelt_tflops"]
    for peer in ("bench", "heur", "gemm"):
        pt = r.get(f"{peer}_tflops")
        r[f"ratio_{peer}"] = st / pt if st and pt else None
    r["wall_s"] = time.time() - t0
    return r


def report_case(record, c, r):
    """Case c's result rows (against cuDNN both ways, and against smelt's
    GEMM) and its progress line."""
    for peer in ("bench", "heur"):
        record("conv2d", c["name"], "bf16", r["smelt_tflops"], PEERS[peer], r.get(f"{peer}_tflops"), "TF/s")
    m, n, k = gemm_mnk(c)
    record("conv2d", c["name"], "bf16", r["smelt_tflops"], "smelt GEMM", r["gemm_tflops"], "TF/s",
           note=f"fraction of smelt's GEMM {m}x{n}x{k} {GEMM_LAYOUT[c['pass_']]}")
    line = (f"{c['name']}: smelt {fmt(r['smelt_tflops'], '.1f')}, cuDNN bench {fmt(r.get('bench_tflops'), '.1f')}, "
            f"heur {fmt(r.get('heur_tflops'), '.1f')}, GEMM {fmt(r['gemm_tflops'], '.1f')} TFLOP/s "
            f"({r['wall_s']:.0f} s)")
    print(line + "".join(f"\n    error: {e}" for e in r["errors"]) + "".join(f"\n    note: {e}" for e in r["notes"]),
          flush=True)


def verdicts(results):
    """Per pass: (geometric mean, lowest ratio, bars, met) against cuDNN
    with benchmark mode on; met is False where a case has no ratio."""
    out = {}
    for pas in PASSES:
        ratios = [r.get("ratio_bench") for r in results if r["pass_"] == pas]
        if not ratios:
            continue
        mean_bar, each_bar = BARS[pas]
        if any(x is None for x in ratios):
            out[pas] = (None, None, BARS[pas], False)
            continue
        gm = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        out[pas] = (gm, min(ratios), BARS[pas], gm >= mean_bar and min(ratios) >= each_bar)
    return out


def list_cases():
    for c in CASES:
        m, n, k = gemm_mnk(c)
        mean_bar, each_bar = BARS[c["pass_"]]
        print(f"{c['name']:32s} {c['title']:34s} GEMM {m}x{n}x{k} {GEMM_LAYOUT[c['pass_']]}  "
              f"bars: mean >= {mean_bar}x, each >= {each_bar}x cuDNN (benchmark){' (quick)' if c['quick'] else ''}")


def dry_run(cases, opts):
    """What a run would do, without running anything."""
    for c in cases:
        print(f"# {c['name']}: {c['title']}, batch {c['n']}, bf16")
        print(smelt_command(opts, "conv2d", conv_args(c, opts)))
        print(smelt_command(opts, "gemm", gemm_args(c, opts)))
        shapes = f"x [{c['n']}, {c['c']}, {c['h']}, {c['w']}], w [{c['k']}, {c['c']}, {c['r']}, {c['s']}], " \
                 f"dy [{c['n']}, {c['k']}, {c['p']}, {c['q']}]"
        call = ("F.conv2d(x, w" if c["pass_"] == "fprop" else "aten.convolution_backward(dy, x, w") + \
               f", stride={c['stride']}, padding={c['pad']})"
        print(f"torch: {call}, channels_last bf16 ({shapes}), cudnn.benchmark off then on, "
              f"{opts.warmup} warm-up + {opts.iters} timed runs\n")
    return 0


def main():
    ap = bench.case_parser(__doc__, CASES, "two layers (56x56x64 3x3 and the stride-2 entry), every pass", "all")
    bench.add_common_args(ap, warmup=5, iters=25)
    ap.add_argument("--dry-run", action="store_true", help="print the commands and torch calls of the cases and exit")
    opts = ap.parse_args()
    if opts.list:
        list_cases()
        return 0
    if opts.dry_run:
        if opts.iters < 20:
            ap.error("--iters must be at least 20 (the acceptance asks for a median of >= 20 runs)")
        return dry_run(bench.select_cases(ap, opts, CASES, lambda c: c["quick"] or not opts.quick), opts)
    cases = bench.prepare(ap, opts, CASES, lambda c: c["quick"] or not opts.quick, "conv2d_vs_cudnn")
    torch = bench.cuda_torch("conv2d_vs_cudnn") if cases is not None else None
    if torch is None:
        return 1
    record = bench.Recorder(opts, torch.cuda.get_device_name(0))
    date = bench.utc_now()
    cudnn_v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"smelt conv2d vs cuDNN {cudnn_v} (torch {torch.__version__}, CUDA {torch.version.cuda}) on {record.gpu}; "
          f"smelt {record.commit}; {date}\nbf16, batch {BATCH}, NHWC (channels_last), median of {opts.iters} timed "
          f"runs after {opts.warmup} warm-up runs on every side, random data, inputs rotated past 2x L2\n")
    results = []
    for c in cases:  # each case's line and rows as soon as it ran
        results.append(run_case(torch, c, opts))
        report_case(record, c, results[-1])

    print()
    hdr = (f"{'case':34s} {'smelt':>7s} {'cuDNN-b':>7s} {'cuDNN-h':>7s} {'GEMM':>7s} {'/bench':>7s} {'/heur':>7s} "
           f"{'/GEMM':>6s}")
    print(hdr + "\n" + "-" * len(hdr))
    for r in results:
        print(f"{r['title']:34s} {fmt(r['smelt_tflops'], '7.1f', 7)} {fmt(r.get('bench_tflops'), '7.1f', 7)} "
              f"{fmt(r.get('heur_tflops'), '7.1f', 7)} {fmt(r['gemm_tflops'], '7.1f', 7)} "
              f"{fmt(r.get('ratio_bench'), '7.3f', 7)} {fmt(r.get('ratio_heur'), '7.3f', 7)} "
              f"{fmt(r.get('ratio_gemm'), '6.2f', 6)}")
    print("(TFLOP/s; ratios are smelt / peer: cuDNN with benchmark mode on and off, and smelt's own GEMM of the "
          "implicit GEMM's M x N x K)")

    print("\nbars against cuDNN (benchmark mode on):")
    verdict = verdicts(results)
    for pas, (gm, lo, (mean_bar, each_bar), met) in verdict.items():
        print(f"  {pas}: geometric mean {fmt(gm, '.3f')} (>= {mean_bar}), lowest {fmt(lo, '.3f')} (>= {each_bar}) "
              f"-> {'pass' if met else 'FAIL'}")

    bench.print_kernels(results, 32, lambda r: "; ".join(r["errors"]))
    bench.write_json(opts, torch, record, date, results, cudnn=cudnn_v)
    ok = results and not any(r["errors"] for r in results) and all(v[3] for v in verdict.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
