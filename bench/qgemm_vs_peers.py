#!/usr/bin/env python3
"""smelt W4A16 (NVFP4 weights x bf16 activations, smelt_qgemm) against smelt's own bf16 GEMV/GEMM and torch's bf16 linear: issue 28's W4A16 table.

Each case is x [M, K] bf16 times an nn.Linear weight W [N, K] (N = K =
8192): smelt with W in NVFP4 (4-bit codes [N, K/2], e4m3 scales [N, K/16],
a tensor scale), smelt's bf16 GEMM on the same shape with bf16 weights
(K-major B: layout RC; its GEMV kernel for M <= 16), and torch's
F.linear(x, W) in bf16. smelt's two sides run through `smelt bench` (device
events, inputs rotated past L2, the copy ceiling measured in the same run);
torch runs here (CUDA events, rotated inputs). Reported: µs, TFLOP/s,
GB/s of the 4-bit weights read (codes and scales) and that rate as % of
the copy bandwidth `smelt bench` measured.

Bars (acceptance, H100): M = 1, 4, 16: >= 3x smelt's bf16 GEMV and the
weights read at >= 80% of copy bandwidth; M = 4096: >= 0.9x smelt's bf16
GEMM.

Usage (from the repository root, after building build/; torch for the
torch column, which is skipped without it):
    python3 bench/qgemm_vs_peers.py
    python3 bench/qgemm_vs_peers.py --quick --results /tmp/qgemm.jsonl
Each result is appended to --results (default bench/results.jsonl;
--no-results for none).
Exit status: 0 when every case ran and met its bars, 1 otherwise.
"""

import statistics
import sys
import time

import benchlib as bench
from benchlib import fmt

N = K = 8192


def case(m, quick=False):
    return dict(name=f"m{m}", m=m, bar=3.0 if m <= 16 else 0.9, quick=quick)


CASES = [case(1, True), case(4), case(16, True), case(4096)]


def weight_bytes():
    return N * K // 2 + N * K // 16


def flops(m):
    return 2.0 * m * N * K


def time_torch(torch, c, opts):
    """Median µs of F.linear(x, W) in bf16 over rotated sets."""
    F = torch.nn.functional
    set_bytes = 2 * (c["m"] * K + N * K + c["m"] * N)
    sets = bench.rotation_sets(torch, set_bytes, 0.3, 8)
    data = [(torch.randn(c["m"], K, device="cuda", dtype=torch.bfloat16),
             torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5) for _ in range(sets)]
    ms, _ = bench.time_rotated(torch, lambda s: F.linear(s[0], s[1]), data, opts)
    del data
    torch.cuda.empty_cache()
    return 1e3 * statistics.median(ms)


def run_case(torch, c, opts):
    r = dict(case=c["name"], m=c["m"], bar=c["bar"], status="ERROR", errors=[])
    t0 = time.time()
    runs = dict(w4=("qgemm", ["--m", str(c["m"]), "--n", str(N), "--k", str(K), "--dtype", "bf16"]),
                bf16=("gemm", ["--m", str(c["m"]), "--n", str(N), "--k", str(K), "--dtype", "bf16", "--layout", "RC"]))
    for side, (op, args) in runs.items():
        try:
            res = bench.run_smelt(opts, op, [*args, "--warmup", str(opts.warmup), "--iters", str(opts.iters)])
            r[f"{side}_us"] = 1e3 * res["median_ms"]
            r[f"{side}_kernel"] = res.get("kernel")
            if side == "w4":
                r["copy_gbps"] = res.get("copy_gbps")
                r["raw"] = res
        except Exception as e:  # noqa: BLE001 - one side's failure must not stop the table
            r["errors"].append(f"smelt {op}: {e}")
    if torch is not None:
        try:
            r["torch_us"] = time_torch(torch, c, opts)
        except Exception as e:  # noqa: BLE001
            r["errors"].append(f"torch: {type(e).__name__}: {e}")
    if r.get("w4_us"):
        r["tflops"] = flops(c["m"]) / (r["w4_us"] * 1e-6) / 1e12
        r["w_gbps"] = weight_bytes() / (r["w4_us"] * 1e-6) / 1e9
        if r.get("copy_gbps"):
            r["pct_copy"] = 100.0 * r["w_gbps"] / r["copy_gbps"]
    if r.get("w4_us") and r.get("bf16_us"):
        r["ratio"] = r["bf16_us"] / r["w4_us"]
        ok = r["ratio"] >= c["bar"] and (c["m"] > 16 or r.get("pct_copy", 0) >= 80.0)
        r["status"] = "pass" if ok else "FAIL"
    r["wall_s"] = time.time() - t0
    return r


def main():
    ap = bench.case_parser(__doc__, CASES, "M = 1 and 16", "all")
    bench.add_common_args(ap, warmup=10, iters=50)
    opts = ap.parse_args()
    if opts.list:
        for c in CASES:
            print(f"{c['name']:6s} M={c['m']} N=K={N}  >= {c['bar']}x smelt bf16{' (quick)' if c['quick'] else ''}")
        return 0
    cases = bench.prepare(ap, opts, CASES, lambda c: c["quick"] or not opts.quick, "qgemm_vs_peers")
    if cases is None:
        return 1
    try:
        torch = bench.cuda_torch("qgemm_vs_peers")
    except ImportError:
        torch = None
    gpu = torch.cuda.get_device_name(0) if torch is not None else "unknown GPU"
    record = bench.Recorder(opts, gpu)
    print(f"smelt W4A16 (nvfp4 x bf16) vs smelt bf16 and torch bf16 linear on {gpu}; smelt {record.commit}; "
          f"{bench.utc_now()}\nN = K = {N}; median of {opts.iters} timed runs after {opts.warmup} warm-up runs, "
          f"inputs rotated past L2\n")
    results = []
    for c in cases:
        r = run_case(torch, c, opts)
        results.append(r)
        peer = "smelt bf16 GEMV" if c["m"] <= 16 else "smelt bf16 GEMM"
        if r.get("w4_us"):
            record("qgemm", c["name"], "nvfp4xbf16", r["w4_us"], peer, r.get("bf16_us"), "us")
            record("qgemm", c["name"], "nvfp4xbf16", r["w4_us"], "torch bf16 linear", r.get("torch_us"), "us")
            record("qgemm", c["name"], "nvfp4xbf16", r.get("pct_copy"), "copy bandwidth (weights read)", 100.0, "%")
        print(f"{c['name']}: W4A16 {fmt(r.get('w4_us'), '.1f')} µs, bf16 {fmt(r.get('bf16_us'), '.1f')}, "
              f"torch {fmt(r.get('torch_us'), '.1f')} -> {r['status']} ({r['wall_s']:.0f} s)"
              + "".join(f"\n    error: {e}" for e in r["errors"]), flush=True)
    print()
    hdr = (f"{'case':6s} {'W4A16 µs':>9s} {'TF/s':>6s} {'W GB/s':>7s} {'% copy':>7s} {'bf16 µs':>8s} "
           f"{'torch µs':>9s} {'x bf16':>7s} {'bar':>5s} result")
    print(hdr + "\n" + "-" * len(hdr))
    for r in results:
        print(f"{r['case']:6s} {fmt(r.get('w4_us'), '9.1f', 9)} {fmt(r.get('tflops'), '6.1f', 6)} "
              f"{fmt(r.get('w_gbps'), '7.0f', 7)} {fmt(r.get('pct_copy'), '7.1f', 7)} {fmt(r.get('bf16_us'), '8.1f', 8)} "
              f"{fmt(r.get('torch_us'), '9.1f', 9)} {fmt(r.get('ratio'), '7.2f', 7)} {r['bar']:5.2f} {r['status']}")
    print("(x bf16: smelt bf16's time over W4A16's; W GB/s: 4-bit codes + scales read; % copy: of the d2d copy)")
    print("\nsmelt kernels:")
    for r in results:
        print(f"  {r['case']:6s} W4A16: {r.get('w4_kernel') or '-'}\n  {'':6s} bf16:  {r.get('bf16_kernel') or '-'}")
    if torch is not None:
        bench.write_json(opts, torch, record, bench.utc_now(), results)
    return 0 if results and all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
