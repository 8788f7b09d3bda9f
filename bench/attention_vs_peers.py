#!/usr/bin/env python3
"""smelt attention against torch SDPA (cuDNN and FlashAttention-2) on one GPU, in one run: issue 5's acceptance table.

For each case, `smelt bench attention ... --json --check` runs in a subprocess
(its own CUDA context, device events, inputs rotated past L2, median of the
timed runs, slices checked against the CPU backend in double), then torch's
scaled_dot_product_attention runs in this process under the same rules with
the cuDNN backend and with the FlashAttention-2 backend (sdpa_kernel):
random data, warm-up, CUDA events around every call, median of the same
number of runs. Tensors are [B, S, H, D] as smelt takes them, handed to torch
as transposed [B, H, S, D] views. TFLOP/s on every side are smelt's FLOP
count (4*B*H*Sq*Sk*D forward, halved for causal; backward 2.5x) over the
median time. The backward is timed alone (torch.autograd.grad of one
retained forward graph; smelt: the backward run after one forward).

Accuracy: for the forward cases the script regenerates smelt's exact inputs
(splitmix64, as cli_fill_uniform, with the seeds of tools/bench_attention.c),
runs cuDNN on them, and measures cuDNN's error against an f64 reference
(torch on upcast inputs) on the very slice smelt's --check measured (batches
0 and B-1, heads 0 and H-1, the first and last --check-rows queries).
check_ref_l2, the norm of smelt's reference over that slice, confirms the
inputs are the same. smelt passes when its relative L2 error is within 5% of
cuDNN's (both are dominated by one bf16 rounding of O).

Bars (acceptance, bf16, B*S = 16k tokens, hidden 2048):
  forward D128 (full, causal), S = 4k and 16k: >= 0.9x cuDNN and >= 1.5x FA2
  forward D64, S = 4k and 16k: >= 0.9x cuDNN
  backward D128, S = 4k and 16k: >= 0.85x cuDNN

--mods (issue 25): the cost of the score modifiers over smelt's plain
forward, in this process through the Python binding (smelt.attention on
torch tensors, torch's stream): softcap (30), ALiBi (slopes 2^-1..2^-8),
sinks and all three against no modifier, B2 S4096 H16 D128 full and causal,
rotated inputs and CUDA events as above. Bar: each <= 1.05x the plain time.

Usage (from the repository root, after building build/smelt):
    python3 bench/attention_vs_peers.py                 # every case (~2-3 minutes on an H100)
    python3 bench/attention_vs_peers.py --quick         # the S = 4k cases
    python3 bench/attention_vs_peers.py --cases fwd_d128_s16k_causal --json-out /tmp/attn.json
    PYTHONPATH=python python3 bench/attention_vs_peers.py --mods   # the modifiers' cost
Each result (smelt against cuDNN and against FA2) is also appended to
bench/results.jsonl (--results PATH elsewhere, --no-results for none), the
rows bench/perf_report.py turns into docs/PERF.md.
Exit status: 0 when every case ran and met its bars, 1 otherwise.
"""

import math
import statistics
import sys
import time

import benchlib as bench
from benchlib import fmt

# The inputs of `smelt bench attention` (tools/bench_attention.c): seeds and ranges.
SEED_Q, SEED_K, SEED_V, SEED_DO = 0x5EED1501, 0x5EED1502, 0x5EED1503, 0x5EED1504
RANGE_QK, RANGE_V = (-2.0, 2.0), (-1.0, 1.0)
ACC_SLACK = 1.05  # smelt's error may exceed cuDNN's by this factor (rounding noise)


# ---------------------------------------------------------------- cases


def case(name, bwd, batch, seq, heads, dim, causal, bars, quick=False):
    title = f"{'bwd' if bwd else 'fwd'} D{dim} S={seq // 1024}k B={batch} H={heads} {'causal' if causal else 'full'}"
    return dict(name=name, title=title, bwd=bwd, batch=batch, seq=seq, heads=heads, dim=dim, causal=causal, bars=bars,
                quick=quick)


FWD128 = {"cudnn": 0.9, "fa2": 1.5}
PEER_LABELS = {"cudnn": "cuDNN (SDPA)", "fa2": "FA2 (SDPA)"}
CASES = [
    case("fwd_d128_s4k_full", False, 4, 4096, 16, 128, False, FWD128, quick=True),
    case("fwd_d128_s4k_causal", False, 4, 4096, 16, 128, True, FWD128, quick=True),
    case("fwd_d128_s16k_full", False, 1, 16384, 16, 128, False, FWD128),
    case("fwd_d128_s16k_causal", False, 1, 16384, 16, 128, True, FWD128),
    case("fwd_d64_s4k_full", False, 4, 4096, 32, 64, False, {"cudnn": 0.9}, quick=True),
    case("fwd_d64_s16k_full", False, 1, 16384, 32, 64, False, {"cudnn": 0.9}),
    case("bwd_d128_s4k_full", True, 4, 4096, 16, 128, False, {"cudnn": 0.85}, quick=True),
    case("bwd_d128_s16k_full", True, 1, 16384, 16, 128, False, {"cudnn": 0.85}),
]


def flops_of(c):
    f = 4.0 * c["batch"] * c["heads"] * c["seq"] * c["seq"] * c["dim"]
    if c["causal"]:
        f *= 0.5
    return 2.5 * f if c["bwd"] else f


# ---------------------------------------------------------------- smelt


def smelt_args(c):
    a = ["--batch", str(c["batch"]), "--heads", str(c["heads"]), "--seq-q", str(c["seq"]), "--head-dim",
         str(c["dim"]), "--dtype", "bf16"]
    if c["causal"]:
        a.append("--causal")
    if c["bwd"]:
        a.append("--bwd")
    return a


def run_smelt(c, opts):
    """Runs `smelt bench attention` on case c with the run counts and the check asked for."""
    extra = ["--warmup", str(opts.warmup), "--iters", str(opts.iters)]
    if not opts.no_check:
        extra += ["--check", "--check-rows", str(opts.check_rows)]
    return bench.run_smelt(opts, "attention", [*smelt_args(c), *extra])


# ---------------------------------------------------------------- smelt's inputs, regenerated


def _i64(x):
    """A 64-bit constant as the signed int64 with the same bits."""
    return x - (1 << 64) if x >= (1 << 63) else x


GAMMA, MIX1, MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)


def _lsr(torch, z, k):
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def smelt_uniform(torch, shape, seed, lo, hi, chunk=1 << 23):
    """cli_fill_uniform(buf, bf16, n, seed, lo, hi): splitmix64 element by
    element (state_i = seed + (i + 1) * gamma, mod 2^64; int64 products wrap
    the same way), u = (z >> 11) * 2^-53, v = lo + (hi - lo) * u in double,
    rounded to f32, then to bf16 (both round to nearest even)."""
    n = math.prod(shape)
    out = torch.empty(n, device="cuda", dtype=torch.bfloat16)
    for s in range(0, n, chunk):
        i = torch.arange(s + 1, min(n, s + chunk) + 1, device="cuda", dtype=torch.int64)
        z = i * GAMMA + _i64(seed)
        z = (z ^ _lsr(torch, z, 30)) * MIX1
        z = (z ^ _lsr(torch, z, 27)) * MIX2
        z = z ^ _lsr(torch, z, 31)
        u = _lsr(torch, z, 11).to(torch.float64) * 2.0 ** -53
        out[s:s + i.numel()] = (lo + (hi - lo) * u).to(torch.float32).to(torch.bfloat16)
    return out.view(shape)


def check_rows(seq, r):
    """The query rows smelt's --check covers: the first and last r, or all."""
    return list(range(seq)) if seq <= 2 * r else list(range(r)) + list(range(seq - r, seq))


def accuracy(torch, c, opts, backends):
    """Errors of each backend's forward O against an f64 reference on smelt's
    check slice, on smelt's inputs. Returns {backend: (rel_l2, max_abs)} and
    the reference's L2 norm over the slice."""
    from torch.nn.attention import sdpa_kernel

    F = torch.nn.functional
    B, S, H, D = c["batch"], c["seq"], c["heads"], c["dim"]
    q = smelt_uniform(torch, (B, S, H, D), SEED_Q, *RANGE_QK)
    k = smelt_uniform(torch, (B, S, H, D), SEED_K, *RANGE_QK)
    v = smelt_uniform(torch, (B, S, H, D), SEED_V, *RANGE_V)
    rows = torch.tensor(check_rows(S, opts.check_rows), device="cuda")
    outs = {}
    for name, be in backends.items():
        with sdpa_kernel([be]):
            outs[name] = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                        is_causal=c["causal"])  # [B, H, S, D]
    scale = 1.0 / math.sqrt(D)
    sums = {n: [0.0, 0.0] for n in outs}  # diff^2, max_abs
    ref2 = 0.0
    for b in sorted({0, B - 1}):
        for h in sorted({0, H - 1}):
            qs = q[b, rows, h].double()
            ks, vs = k[b, :, h].double(), v[b, :, h].double()
            s = scale * (qs @ ks.T)
            if c["causal"]:  # bottom-right aligned; Sq == Sk here
                s = s.masked_fill(torch.arange(S, device="cuda")[None, :] > rows[:, None], float("-inf"))
            ref = torch.softmax(s, dim=-1) @ vs
            ref2 += float((ref * ref).sum())
            for n, o in outs.items():
                d = o[b, h, rows].double() - ref
                sums[n][0] += float((d * d).sum())
                sums[n][1] = max(sums[n][1], float(d.abs().max()))
    del q, k, v, outs
    return {n: (math.sqrt(d2 / ref2), mx) for n, (d2, mx) in sums.items()}, math.sqrt(ref2)


# ---------------------------------------------------------------- peers


def time_sdpa(torch, c, backend, opts):
    """Median and min ms of one SDPA forward (or backward) with `backend`,
    over input sets rotated past 2x L2."""
    from torch.nn.attention import sdpa_kernel

    F = torch.nn.functional
    B, S, H, D = c["batch"], c["seq"], c["heads"], c["dim"]
    sets = bench.rotation_sets(torch, 2 * B * S * H * D * (8 if c["bwd"] else 4), 0.3, 64)

    def make():
        t = [torch.empty((B, S, H, D), device="cuda", dtype=torch.float32).uniform_(*r).to(torch.bfloat16)
             for r in (RANGE_QK, RANGE_QK, RANGE_V)]
        q, k, v = (x.transpose(1, 2) for x in t)  # [B, H, S, D] views of [B, S, H, D]
        if not c["bwd"]:
            return (q, k, v)
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        with sdpa_kernel([backend]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=c["causal"])
        do = torch.empty_like(o).uniform_(-1.0, 1.0)
        return (q, k, v, o, do)

    def call(s):
        if c["bwd"]:
            return torch.autograd.grad(s[3], (s[0], s[1], s[2]), s[4], retain_graph=True)
        return F.scaled_dot_product_attention(s[0], s[1], s[2], is_causal=c["causal"])

    data = [make() for _ in range(sets)]
    with sdpa_kernel([backend]):
        ms, _ = bench.time_rotated(torch, call, data, opts)
    del data
    return dict(median_ms=statistics.median(ms), min_ms=ms[0], sets=sets)


# ---------------------------------------------------------------- --mods

MODS_BAR = 1.05  # a modifier's forward time over the plain forward's, at most
MODS_SHAPE = (2, 4096, 16, 128)  # B, S, H, D


def mods_variants(torch, h):
    """The modifier sets timed: name -> smelt.attention keywords."""
    slopes = torch.tensor([2.0 ** -(1 + i % 8) for i in range(h)], device="cuda", dtype=torch.float32)
    sinks = torch.empty(h, device="cuda", dtype=torch.float32).uniform_(-1.0, 2.0)
    return {"plain": {}, "softcap": dict(softcap=30.0), "alibi": dict(alibi_slopes=slopes),
            "sinks": dict(sinks=sinks), "all": dict(softcap=30.0, alibi_slopes=slopes, sinks=sinks)}


def run_mods(torch, opts, record):
    """Times every modifier set against the plain forward; True when all
    meet MODS_BAR."""
    import smelt

    B, S, H, D = MODS_SHAPE
    sets = bench.rotation_sets(torch, 3 * B * S * H * D * 2, 0.3, 64)
    data = [[torch.empty((B, S, H, D), device="cuda", dtype=torch.float32).uniform_(*r).to(torch.bfloat16)
             for r in (RANGE_QK, RANGE_QK, RANGE_V)] for _ in range(sets)]
    ok = True
    print(f"score modifiers over the plain forward, bf16 B{B} S{S} H{H} D{D}; bar <= {MODS_BAR}x")
    for causal in (False, True):
        flops = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        times = {}
        for name, kw in mods_variants(torch, H).items():
            ms, _ = bench.time_rotated(torch, lambda t: smelt.attention(*t, causal=causal, **kw), data, opts)
            times[name] = statistics.median(ms)
            ratio = times[name] / times["plain"]
            met = name == "plain" or ratio <= MODS_BAR
            ok &= met
            tf = flops / (times[name] * 1e-3) / 1e12
            print(f"  {'causal' if causal else 'full':6s} {name:8s} {times[name]:8.3f} ms {tf:7.1f} TFLOP/s "
                  f"{ratio:6.3f}x plain {'' if name == 'plain' else ('ok' if met else 'OVER')}", flush=True)
            if name != "plain":
                record("attention", f"fwd_d128_s4k_{'causal' if causal else 'full'}_{name}", "bf16", tf,
                       "smelt plain forward", flops / (times["plain"] * 1e-3) / 1e12, "TF/s")
    return ok


# ---------------------------------------------------------------- main


def run_case(torch, c, opts, backends):
    r = dict(case=c["name"], title=c["title"], bars=c["bars"], flops=flops_of(c), smelt_tflops=None, status="ERROR",
             errors=[])
    t0 = time.time()
    try:
        s = run_smelt(c, opts)
        r.update(smelt=s, smelt_tflops=s.get("tflops"), smelt_median_ms=s.get("median_ms"), kernel=s.get("kernel"),
                 check=s.get("check"), smelt_rel_l2=s.get("check_rel_l2"), smelt_max_abs=s.get("check_max_abs"))
        if s.get("flops"):
            r["flops"] = s["flops"]
        if s["rc"] != 0 and s.get("check") != "fail":
            raise RuntimeError(s.get("stderr") or f"smelt exited {s['rc']}")
    except Exception as e:  # noqa: BLE001 - one case's failure must not stop the table
        r["errors"].append(f"smelt: {e}")
    for name, be in backends.items():
        try:
            p = time_sdpa(torch, c, be, opts)
            r[f"{name}_median_ms"] = p["median_ms"]
            r[f"{name}_tflops"] = r["flops"] / (p["median_ms"] * 1e-3) / 1e12
        except Exception as e:  # noqa: BLE001
            r["errors"].append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        finally:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if not c["bwd"] and not opts.no_accuracy and r.get("smelt_rel_l2") is not None:
        try:
            errs, ref_l2 = accuracy(torch, c, opts, {"cudnn": backends["cudnn"]})
            r["cudnn_rel_l2"], r["cudnn_max_abs"] = errs["cudnn"]
            r["ref_l2"] = ref_l2
            smelt_ref = r["smelt"].get("check_ref_l2")
            r["inputs_match"] = bool(smelt_ref) and abs(smelt_ref - ref_l2) <= 1e-6 * ref_l2
        except Exception as e:  # noqa: BLE001
            r["errors"].append(f"accuracy: {type(e).__name__}: {e}")
        finally:
            torch.cuda.empty_cache()
    # Ratios and the verdict.
    verdicts = []
    for peer, bar in c["bars"].items():
        pt, st = r.get(f"{peer}_tflops"), r["smelt_tflops"]
        r[f"ratio_{peer}"] = st / pt if st and pt else None
        verdicts.append(r[f"ratio_{peer}"] is not None and r[f"ratio_{peer}"] >= bar)
    if "fa2" not in c["bars"] and r.get("fa2_tflops") and r["smelt_tflops"]:
        r["ratio_fa2"] = r["smelt_tflops"] / r["fa2_tflops"]
    if r.get("cudnn_rel_l2") is not None:
        r["accuracy_ok"] = r["smelt_rel_l2"] <= ACC_SLACK * r["cudnn_rel_l2"] and r.get("inputs_match", False)
        verdicts.append(r["accuracy_ok"])
    if r.get("check") == "fail":
        r["status"] = "FAIL (check)"
    elif any(r.get(f"ratio_{p}") is None for p in c["bars"]):
        r["status"] = "ERROR"
    else:
        r["status"] = "pass" if all(verdicts) else "FAIL"
    r["wall_s"] = time.time() - t0
    return r


def main():
    ap = bench.case_parser(__doc__, CASES, "the S = 4k cases", "all")
    bench.add_common_args(ap, warmup=5, iters=25)
    ap.add_argument("--check-rows", type=int, default=128,
                    help="smelt --check-rows: first and last rows checked per head (default 128: 512 queries "
                         "over two heads)")
    ap.add_argument("--no-check", action="store_true", help="skip smelt's --check (and so the accuracy line)")
    ap.add_argument("--no-accuracy", action="store_true", help="skip cuDNN's error measurement")
    ap.add_argument("--mods", action="store_true",
                    help=f"only the score modifiers' cost over the plain forward (bar <= {MODS_BAR}x)")
    opts = ap.parse_args()
    if opts.mods:
        torch = bench.cuda_torch("attention_vs_peers")
        if torch is None:
            return 1
        return 0 if run_mods(torch, opts, bench.Recorder(opts, torch.cuda.get_device_name(0))) else 1
    if opts.list:
        for c in CASES:
            bars = ", ".join(f">= {v}x {k}" for k, v in c["bars"].items())
            print(f"{c['name']:24s} {c['title']:36s} {bars}{' (quick)' if c['quick'] else ''}")
        return 0
    cases = bench.prepare(ap, opts, CASES, lambda c: c["quick"] or not opts.quick, "attention_vs_peers")
    torch = bench.cuda_torch("attention_vs_peers") if cases is not None else None
    if torch is None:
        return 1
    from torch.nn.attention import SDPBackend

    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}
    record = bench.Recorder(opts, torch.cuda.get_device_name(0))
    gpu, commit, date = record.gpu, record.commit, bench.utc_now()
    cudnn_v = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"smelt attention vs torch SDPA on {gpu}; torch {torch.__version__} (CUDA {torch.version.cuda}, "
          f"cuDNN {cudnn_v}); smelt {commit}; {date}")
    print(f"bf16, median of {opts.iters} timed runs after {opts.warmup} warm-up runs on every side, random data"
          f"{'' if opts.no_check else '; smelt checked against its CPU backend'}\n")

    results = []
    for c in cases:
        r = run_case(torch, c, opts, backends)
        results.append(r)
        if r.get("check") != "fail":
            for peer, label in PEER_LABELS.items():
                record("attention", c["name"], "bf16", r["smelt_tflops"], label, r.get(f"{peer}_tflops"), "TF/s")
        line = (f"{c['name']}: smelt {fmt(r['smelt_tflops'], '.1f')}, cuDNN {fmt(r.get('cudnn_tflops'), '.1f')}, "
                f"FA2 {fmt(r.get('fa2_tflops'), '.1f')} TFLOP/s -> {r['status']} ({r['wall_s']:.0f} s)")
        print(line + "".join(f"\n    error: {e}" for e in r["errors"]), flush=True)

    print()
    hdr = (f"{'case':36s} {'smelt':>7s} {'cuDNN':>7s} {'FA2':>7s} {'/cuDNN':>7s} {'/FA2':>6s}  {'bars':22s} result")
    print(hdr + "\n" + "-" * len(hdr))
    for r in results:
        bars = ", ".join(f"{'cuDNN' if k == 'cudnn' else 'FA2'}>={v}" for k, v in r["bars"].items())
        print(f"{r['title']:36s} {fmt(r['smelt_tflops'], '7.1f', 7)} {fmt(r.get('cudnn_tflops'), '7.1f', 7)} "
              f"{fmt(r.get('fa2_tflops'), '7.1f', 7)} {fmt(r.get('ratio_cudnn'), '7.3f', 7)} "
              f"{fmt(r.get('ratio_fa2'), '6.2f', 6)}  {bars:22s} {r['status']}")
    print("(TFLOP/s; ratios are smelt / peer)")

    print(f"\naccuracy: forward O vs an f64 reference on smelt's check slice (batches 0 and B-1, heads 0 and H-1, "
          f"first and last {opts.check_rows} queries), relative L2 / max abs; smelt passes within {ACC_SLACK}x cuDNN")
    for r in results:
        if r.get("cudnn_rel_l2") is None:
            if r.get("smelt_rel_l2") is not None:
                print(f"  {r['title']:36s} smelt {r['smelt_rel_l2']:.3e} / {fmt(r.get('smelt_max_abs'), '.3e')} "
                      f"(smelt's check {r.get('check')}; no cuDNN measurement)")
            continue
        ok = "ok" if r.get("accuracy_ok") else "WORSE" if r.get("inputs_match") else "inputs differ"
        print(f"  {r['title']:36s} smelt {r['smelt_rel_l2']:.3e} / {fmt(r.get('smelt_max_abs'), '.3e')}  "
              f"cuDNN {r['cudnn_rel_l2']:.3e} / {r['cudnn_max_abs']:.3e}  {ok}"
              f"{'' if r.get('inputs_match') else ' (smelt ref_l2 %s vs %s)' % (r['smelt'].get('check_ref_l2'), r['ref_l2'])}")

    bench.print_kernels(results, 24, lambda r: "; ".join(r["errors"]))
    bench.write_json(opts, torch, record, date, results, cudnn=cudnn_v)
    return 0 if results and all(r["status"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
