#!/usr/bin/env python3
"""smelt's block-scaled fp8 GEMM against torch._scaled_mm on one GPU: issue 28's rows.

Each case quantizes random bf16 operands the way smelt's quantizers do
(scale = amax / 448 per block: A [M, K] in 1 x 128 blocks, the weight W [N,
K] in 128 x 128 blocks; the row-wise peer gets per-row and per-column
scales of the same data), then times, in this process, with CUDA events
around every call, median of the timed runs, input sets rotated past 2x L2:
  smelt    smelt.gemm(a, w.T, scale_a, scale_b, format='fp8-block') -> bf16
  rowwise  torch._scaled_mm(a, w.T, scale_a [M, 1], scale_b [1, N]) -> bf16
           (cuBLASLt; does less work: one scale a row and column)
  blockwise torch._scaled_mm with scale_a [M, K/128] and scale_b [K/128,
           N/128], where this torch's cuBLASLt takes them (else reported as
           not available)
  smelt rowwise  smelt.gemm with the row and column scales (its fp8 kernel
           without promotion), for reference
TFLOP/s are 2 M N K over the median time. Bars: smelt >= 1.0x torch's
row-wise rate on every case, and >= 1,200 TFLOP/s at 8192^3. Grouped by
offsets (8 groups of 1024 x 14336 x 4096, smelt.gemm_grouped): >= 1,100
TFLOP/s, beside torch._scaled_grouped_mm row-wise (or a loop of
torch._scaled_mm where this torch lacks it).

The error rows (--cases error): M = N = 2048, K = 16384, activations with
per-block magnitudes over 2^12 (outliers); relative L2 error against the
f64 product of the unquantized operands, for smelt's block-scaled GEMM (f32
D) and for the same quantized operands dequantized and multiplied in f32
(cuBLAS, TF32 off). Bar: smelt's error <= 1.5x the dequantized product's
(the promotion every 128 of K keeps the fp8 tensor cores' short sums from
adding error). Also printed: both against the f64 product of the
dequantized operands (the accumulation error alone).

Usage (from the repository root, after building the Python binding:
python3 python/build_inplace.py --lib build):
    PYTHONPATH=python python3 bench/fp8_vs_peers.py
    PYTHONPATH=python python3 bench/fp8_vs_peers.py --cases e4m3_block_8192
Each result is appended to bench/results.jsonl (--results PATH elsewhere,
--no-results for none). Exit status: 0 when every case ran and met its bar.
"""

import sys

import benchlib as bench
from benchlib import fmt

CASES = [
    dict(name="e4m3_block_8192", title="fp8 block 8192^3", m=8192, n=8192, k=8192, floor=1200.0, quick=True),
    dict(name="e4m3_block_deepseek", title="fp8 block 4096x7168x16384", m=4096, n=7168, k=16384, floor=None,
         quick=False),
    dict(name="e4m3_block_grouped", title="fp8 block grouped 8 x 1024x14336x4096", m=1024, n=14336, k=4096, groups=8,
         floor=1100.0, quick=False),
    dict(name="error", title="fp8 block error, 2048x2048x16384", m=2048, n=2048, k=16384, floor=None, quick=True),
]


def quantize(torch, x, rows):
    """x [R, K] -> (e4m3 [R, K], f32 scales [ceil(R/rows), ceil(K/128)]), scale = amax / 448 per block."""
    r, k = x.shape
    rb, kb = -(-r // rows), -(-k // 128)
    xp = torch.nn.functional.pad(x.float(), (0, kb * 128 - k, 0, rb * rows - r))
    amax = xp.abs().view(rb, rows, kb, 128).amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (xp.view(rb, rows, kb, 128) / s[:, None, :, None]).view(rb * rows, kb * 128)[:r, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), s.contiguous()


def dequantize(torch, q, s, rows):
    r, k = q.shape
    return q.double() * s.double().repeat_interleave(rows, 0)[:r].repeat_interleave(128, 1)[:, :k]


def operands(torch, m, n, k, outliers=False):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    if outliers:
        # Block magnitudes over 2^12 along K, different on every row.
        e = torch.randint(-6, 7, (m, -(-k // 128)), device="cuda").repeat_interleave(128, 1)[:, :k]
        a = (a.float() * torch.pow(2.0, e.float())).to(torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qa, sa = quantize(torch, a, 1)
    qw, sw = quantize(torch, w, 128)
    ra = (a.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-30)
    rw = (w.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-30)
    return dict(a=a, w=w, qa=qa, sa=sa, qw=qw, sw=sw, ra=ra, rw=rw,
                rqa=(a.float() / ra).to(torch.float8_e4m3fn), rqw=(w.float() / rw).to(torch.float8_e4m3fn))


def timed(torch, call, sets, opts):
    ms, _ = bench.time_rotated(torch, call, sets, opts)
    return ms[len(ms) // 2]


def speed_case(torch, smelt, c, opts, record):
    m, n, k = c["m"], c["n"], c["k"]
    flops = 2.0 * m * n * k
    set_bytes = (m + n) * k + m * n * 2
    count = bench.rotation_sets(torch, set_bytes, 0.5, 8)
    sets = [operands(torch, m, n, k) for _ in range(count)]
    for s in sets:
        s["d"] = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def smelt_block(s):
        smelt.gemm(s["qa"], s["qw"].t(), out=s["d"], scale_a=s["sa"], scale_b=s["sw"], format="fp8-block")

    def smelt_row(s):
        smelt.gemm(s["rqa"], s["rqw"].t(), out=s["d"], scale_a=s["ra"], scale_b=s["rw"].t())

    def torch_row(s):
        torch._scaled_mm(s["rqa"], s["rqw"].t(), scale_a=s["ra"], scale_b=s["rw"].t(), out_dtype=torch.bfloat16)

    def torch_block(s):
        torch._scaled_mm(s["qa"], s["qw"].t(), scale_a=s["sa"], scale_b=s["sw"].t(), out_dtype=torch.bfloat16)

    rates = {}
    for label, call in (("smelt fp8-block", smelt_block), ("torch._scaled_mm rowwise", torch_row),
                        ("torch._scaled_mm blockwise", torch_block), ("smelt rowwise", smelt_row)):
        try:
            rates[label] = flops / (timed(torch, call, sets, opts) * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - a peer this torch lacks is reported, not fatal
            rates[label] = None
            print(f"  {label}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    mine, row = rates["smelt fp8-block"], rates["torch._scaled_mm rowwise"]
    ok = mine is not None and row is not None and mine >= row and (c["floor"] is None or mine >= c["floor"])
    for label, v in rates.items():
        if label != "smelt fp8-block" and v is not None:
            record("gemm", c["name"], "fp8-block", mine, label, v, "TF/s")
    floor = "" if c["floor"] is None else f", floor {c['floor']:.0f}"
    print(f"{c['title']}: " + ", ".join(f"{k} {fmt(v, '.1f')}" for k, v in rates.items()) +
          f" TFLOP/s; ratio to row-wise {fmt(mine / row if mine and row else None, '.3f')}{floor}"
          f" -> {'pass' if ok else 'FAIL'}")
    return ok


def grouped_case(torch, smelt, c, opts, record):
    """G groups of m rows by offsets (the MoE form) against torch's grouped
    row-wise fp8 GEMM where this torch has one, else a loop of row-wise
    torch._scaled_mm calls, one a group."""
    g, m, n, k = c["groups"], c["m"], c["n"], c["k"]
    flops = 2.0 * g * m * n * k
    s = operands(torch, g * m, n, k)
    ws = [operands(torch, 1, n, k) for _ in range(g)]
    qw = torch.stack([w["qw"] for w in ws])  # [G, N, K]
    sw = torch.stack([w["sw"] for w in ws])  # [G, N/128, K/128]
    rqw = torch.stack([w["rqw"] for w in ws])
    rw = torch.stack([w["rw"][:, 0] for w in ws])  # [G, N]
    offs = torch.arange(1, g + 1, device="cuda", dtype=torch.int32) * m
    d = torch.empty(g * m, n, device="cuda", dtype=torch.bfloat16)
    sets = [None]

    def smelt_block(_):
        smelt.gemm_grouped(s["qa"], qw.transpose(1, 2), offs, out=d, scale_a=s["sa"], scale_b=sw, format="fp8-block")

    def torch_grouped(_):
        torch._scaled_grouped_mm(s["rqa"], rqw.transpose(1, 2), s["ra"][:, 0], rw, offs=offs, out_dtype=torch.bfloat16)

    def torch_loop(_):
        for i in range(g):
            torch._scaled_mm(s["rqa"][i * m:(i + 1) * m], rqw[i].t(), scale_a=s["ra"][i * m:(i + 1) * m],
                             scale_b=rw[i][None, :], out_dtype=torch.bfloat16)

    rates = {}
    for label, call in (("smelt fp8-block grouped", smelt_block), ("torch._scaled_grouped_mm rowwise", torch_grouped),
                        ("torch._scaled_mm rowwise loop", torch_loop)):
        try:
            rates[label] = flops / (timed(torch, call, sets, opts) * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001 - a peer this torch lacks is reported, not fatal
            rates[label] = None
            print(f"  {label}: not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})")
    mine = rates["smelt fp8-block grouped"]
    ok = mine is not None and mine >= c["floor"]
    for label, v in rates.items():
        if label != "smelt fp8-block grouped" and v is not None:
            record("gemm", c["name"], "fp8-block", mine, label, v, "TF/s")
    print(f"{c['title']}: " + ", ".join(f"{k} {fmt(v, '.1f')}" for k, v in rates.items()) +
          f" TFLOP/s; floor {c['floor']:.0f} -> {'pass' if ok else 'FAIL'}")
    return ok


def rel(torch, got, ref):
    return (torch.linalg.norm(got.double() - ref) / torch.linalg.norm(ref)).item()


def error_case(torch, smelt, c, record):
    m, n, k = c["m"], c["n"], c["k"]
    s = operands(torch, m, n, k, outliers=True)
    exact = s["a"].double() @ s["w"].double().t()
    da, dw = dequantize(torch, s["qa"], s["sa"], 1), dequantize(torch, s["qw"], s["sw"], 128)
    deq64 = da @ dw.t()
    d = torch.empty(m, n, device="cuda", dtype=torch.float32)
    smelt.gemm(s["qa"], s["qw"].t(), out=d, scale_a=s["sa"], scale_b=s["sw"], format="fp8-block")
    torch.backends.cuda.matmul.allow_tf32 = False
    f32 = da.float() @ dw.float().t()
    e_smelt, e_f32 = rel(torch, d, exact), rel(torch, f32, exact)
    a_smelt, a_f32 = rel(torch, d, deq64), rel(torch, f32, deq64)
    ok = e_smelt <= 1.5 * e_f32
    record("gemm", c["name"], "fp8-block", e_smelt, "dequantized f32 product", e_f32, "rel err")
    print(f"{c['title']}: rel L2 error vs the f64 product of the inputs: smelt {e_smelt:.3e}, dequantized in f32 "
          f"{e_f32:.3e} (ratio {e_smelt / e_f32:.3f}, bar 1.5); vs the dequantized f64 product (accumulation "
          f"alone): smelt {a_smelt:.3e}, f32 {a_f32:.3e} -> {'pass' if ok else 'FAIL'}")
    return ok


def main():
    ap = bench.case_parser(__doc__, CASES, "the 8192^3 and error cases", "all")
    bench.add_common_args(ap, warmup=10, iters=50)
    opts = ap.parse_args()
    if opts.list:
        for c in CASES:
            print(f"{c['name']:24s} {c['title']}")
        return 0
    if opts.iters < 20:
        ap.error("--iters must be at least 20")
    cases = bench.select_cases(ap, opts, CASES, lambda c: c["quick"] or not opts.quick)
    torch = bench.cuda_torch("fp8_vs_peers")
    if torch is None:
        return 1
    import smelt

    record = bench.Recorder(opts, torch.cuda.get_device_name(0))
    print(f"smelt fp8 block-scaled GEMM vs peers on {record.gpu}; torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}); smelt {record.commit}; {bench.utc_now()}")
    print(f"median of {opts.iters} timed runs after {opts.warmup} warm-up runs, inputs rotated past 2x L2\n")
    results = []
    for c in cases:
        try:
            if c["name"] == "error":
                results.append(error_case(torch, smelt, c, record))
            elif c.get("groups"):
                results.append(grouped_case(torch, smelt, c, opts, record))
            else:
                results.append(speed_case(torch, smelt, c, opts, record))
        except Exception as e:  # noqa: BLE001 - one case's failure must not stop the rest
            print(f"{c['title']}: ERROR {type(e).__name__}: {e}")
            results.append(False)
        torch.cuda.empty_cache()
    return 0 if results and all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
