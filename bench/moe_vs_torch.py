#!/usr/bin/env python3
"""smelt's MoE layer against torch on one GPU, in one run: issue 22's acceptance table (forward, and
forward + backward at the prefill shapes).

For each case, `smelt bench moe ... --json` runs in a subprocess (its own
CUDA context, device events, x rotated past L2, median of the timed runs;
softmax top-k routing with renormalization, SwiGLU experts, no capacity),
then two torch layers run in this process with the same routing rule, on
random bf16 data of their own, timed with CUDA events over x rotated past
2x L2 (benchlib.time_rotated):
  grouped_mm  the strongest torch layer: logits x·Wr in f32, softmax, top-k,
              renormalized weights; permute by a stable argsort of the expert
              ids, each expert's rows padded to a multiple of 16 (as
              torch._grouped_mm's users do, torchtitan among them), all on the
              device; torch._grouped_mm over W13 (W1 and W3 concatenated along
              the output columns, K-major per expert), silu(a)·b,
              torch._grouped_mm over W2; the rows weighted and index_add'ed
              back to token order.
  eager       the per-expert loop: for each expert, its tokens' rows through
              x·W1, x·W3, silu·mul, ·W2, weighted index_add (a host round trip
              per expert, as such loops have).
Forward + backward (prefill cases): `smelt bench moe --saved` (the saved
forward, which keeps the backward's state as autograd does) plus `smelt
bench moe --bwd --saved` (the backward from that state: dx, dWr, dW1, dW3,
dW2), against the grouped_mm layer's forward and autograd backward
(x, Wr, W13 and W2 requiring gradients, the gradients set to None before
each step, dy random), timed the same way.
TFLOP/s are the expert FFN's, 2·T·k·d·F·3, on every side (three times that
for forward + backward). Decode cases
(T = 1, 8, 64) also print microseconds and the GB/s of the distinct experts'
weights each side read (3·d·F·2 bytes an expert), against the copy bandwidth
smelt's run measured for the same bytes.

Bars (issue 22, forward): >= 1.3x the grouped_mm layer at T4096 d4096 F14336
E8 top2; >= 1.5x it and >= 8x the eager loop at T8192 d2048 F1408 E64 top6;
at T = 1, >= 2x it; at decode sizes, the experts' weights read at >= 80% of
the copy bandwidth; forward + backward >= 1.2x the grouped_mm layer at both
prefill shapes.

Usage (from the repository root, after building build/smelt):
    python3 bench/moe_vs_torch.py                  # every case
    python3 bench/moe_vs_torch.py --quick          # E8 and E64 prefill, decode T = 1
    python3 bench/moe_vs_torch.py --cases decode_t1,decode_t8 --json-out /tmp/moe.json
    python3 bench/moe_vs_torch.py --dry-run        # the commands and torch layers, without a GPU
Each result is also appended to bench/results.jsonl (--results PATH elsewhere,
--no-results for none), the rows bench/perf_report.py turns into docs/PERF.md.
Exit status: 0 when every case ran and met its bars, 1 otherwise.
"""

import gc
import sys

import benchlib as bench
from benchlib import fmt

ALIGN = 16  # rows an expert's group is padded to for torch._grouped_mm


def case(name, tokens, d, ffn, experts, top_k, bars, quick=False):
    return dict(name=name, tokens=tokens, d=d, ffn=ffn, experts=experts, top_k=top_k, bars=bars, quick=quick,
                title=f"T{tokens} d{d} F{ffn} E{experts} top{top_k}", decode=tokens <= 64)


# bars: speedup over each torch layer, and (decode) the weights' share of copy bandwidth in %.
CASES = [
    case("prefill_e8", 4096, 4096, 14336, 8, 2, {"grouped_mm": 1.3, "grouped_mm_fb": 1.2}, quick=True),
    case("prefill_e64", 8192, 2048, 1408, 64, 6, {"grouped_mm": 1.5, "eager": 8.0, "grouped_mm_fb": 1.2},
         quick=True),
    case("decode_t1", 1, 4096, 14336, 8, 2, {"grouped_mm": 2.0, "pct_of_copy": 80.0}, quick=True),
    case("decode_t8", 8, 4096, 14336, 8, 2, {"pct_of_copy": 80.0}),
    case("decode_t64", 64, 4096, 14336, 8, 2, {"pct_of_copy": 80.0}),
]


def ffn_flops(c):
    return 2.0 * c["tokens"] * c["top_k"] * c["d"] * c["ffn"] * 3


def expert_bytes(c):
    return 3 * c["d"] * c["ffn"] * 2


# ---------------------------------------------------------------- smelt


def smelt_args(c, opts):
    return ["--tokens", str(c["tokens"]), "--d-model", str(c["d"]), "--ffn", str(c["ffn"]), "--experts",
            str(c["experts"]), "--top-k", str(c["top_k"]), "--dtype", "bf16", "--warmup", str(opts.warmup),
            "--iters", str(opts.iters)]


def fwd_bwd(c):
    """Whether the case also times forward + backward (the prefill ones)."""
    return "grouped_mm_fb" in c["bars"]


def smelt_command(opts, args):
    """The command bench.run_smelt runs, as text (for --dry-run)."""
    return " ".join([opts.smelt, "bench", "moe", *args, "--device", opts.device, "--json"])


# ---------------------------------------------------------------- torch


def torch_layers(torch, c, train=False):
    """The two torch layers as functions of x, and what they share: the
    weights (random, scaled like a trained layer's; leaves that require
    gradients with train, listed as the fourth result) and the routing."""
    F = torch.nn.functional
    T, d, ff, E, k = c["tokens"], c["d"], c["ffn"], c["experts"], c["top_k"]
    g = torch.Generator(device="cuda")
    g.manual_seed(2200)

    def uni(shape, a):
        return ((torch.rand(shape, generator=g, device="cuda") * 2 - 1) * a).to(torch.bfloat16)

    leaves = [uni((d, E), d ** -0.5), uni((E, 2 * ff, d), d ** -0.5), uni((E, d, ff), ff ** -0.5)]
    if train:
        leaves = [t.requires_grad_() for t in leaves]
    wr = leaves[0]
    w13 = leaves[1].transpose(-2, -1)  # [E, d, 2F], K-major per expert
    w2 = leaves[2].transpose(-2, -1)   # [E, F, d], K-major per expert
    rows = T * k + E * (ALIGN - 1)                          # the padded permuted rows, a bound known on the host

    def route(x):
        probs = (x @ wr).float().softmax(dim=-1)
        w, ids = probs.topk(k, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), ids

    def grouped(x):
        w, ids = route(x)
        flat = ids.flatten()
        order = flat.argsort(stable=True)                   # expert-major, stable
        tok, e_sorted = order // k, flat[order]
        counts = torch.bincount(flat, minlength=E)
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        ends = padded.cumsum(0)
        starts, first = ends - padded, counts.cumsum(0) - counts
        dest = starts[e_sorted] + torch.arange(T * k, device="cuda") - first[e_sorted]
        xp = x.new_zeros(rows, d)
        xp[dest] = x[tok]
        offs = ends.to(torch.int32)
        h = torch._grouped_mm(xp, w13, offs=offs)
        a, b = h.chunk(2, dim=-1)
        yp = torch._grouped_mm(F.silu(a) * b, w2, offs=offs)
        yp = yp[dest] * w.flatten()[order, None].to(yp.dtype)
        return torch.zeros_like(x).index_add_(0, tok, yp)

    def eager(x):
        w, ids = route(x)
        y = torch.zeros_like(x)
        for e in range(E):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            a, b = (x[tok] @ w13[e]).chunk(2, dim=-1)
            y.index_add_(0, tok, ((F.silu(a) * b) @ w2[e]) * w[tok, slot, None].to(x.dtype))
        return y

    def distinct(x):
        return int(route(x)[1].unique().numel())

    return grouped, eager, distinct, leaves if train else []


def run_torch(torch, c, opts, out):
    """Times both torch layers on x rotated past 2x L2; fills out."""
    T, d = c["tokens"], c["d"]
    sets = bench.rotation_sets(torch, 2 * T * d * 2, 0.1, 64)
    g = torch.Generator(device="cuda")
    g.manual_seed(2201)
    data = [((torch.rand((T, d), generator=g, device="cuda") * 2 - 1).to(torch.bfloat16)) for _ in range(sets)]
    grouped, eager, distinct, _ = torch_layers(torch, c)
    out["torch_distinct"] = distinct(data[0])
    for name, fn in (("grouped_mm", grouped), ("eager", eager)):
        try:
            with torch.no_grad():
                ms, _ = bench.time_rotated(torch, fn, data, opts)
            out[f"{name}_ms"] = ms[len(ms) // 2]
        except Exception as e:  # noqa: BLE001 - report and go on
            out["errors"].append(f"torch {name}: {type(e).__name__}: {e}")
    del data
    torch.cuda.empty_cache()
    if fwd_bwd(c):
        run_torch_train(torch, c, opts, out)


def run_torch_train(torch, c, opts, out):
    """Times the grouped_mm layer's forward + autograd backward; fills out."""
    T, d = c["tokens"], c["d"]
    sets = bench.rotation_sets(torch, 4 * T * d * 2, 0.1, 64)  # x, dy, y, dx
    g = torch.Generator(device="cuda")
    g.manual_seed(2202)

    def rand():
        return ((torch.rand((T, d), generator=g, device="cuda") * 2 - 1).to(torch.bfloat16))

    data = [(rand().requires_grad_(), rand()) for _ in range(sets)]
    grouped, _, _, leaves = torch_layers(torch, c, train=True)

    def step(xd):
        x, dy = xd
        for t in leaves + [x]:
            t.grad = None
        grouped(x).backward(dy)

    try:
        ms, _ = bench.time_rotated(torch, step, data, opts)
        out["grouped_mm_fb_ms"] = ms[len(ms) // 2]
    except Exception as e:  # noqa: BLE001 - report and go on
        out["errors"].append(f"torch grouped_mm forward + backward: {type(e).__name__}: {e}")
    del data, leaves
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- a case


def run_case(torch, c, opts):
    r = dict(case=c["name"], title=c["title"], errors=[])
    # smelt runs in a subprocess on the same GPU: give back what the last
    # case's torch layers held (closures keep cycles alive until collected;
    # the decode case after the prefill ones failed for memory without this).
    gc.collect()
    torch.cuda.empty_cache()
    try:
        s = bench.run_smelt(opts, "moe", smelt_args(c, opts))
        r.update(smelt_ms=s.get("median_ms"), kernel=s.get("kernel"), copy_gbps=s.get("copy_gbps"),
                 smelt_distinct=c["experts"] - s.get("empty_experts", 0), imbalance=s.get("imbalance"),
                 dropped=s.get("dropped"), smelt=s)
        if s.get("rc"):
            r["errors"].append(f"smelt exited {s['rc']}: {s.get('stderr', '')[-300:]}")
    except RuntimeError as e:
        r["errors"].append(f"smelt: {e}")
    if fwd_bwd(c):
        # A training step keeps the forward's state for the backward, as
        # torch's autograd does: the saved forward, then the saved backward.
        try:
            f = bench.run_smelt(opts, "moe", smelt_args(c, opts) + ["--saved"])
            b = bench.run_smelt(opts, "moe", smelt_args(c, opts) + ["--bwd", "--saved"])
            for flag, x in (("--saved", f), ("--bwd --saved", b)):
                if x.get("rc"):
                    r["errors"].append(f"smelt {flag} exited {x['rc']}: {x.get('stderr', '')[-300:]}")
            if f.get("median_ms") and b.get("median_ms") and not f.get("rc") and not b.get("rc"):
                r["smelt_fwd_saved_ms"], r["smelt_bwd_ms"], r["smelt_bwd"] = f["median_ms"], b["median_ms"], b
                r["smelt_fb_ms"] = f["median_ms"] + b["median_ms"]
        except RuntimeError as e:
            r["errors"].append(f"smelt --saved: {e}")
    run_torch(torch, c, opts, r)
    for peer in ("grouped_mm", "eager"):
        r[f"vs_{peer}"] = bench.ratio_of(r.get("smelt_ms"), r.get(f"{peer}_ms"), "ms")
    r["vs_grouped_mm_fb"] = bench.ratio_of(r.get("smelt_fb_ms"), r.get("grouped_mm_fb_ms"), "ms")
    if c["decode"]:
        for side in ("smelt", "torch"):
            ms, n = r.get("smelt_ms" if side == "smelt" else "grouped_mm_ms"), r.get(f"{side}_distinct")
            r[f"{side}_weights_gbps"] = n * expert_bytes(c) / (ms * 1e-3) / 1e9 if ms and n else None
        cg = r.get("copy_gbps")
        r["pct_of_copy"] = 100.0 * r["smelt_weights_gbps"] / cg if r.get("smelt_weights_gbps") and cg else None
    r["met"] = {bar: (r.get(bar if bar == "pct_of_copy" else f"vs_{bar}") or 0) >= v for bar, v in c["bars"].items()}
    return r


def report_case(record, c, r):
    tf = {k: ffn_flops(c) / (r[k] * 1e-3) / 1e12 if r.get(k) else None for k in ("smelt_ms", "grouped_mm_ms", "eager_ms")}
    print(f"{c['title']:32s} smelt {fmt(r.get('smelt_ms'), '9.3f', 9)} ms {fmt(tf['smelt_ms'], '7.1f', 7)} TF/s | "
          f"grouped_mm {fmt(r.get('grouped_mm_ms'), '9.3f', 9)} ms {fmt(tf['grouped_mm_ms'], '7.1f', 7)} TF/s "
          f"({fmt(r.get('vs_grouped_mm'), '.2f')}x) | eager {fmt(r.get('eager_ms'), '9.3f', 9)} ms "
          f"({fmt(r.get('vs_eager'), '.2f')}x)", flush=True)
    if c["decode"]:
        print(f"{'':32s} smelt {fmt((r.get('smelt_ms') or 0) * 1e3, '.1f')} us, {r.get('smelt_distinct')} experts' "
              f"weights at {fmt(r.get('smelt_weights_gbps'), '.1f')} GB/s = {fmt(r.get('pct_of_copy'), '.1f')}% of "
              f"copy ({fmt(r.get('copy_gbps'), '.1f')} GB/s); grouped_mm {fmt((r.get('grouped_mm_ms') or 0) * 1e3, '.1f')}"
              f" us, {r.get('torch_distinct')} experts at {fmt(r.get('torch_weights_gbps'), '.1f')} GB/s", flush=True)
    if fwd_bwd(c):
        fb = {k: 3 * ffn_flops(c) / (r[k] * 1e-3) / 1e12 if r.get(k) else None for k in ("smelt_fb_ms", "grouped_mm_fb_ms")}
        print(f"{'  fwd+bwd':32s} smelt {fmt(r.get('smelt_fb_ms'), '9.3f', 9)} ms {fmt(fb['smelt_fb_ms'], '7.1f', 7)} "
              f"TF/s (saved fwd {fmt(r.get('smelt_fwd_saved_ms'), '.3f')} + bwd {fmt(r.get('smelt_bwd_ms'), '.3f')} ms) | "
              f"grouped_mm {fmt(r.get('grouped_mm_fb_ms'), '9.3f', 9)}"
              f" ms {fmt(fb['grouped_mm_fb_ms'], '7.1f', 7)} TF/s ({fmt(r.get('vs_grouped_mm_fb'), '.2f')}x)", flush=True)
        record("moe", f"fwd+bwd {c['title']}", "bf16", r.get("smelt_fb_ms"), "torch._grouped_mm layer (autograd)",
               r.get("grouped_mm_fb_ms"), "ms")
    for e in r["errors"]:
        print(f"{'':32s} error: {e}", flush=True)
    record("moe", f"fwd {c['title']}", "bf16", r.get("smelt_ms"), "torch._grouped_mm layer", r.get("grouped_mm_ms"),
           "ms")
    record("moe", f"fwd {c['title']}", "bf16", r.get("smelt_ms"), "torch eager loop", r.get("eager_ms"), "ms")
    if c["decode"]:
        record("moe", f"fwd {c['title']} experts' weights", "bf16", r.get("smelt_weights_gbps"), "device copy",
               r.get("copy_gbps"), "GB/s")


# ---------------------------------------------------------------- main


def list_cases():
    for c in CASES:
        bars = ", ".join(f"{k} >= {v}{'%' if k == 'pct_of_copy' else 'x'}" for k, v in c["bars"].items())
        print(f"{c['name']:14s} {c['title']:32s} bars: {bars}{' (quick)' if c['quick'] else ''}")


def dry_run(cases, opts):
    """What a run would do, without running anything."""
    for c in cases:
        E, d, ff, rows = c["experts"], c["d"], c["ffn"], c["tokens"] * c["top_k"] + c["experts"] * (ALIGN - 1)
        steps = [f"# {c['name']}: {c['title']}, bf16, softmax top-{c['top_k']} renormalized, SwiGLU",
                 smelt_command(opts, smelt_args(c, opts)),
                 f"torch grouped_mm layer: route, argsort permute (groups padded to {ALIGN} rows), _grouped_mm(xp "
                 f"[<= {rows}, {d}], W13 [{E}, {d}, {2 * ff}]), silu*mul, _grouped_mm(., W2 [{E}, {ff}, {d}]), "
                 f"weighted index_add",
                 f"torch eager loop: {E} experts, x[tok] @ W13[e], silu*mul, @ W2[e], weighted index_add; "
                 f"{opts.warmup} warm-up + {opts.iters} timed runs"]
        if fwd_bwd(c):
            steps += [smelt_command(opts, smelt_args(c, opts) + ["--saved"]),
                      smelt_command(opts, smelt_args(c, opts) + ["--bwd", "--saved"]) + "   (+ the saved forward: one step)",
                      "torch grouped_mm layer forward + autograd backward (x, Wr, W13, W2 require gradients; dy "
                      "random)"]
        print("\n".join(steps), end="\n\n")
    return 0


def main():
    ap = bench.case_parser(__doc__, CASES, "E8 and E64 prefill, decode T = 1", "all")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and torch layers of the cases and exit")
    bench.add_common_args(ap, warmup=5, iters=20)
    opts = ap.parse_args()

    def default(c):
        return c["quick"] or not opts.quick

    if opts.list or opts.dry_run:  # neither needs a GPU, torch or the smelt binary
        if opts.list:
            return list_cases() or 0
        if opts.iters < 20:
            ap.error("--iters must be at least 20 (the acceptance asks for a median of >= 20 runs)")
        return dry_run(bench.select_cases(ap, opts, CASES, default), opts)
    cases = bench.prepare(ap, opts, CASES, default, "moe_vs_torch")
    torch = bench.cuda_torch("moe_vs_torch") if cases is not None else None
    if torch is None:
        return 1
    if not hasattr(torch, "_grouped_mm"):
        print(f"moe_vs_torch: torch {torch.__version__} has no torch._grouped_mm", file=sys.stderr)
        return 1
    record = bench.Recorder(opts, torch.cuda.get_device_name(0))
    date = bench.utc_now()
    print(f"smelt MoE layer vs torch {torch.__version__} (CUDA {torch.version.cuda}) on {record.gpu}; smelt "
          f"{record.commit}; {date}\nbf16 forward (and forward + backward), median of {opts.iters} timed runs after {opts.warmup} warm-up runs "
          f"on every side, random data, x rotated past 2x L2\n")
    results = []
    for c in cases:
        results.append(run_case(torch, c, opts))
        report_case(record, c, results[-1])

    print("\nbars:")
    for c, r in zip(cases, results):
        for bar, met in r["met"].items():
            v = r.get(bar if bar == "pct_of_copy" else f"vs_{bar}")
            unit = "%" if bar == "pct_of_copy" else "x"
            print(f"  {c['name']:14s} {bar:12s} {fmt(v, '.2f')}{unit} (>= {c['bars'][bar]}{unit}) -> "
                  f"{'pass' if met else 'FAIL'}")
    bench.print_kernels(results, 14, lambda r: "; ".join(r["errors"]))
    bench.write_json(opts, torch, record, date, results)
    ok = results and not any(r["errors"] for r in results) and all(all(r["met"].values()) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
