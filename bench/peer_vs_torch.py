#!/usr/bin/env python3
"""smelt PEER against a torch eager PEER on one GPU, in one run: issue 6's acceptance table.

The acceptance case: bf16, T = 4096 tokens, d_in = d_out = 1024, 1M experts
(1024^2 product keys, p = 2), 8 heads, top-16, query_dim 256, expert hidden 1,
GELU, softmax gates, no query norm, shared sub-keys.

smelt: `smelt bench peer ... --json` runs in a subprocess (its own CUDA
context, device events, x/y rotated past L2, median of the timed runs), once
for the forward and once with --bwd (the backward alone, dense dU/dV like
torch's nn.Embedding gradients); smelt's fwd+bwd is the sum of the two
medians. A separate short run with --check compares a few tokens of y and dx
against the CPU backend (in double, same rounded weights).

torch: the public reference algorithm (lucidrains' PEER, batchnorm-free) in
eager mode, in this process: q = x Wq + bq split per head into 2 halves,
sub-key scores by matmul against the two [1024, 128] key tables, top-k of
each, the k^2 candidate sums (ids a*1024 + b), top-k, softmax gates, U/V
rows gathered by F.embedding, gelu(x . U_e) * gate, weighted sum of V rows
over heads and experts. Forward under no_grad; fwd+bwd with autograd
(y.backward(dy), gradients for x, Wq, bq, keys, U, V, set to None between
runs). Random weights of its own (speed only: correctness of smelt is
--check's job). CUDA events around every run, median of >= 20.

Bars: forward >= 5x torch eager; fwd+bwd >= 3x torch eager; smelt's forward
traffic (expert rows actually read, T*h*k*(d_in + d_out)*2 bytes, plus x, y,
Wq, sub-keys) at >= 70% of the device copy bandwidth measured in the same
smelt run (the expert-row-only share is printed too).

--store also runs the hierarchical store (issue 6's second acceptance
item): 4M experts (2048^2, a 16 GiB host table) with a 2 GiB HBM cache:
the forward with uniform routing (hit rate, time), and the store alone on
batches of T*h*k expert ids drawn from an exact Zipf(1.1) distribution
(`smelt bench peer --zipf 1.1`: the forward's store batch, lookup + CLOCK +
staging of the misses, timed without routing or expert kernels, since the
routing cannot be steered to exact Zipf ids); its miss path's sustained
GB/s (staged bytes over elapsed time, warm cache) is printed next to the
pinned host->device copy bandwidth (bench/h2d_bandwidth.py, same GPU) and
judged against 70% of it.

Usage (from the repository root, after building build/smelt):
    python3 bench/peer_vs_torch.py                 # acceptance case (~1-2 minutes on an H100)
    python3 bench/peer_vs_torch.py --quick         # fewer runs, no check
    python3 bench/peer_vs_torch.py --json-out /tmp/peer.json
The figures (forward, fwd+bwd, backward, traffic, store) are also appended to
bench/results.jsonl (--results PATH elsewhere, --no-results for none), the
rows bench/perf_report.py turns into docs/PERF.md.
Exit status: 0 when everything ran and met its bars, 1 otherwise.
"""

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import benchlib as bench
from benchlib import REPO, fmt

SHAPE = dict(tokens=4096, d_in=1024, d_out=1024, n=1024, heads=8, top_k=16, query_dim=256, hidden=1)
BARS = dict(fwd_speedup=5.0, fwdbwd_speedup=3.0, pct_of_copy=70.0)


# ---------------------------------------------------------------- smelt


def smelt_args(s, extra=()):
    return ["--tokens", str(s["tokens"]), "--d-model", str(s["d_in"]), "--d-out", str(s["d_out"]), "--experts",
            str(s["n"] ** 2), "--heads", str(s["heads"]), "--top-k", str(s["top_k"]), "--query-dim",
            str(s["query_dim"]), "--expert-hidden", str(s["hidden"]), "--dtype", "bf16", *extra]


def run_smelt(opts, args):
    return bench.run_smelt(opts, "peer", args)


# ---------------------------------------------------------------- torch


def torch_peer(torch, s, opts, errors):
    """Times the eager reference; returns dict(fwd_ms, fwdbwd_ms) (None where it failed)."""
    import torch.nn.functional as F

    dev, dt = "cuda", torch.bfloat16
    T, d_in, d_out, n, h, k, dq = (s[x] for x in ("tokens", "d_in", "d_out", "n", "heads", "top_k", "query_dim"))
    N, dc = n * n, dq // 2
    g = torch.Generator(device=dev)
    g.manual_seed(1234)

    def uni(shape, a):
        return ((torch.rand(shape, generator=g, device=dev, dtype=torch.float32) * 2 - 1) * a).to(dt)

    x = uni((T, d_in), 1.0)
    wq = uni((d_in, h * dq), math.sqrt(3.0 / d_in))
    bq = uni((h * dq,), 0.1)
    k1, k2 = uni((n, dc), math.sqrt(3.0 / dc)), uni((n, dc), math.sqrt(3.0 / dc))
    u = uni((N, d_in), math.sqrt(3.0 / d_in))  # nn.Embedding(N, d_in): U rows (hidden 1)
    v = uni((N, d_out), 1.0)                   # nn.Embedding(N, d_out): V rows
    dy = uni((T, d_out), 1.0)

    def peer(x, wq, bq, k1, k2, u, v):
        q = (x @ wq + bq).view(T, h, 2, dc)
        s1 = q[:, :, 0] @ k1.t()  # [T, h, n]
        s2 = q[:, :, 1] @ k2.t()
        v1, i1 = s1.topk(k, dim=-1)
        v2, i2 = s2.topk(k, dim=-1)
        all_s = (v1[..., :, None] + v2[..., None, :]).reshape(T, h, k * k)
        all_i = (i1[..., :, None] * n + i2[..., None, :]).reshape(T, h, k * k)
        scores, pick = all_s.topk(k, dim=-1)
        ids = all_i.gather(-1, pick)        # [T, h, k]
        w_down = F.embedding(ids, u)        # [T, h, k, d_in]
        w_up = F.embedding(ids, v)          # [T, h, k, d_out]
        a = torch.einsum("td,thkd->thk", x, w_down)
        a = F.gelu(a) * scores.softmax(dim=-1)
        return torch.einsum("thk,thkd->td", a, w_up)

    def timed(fn, warmup, iters, before=None):
        for _ in range(warmup):
            if before:
                before()
            fn()
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            if before:
                before()
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) for a, b in ev]
        return statistics.median(ms), min(ms)

    out = dict(fwd_ms=None, fwd_min_ms=None, fwdbwd_ms=None, fwdbwd_min_ms=None)
    try:
        with torch.no_grad():
            out["fwd_ms"], out["fwd_min_ms"] = timed(lambda: peer(x, wq, bq, k1, k2, u, v), opts.warmup, opts.iters)
    except Exception as e:  # noqa: BLE001 - report and go on
        errors.append(f"torch forward: {type(e).__name__}: {e}")
    torch.cuda.empty_cache()
    try:
        leaves = [t.requires_grad_() for t in (x, wq, bq, k1, k2, u, v)]

        def clear():
            for t in leaves:
                t.grad = None

        def step():
            peer(*leaves).backward(dy)

        out["fwdbwd_ms"], out["fwdbwd_min_ms"] = timed(step, opts.warmup, opts.iters, before=clear)
        clear()
    except Exception as e:  # noqa: BLE001
        errors.append(f"torch fwd+bwd: {type(e).__name__}: {e}")
    out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del x, wq, bq, k1, k2, u, v, dy
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- main


def record_rows(opts, raw, tor, store, h2d, s_fb):
    """The run's figures as result rows: times against torch eager, the
    forward's traffic against the device copy, the store's miss path against
    pinned H2D."""
    f, b = raw.get("fwd", {}), raw.get("bwd", {})
    gpu = tor.get("gpu") or f.get("device_name") or "unknown"
    record = bench.Recorder(opts, gpu)
    eager = "torch eager"
    record("peer", "fwd", "bf16", f.get("median_ms"), eager, tor.get("fwd_ms"), "ms")
    record("peer", "fwd+bwd", "bf16", s_fb, eager, tor.get("fwdbwd_ms"), "ms")
    record("peer", "bwd (dense dU/dV)", "bf16", b.get("median_ms"), None, None, "ms")
    record("peer", "fwd traffic", "bf16", f.get("gbps"), "device copy", f.get("copy_gbps"), "GB/s")
    for r in store:
        zipf = "miss_path_gbps" in r
        record("peer_store", "Zipf(1.1) ids, a batch" if zipf else "uniform, a forward", "bf16", r.get("median_ms"),
               None, None, "ms")
        if zipf:
            record("peer_store", "miss path", "bf16", r["miss_path_gbps"], "pinned H2D", (h2d or {}).get("gbps"), "GB/s")


def ratio(a, b):
    return b / a if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="20 timed runs, 3 warm-up, no --check run")
    bench.add_common_args(ap, warmup=5, iters=30)
    ap.add_argument("--store", action="store_true",
                    help="also run the 16 GiB store cases (uniform forward, exact Zipf(1.1) ids) and the H2D ceiling")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny shape (64 tokens, 64^2 experts) to try the script, e.g. with --device cpu --no-torch")
    ap.add_argument("--no-torch", action="store_true", help="smelt only (no speedups)")
    opts = ap.parse_args()
    if opts.quick:
        opts.warmup, opts.iters = 3, 20
    opts.iters = max(opts.iters, 20)

    t_start = time.time()
    errors, raw = [], {}
    s = dict(SHAPE)
    if opts.tiny:
        s.update(tokens=64, d_in=64, d_out=64, n=64, heads=4, top_k=8, query_dim=32)
    timing = ["--warmup", str(opts.warmup), "--iters", str(opts.iters)]
    print(f"PEER acceptance: bf16 T={s['tokens']} d_in={s['d_in']} d_out={s['d_out']} experts={s['n']}^2 "
          f"heads={s['heads']} top_k={s['top_k']} query_dim={s['query_dim']} hidden={s['hidden']}", flush=True)

    for key, extra in (("fwd", []), ("bwd", ["--bwd"])):
        try:
            raw[key] = run_smelt(opts, smelt_args(s, timing + extra))
            print(f"  smelt {key}: {fmt(raw[key].get('median_ms'), '.3f')} ms median "
                  f"({raw[key]['wall_s']} s wall) {raw[key].get('kernel', '')}", flush=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"smelt {key}: {e}")
            print(f"  smelt {key}: ERROR {e}", flush=True)
    if not opts.quick:
        try:
            raw["check"] = run_smelt(opts, smelt_args(s, ["--bwd", "--check", "--warmup", "0", "--iters", "1"]))
            print(f"  smelt check: {raw['check'].get('check', '?')} (y rel_l2 {fmt(raw['check'].get('check_rel_l2'), '.2e')}, "
                  f"dx rel_l2 {fmt(raw['check'].get('check_dx_rel_l2'), '.2e')}, ids differing "
                  f"{raw['check'].get('check_id_mismatches')})", flush=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"smelt check: {e}")

    tor = {}
    if not opts.no_torch:
        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
            tor = torch_peer(torch, s, opts, errors)
            tor["torch"] = torch.__version__
            tor["gpu"] = torch.cuda.get_device_name()
            print(f"  torch eager ({tor['torch']}, {tor['gpu']}): fwd {fmt(tor.get('fwd_ms'), '.3f')} ms, "
                  f"fwd+bwd {fmt(tor.get('fwdbwd_ms'), '.3f')} ms, peak {tor.get('peak_gib')} GiB", flush=True)
        except Exception as e:  # noqa: BLE001
            errors.append(f"torch: {type(e).__name__}: {e}")

    store, h2d = [], None
    if opts.store:
        ss = dict(s, n=2048 if not opts.tiny else 128)
        cache = "2048" if not opts.tiny else "1"
        for name, extra in (("uniform", ["--routing", "uniform"]), ("zipf_ids", ["--zipf", "1.1"])):
            try:
                r = run_smelt(opts, smelt_args(ss, timing + ["--cache-mb", cache, *extra]))
                raw[f"store_{name}"] = r
                store.append(r)
            except Exception as e:  # noqa: BLE001
                errors.append(f"smelt store {name}: {e}")
        if opts.device == "cuda":
            try:
                p = subprocess.run([sys.executable, os.path.join(REPO, "bench", "h2d_bandwidth.py"), "--json"],
                                   capture_output=True, text=True, timeout=opts.timeout)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                if not lines:
                    raise RuntimeError(f"exited {p.returncode}: {(p.stderr.strip() or 'no output')[-300:]}")
                h2d = json.loads(lines[-1])
                raw["h2d"] = h2d
            except Exception as e:  # noqa: BLE001
                errors.append(f"h2d_bandwidth: {e}")

    # ---- the table
    f, b = raw.get("fwd", {}), raw.get("bwd", {})
    s_fwd = f.get("median_ms")
    s_fb = s_fwd + b["median_ms"] if s_fwd is not None and b.get("median_ms") is not None else None
    sp_fwd, sp_fb = ratio(s_fwd, tor.get("fwd_ms")), ratio(s_fb, tor.get("fwdbwd_ms"))
    pct = f.get("pct_of_copy")
    expert_gbps = f["expert_bytes"] / (s_fwd * 1e-3) / 1e9 if s_fwd and f.get("expert_bytes") else None
    expert_pct = 100.0 * expert_gbps / f["copy_gbps"] if expert_gbps and f.get("copy_gbps") else None
    checks = {
        "fwd_speedup": sp_fwd is not None and sp_fwd >= BARS["fwd_speedup"],
        "fwdbwd_speedup": sp_fb is not None and sp_fb >= BARS["fwdbwd_speedup"],
        "pct_of_copy": pct is not None and pct >= BARS["pct_of_copy"],
    }
    if "check" in raw:
        checks["smelt_check"] = raw["check"].get("check") == "ok"

    def yes(k):
        return "PASS" if checks.get(k) else "FAIL"

    print()
    print(f"  {'case':<10} {'smelt ms':>10} {'torch ms':>10} {'speedup':>8} {'bar':>6}  result")
    print(f"  {'fwd':<10} {fmt(s_fwd, '10.3f', 10)} {fmt(tor.get('fwd_ms'), '10.3f', 10)} "
          f"{fmt(sp_fwd, '7.2f', 7)}x {BARS['fwd_speedup']:5.1f}x  {yes('fwd_speedup')}")
    print(f"  {'fwd+bwd':<10} {fmt(s_fb, '10.3f', 10)} {fmt(tor.get('fwdbwd_ms'), '10.3f', 10)} "
          f"{fmt(sp_fb, '7.2f', 7)}x {BARS['fwdbwd_speedup']:5.1f}x  {yes('fwdbwd_speedup')}")
    print(f"  {'(bwd)':<10} {fmt(b.get('median_ms'), '10.3f', 10)}")
    print(f"  smelt fwd traffic {fmt(f.get('gbps'), '.1f')} GB/s = {fmt(pct, '.1f')}% of copy "
          f"({fmt(f.get('copy_gbps'), '.1f')} GB/s), bar {BARS['pct_of_copy']:.0f}%: {yes('pct_of_copy')}; "
          f"expert rows alone {fmt(expert_gbps, '.1f')} GB/s = {fmt(expert_pct, '.1f')}% of copy")
    if "smelt_check" in checks:
        print(f"  smelt --check against the CPU backend: {yes('smelt_check')}")
    for r in store:
        if "miss_path_gbps" not in r:
            print(f"  store fwd {r.get('routing')}: {r.get('experts')} experts, cache {r.get('cache_mb')} MiB: "
                  f"{fmt(r.get('median_ms'), '.3f')} ms a forward, hit rate "
                  f"{fmt(100 * (r.get('store_hit_rate') or 0), '.1f')}%, staged {r.get('store_bytes_staged')} B, "
                  f"mapped {r.get('store_bytes_mapped')} B over {r.get('store_batches')} batches")
            continue
        nb = r.get("warm_batches") or 0
        per_mb = r["warm_bytes_staged"] / nb / 1e6 if nb else None
        gbps, ceil = r.get("miss_path_gbps"), (h2d or {}).get("gbps")
        pct_h2d = 100.0 * gbps / ceil if gbps is not None and ceil else None
        if pct_h2d is not None:
            checks["store_miss_path_pct_of_h2d"] = pct_h2d >= BARS["pct_of_copy"]
        print(f"  store {r.get('routing')} ids (store batch alone, warm cache): {r.get('experts')} experts, cache "
              f"{r.get('cache_mb')} MiB ({r.get('store_slots')} slots): {fmt(r.get('median_ms'), '.3f')} ms a batch "
              f"(median), hit rate {fmt(100 * (r.get('warm_hit_rate') or 0), '.1f')}%, "
              f"{fmt(per_mb, '.1f')} MB staged a batch; miss path {fmt(gbps, '.1f')} GB/s sustained vs pinned H2D "
              f"{fmt(ceil, '.1f')} GB/s = {fmt(pct_h2d, '.1f')}%, bar {BARS['pct_of_copy']:.0f}%: "
              f"{yes('store_miss_path_pct_of_h2d')}")
    for e in errors:
        print(f"  error: {e}")
    ok = not errors and all(checks.values())
    if not opts.tiny and checks.get("smelt_check", True):
        record_rows(opts, raw, tor, store, h2d, s_fb)
    print(f"\n{'all bars met' if ok else 'NOT all bars met'} ({time.time() - t_start:.0f} s)")

    if opts.json_out:
        doc = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), commit=bench.git_commit(opts.commit),
                   shape=s, bars=BARS, smelt_fwd_ms=s_fwd, smelt_bwd_ms=b.get("median_ms"), smelt_fwdbwd_ms=s_fb,
                   torch=tor, speedup_fwd=sp_fwd, speedup_fwdbwd=sp_fb, pct_of_copy=pct, expert_gbps=expert_gbps,
                   expert_pct_of_copy=expert_pct, h2d=h2d, checks=checks, errors=errors, ok=ok, smelt=raw)
        try:
            with open(opts.json_out, "w") as fh:
                json.dump(doc, fh, indent=1)
        except OSError as e:
            print(f"  could not write {opts.json_out}: {e}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
