#!/usr/bin/env python3
"""Which kernels the GEMM peers run, and how long each takes (GPU, torch).

For the cases of bench/gemm_vs_peers.py, runs the peer (torch.matmul,
torch._grouped_mm) under torch.profiler and prints every CUDA kernel it
launched with its mean time. The kernel names say cuBLAS's tile, cluster,
split-K or stream-K choice, which is what our selector is measured against.

    python3 bench/peer_kernels.py [--cases skinny_bf16,bf16_4096]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gemm_vs_peers as G  # noqa: E402


def peer_call(torch, peer):
    p = G.make_peer(torch, peer, None)
    if p.setup:
        p.setup()
    s = p.make()
    return lambda: p.call(s)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="bf16_4096,bf16_8192,skinny_bf16,grouped_8x1024x14336x4096,grouped_64_uneven")
    ap.add_argument("--iters", type=int, default=20)
    opts = ap.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    wanted = [s.strip() for s in opts.cases.split(",") if s.strip()]
    for c in G.CASES:
        if c["name"] not in wanted or c["peer"][0] not in ("matmul", "grouped_mm"):
            continue
        f = peer_call(torch, c["peer"])
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(opts.iters):
                f()
            torch.cuda.synchronize()
        print(f"== {c['title']}")
        for ev in prof.key_averages():
            if ev.device_type is not None and "CUDA" in str(ev.device_type) and ev.count:
                mean = ev.device_time_total / ev.count if hasattr(ev, "device_time_total") else ev.cuda_time
                print(f"  {mean:9.1f} us x{ev.count // opts.iters:<2d} {ev.key[:160]}")


if __name__ == "__main__":
    main()
