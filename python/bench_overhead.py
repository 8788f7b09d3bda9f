#!/usr/bin/env python3
"""Per-call overhead of a trivial op from Python: smelt's direct call, the
torch custom op (torch.ops.smelt.*) and torch's own op, on tensors so small
that the time is all overhead (launch + binding + allocation).

    PYTHONPATH=python python3 python/bench_overhead.py [--device cuda] [--numel 1] [--json out.json]

Each call is timed on its own with perf_counter_ns after a warm-up; the
table gives the median and the 10th/90th percentiles in microseconds, and
the mean over batches of back-to-back calls (with a synchronize per batch so
the launch queue never fills). Outputs are allocated per call (as torch's op
does) unless the row says out=.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import smelt
import smelt.torch  # noqa: F401  (registers torch.ops.smelt)


def measure(fn, sync, calls, batches, batch):
    for _ in range(200):
        fn()
    sync()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        fn()
        samples.append(clock() - t0)
        if len(samples) % 256 == 0:
            sync()
    sync()
    means = []
    for _ in range(batches):
        t0 = clock()
        for _ in range(batch):
            fn()
        t1 = clock()
        sync()
        means.append((t1 - t0) / batch)
    samples.sort()
    us = lambda ns: ns / 1e3  # noqa: E731
    return {
        "median_us": us(statistics.median(samples)),
        "p10_us": us(samples[len(samples) // 10]),
        "p90_us": us(samples[len(samples) * 9 // 10]),
        "batch_mean_us": us(statistics.median(means)),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--numel", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.numel, device=dev, dtype=dtype)
    out = torch.empty_like(x)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    op = torch.ops.smelt.activation

    rows = [
        ("smelt.activation(x, 'relu')", lambda: smelt.activation(x, "relu")),
        ("smelt.activation(x, 'relu', out=out)", lambda: smelt.activation(x, "relu", out=out)),
        ("smelt.activation(x, 'gelu')", lambda: smelt.activation(x, "gelu")),
        ("torch.ops.smelt.activation(x, 'relu')", lambda: op(x, "relu", 0.01)),
        ("torch.ops.smelt.activation(x, 'gelu')", lambda: op(x, "gelu", 0.01)),
        ("torch.relu(x)", lambda: torch.relu(x)),
        ("torch.clamp_min(x, 0, out=out)", lambda: torch.clamp_min(x, 0, out=out)),
        ("F.gelu(x)", lambda: F.gelu(x)),
    ]
    # Correctness first: a benchmark of wrong results is worthless.
    assert torch.equal(smelt.activation(x, "relu"), torch.relu(x))
    assert torch.allclose(op(x, "gelu", 0.01), F.gelu(x), atol=1e-6)

    results = {}
    print("device %s (%s), %s[%d], python %s, torch %s, smelt %s" % (
        dev, torch.cuda.get_device_name(dev) if dev.type == "cuda" else "host", args.dtype, args.numel,
        sys.version.split()[0], torch.__version__, smelt.__version__))
    print("%-40s %9s %9s %9s %11s" % ("call", "median", "p10", "p90", "batch mean"))
    for name, fn in rows:
        r = measure(fn, sync, args.calls, args.batches, args.batch)
        results[name] = r
        print("%-40s %8.2fus %8.2fus %8.2fus %10.2fus" % (
            name, r["median_us"], r["p10_us"], r["p90_us"], r["batch_mean_us"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(dev), "numel": args.numel, "dtype": args.dtype, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
