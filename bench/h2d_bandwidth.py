#!/usr/bin/env python3
"""Host-to-device copy bandwidth from pinned memory, the ceiling the PEER
store's miss path is judged against (issue 6: misses move data at >= 70% of
it). torch copies a pinned host tensor to the GPU with non_blocking=True;
CUDA events around each copy, median of the timed runs.

Usage: python3 bench/h2d_bandwidth.py [--mib 1024] [--iters 20] [--json]
"""

import argparse
import json
import statistics


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="bytes per copy, in MiB (default 1024)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed copies first (default 3)")
    ap.add_argument("--iters", type=int, default=20, help="timed copies (default 20)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead of text")
    args = ap.parse_args()

    import torch

    n = args.mib << 20
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    times = []
    for i in range(args.warmup + args.iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        stop.record()
        stop.synchronize()
        if i >= args.warmup:
            times.append(start.elapsed_time(stop))
    ms = statistics.median(times)
    gbps = n / (ms * 1e-3) / 1e9
    if args.json:
        print(json.dumps({"op": "h2d", "bytes": n, "median_ms": ms, "gbps": gbps}))
    else:
        print(f"h2d pinned {args.mib} MiB: {ms:.3f} ms median of {args.iters}, {gbps:.1f} GB/s")


if __name__ == "__main__":
    main()
