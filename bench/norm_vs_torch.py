#!/usr/bin/env python3
"""smelt's norms, fused residual norms and rotary against torch on one GPU, in GB/s and as a share of copy bandwidth.

Both sides run in this process on torch tensors (smelt through its Python
binding, on torch's current stream), timed with CUDA events over input sets
rotated past 2x L2 (benchlib.time_rotated), after one checked run: smelt's
result is compared with torch's (relative L2 in float64) and a case whose
error exceeds the dtype's bound is reported as failed rather than timed.

  rms, layer        y = norm(x)·w (+ b): smelt.rms_norm / layer_norm against
                    F.rms_norm (torch >= 2.4; a torch-op RMSNorm before) and
                    F.layer_norm. Bytes: x read, y written.
  add_rms, add_layer the fused residual form (y, h) = norm(x + r), h kept:
                    smelt.add_rms_norm / add_layer_norm against h = x + r
                    then F.rms_norm / F.layer_norm. Bytes: x, r read, y, h written.
  *_fb              forward + backward (dx, dweight): smelt's forward with
                    its statistics and smelt.norm_backward against torch's
                    forward and autograd backward. Bytes: the forward's, then
                    dy, x read and dx written.
  rotary_neox/gptj  Q [B, S, H, D] rotated: smelt.rotary against the usual
                    torch form x·cos + rotate_half(x)·sin (NeoX halves; GPT-J
                    pairs by a view as [..., D/2, 2]) with [S, D] tables.
                    Bytes: x read, y written.
GB/s count bytes read plus bytes written once, as `smelt bench copy` does;
copy is torch's device-to-device copy of the case's x bytes, measured in the
same run. The bar (issue 29): the norms at 16384 x 4096 bf16 at >= 80% of
copy bandwidth.

Usage (from the repository root, after python/build_inplace.py --lib build):
    PYTHONPATH=python python3 bench/norm_vs_torch.py              # every case
    PYTHONPATH=python python3 bench/norm_vs_torch.py --quick      # the 16384 x 4096 norms and rotary
    PYTHONPATH=python python3 bench/norm_vs_torch.py --cases rms_16k_4096 --results /tmp/rows.jsonl
Each result is appended to bench/results.jsonl (--results PATH elsewhere,
--no-results for none). Exit status: 0 when every case ran, passed its check
and met its bar, 1 otherwise.
"""

import math
import sys

import benchlib as bench
from benchlib import fmt

BOUND = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-5}


def case(name, op, shape, bar=None, quick=False):
    return dict(name=name, op=op, shape=shape, bar=bar, quick=quick)


CASES = [
    case("rms_16k_4096", "rms", (16384, 4096), bar=80.0, quick=True),
    case("layer_16k_4096", "layer", (16384, 4096), bar=80.0, quick=True),
    case("add_rms_16k_4096", "add_rms", (16384, 4096), bar=80.0, quick=True),
    case("add_layer_16k_4096", "add_layer", (16384, 4096)),
    case("rms_fb_16k_4096", "rms_fb", (16384, 4096), quick=True),
    case("layer_fb_16k_4096", "layer_fb", (16384, 4096)),
    case("layer_gpt2_16k_768", "layer", (16384, 768)),
    case("add_layer_gpt2_16k_768", "add_layer", (16384, 768)),
    case("rms_llama_8k_8192", "rms", (8192, 8192)),
    case("rotary_neox_b4s2048", "rotary_neox", (4, 2048, 32, 128), quick=True),
    case("rotary_gptj_b4s2048", "rotary_gptj", (4, 2048, 32, 128)),
]


def moved_bytes(c, esize):
    n = math.prod(c["shape"]) * esize
    return {"rms": 2, "layer": 2, "add_rms": 4, "add_layer": 4, "rms_fb": 5, "layer_fb": 5, "rotary_neox": 2,
            "rotary_gptj": 2}[c["op"]] * n


# ---------------------------------------------------------------- the two sides


def make_set(torch, c, dtype):
    """One input set: x (and r, dy), the parameters, the rotary tables."""
    import smelt

    dev = "cuda"
    s = dict(x=torch.randn(c["shape"], device=dev, dtype=dtype))
    C = c["shape"][-1]
    if c["op"].startswith("rotary"):
        S, D = c["shape"][1], c["shape"][3]
        cos, sin = smelt.rotary_tables(S, D)
        s["cos"], s["sin"] = torch.from_numpy(cos).to(dev), torch.from_numpy(sin).to(dev)
        # torch's full-width tables, as Hugging Face's rotary embedding builds them.
        if c["op"] == "rotary_neox":
            s["tcos"] = torch.cat([s["cos"], s["cos"]], -1)[:, None, :].to(dtype)
            s["tsin"] = torch.cat([s["sin"], s["sin"]], -1)[:, None, :].to(dtype)
        else:
            s["tcos"] = s["cos"].repeat_interleave(2, -1)[:, None, :].to(dtype)
            s["tsin"] = s["sin"].repeat_interleave(2, -1)[:, None, :].to(dtype)
        return s
    s["w"] = (1 + 0.1 * torch.randn(C, device=dev)).to(dtype)
    s["b"] = (0.1 * torch.randn(C, device=dev)).to(dtype) if "layer" in c["op"] else None
    if c["op"].startswith("add_"):
        s["r"] = torch.randn(c["shape"], device=dev, dtype=dtype)
    if c["op"].endswith("_fb"):
        s["dy"] = torch.randn(c["shape"], device=dev, dtype=dtype)
    return s


def torch_rms(torch, x, w, eps):
    F = torch.nn.functional
    if hasattr(F, "rms_norm"):
        return F.rms_norm(x, x.shape[-1:], w, eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def torch_norm(torch, kind, x, w, b):
    if kind == "rms":
        return torch_rms(torch, x, w, 1e-6)
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, 1e-5)


def torch_rotary(torch, s, gptj):
    x = s["x"]
    if gptj:
        p = x.unflatten(-1, (-1, 2))
        rot = torch.stack((-p[..., 1], p[..., 0]), -1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    return x * s["tcos"] + rot * s["tsin"]


def calls(torch, c):
    """(smelt call, torch call): each takes a set and returns what is checked."""
    import smelt

    op = c["op"]
    kind = "layer" if "layer" in op else "rms"
    if op.startswith("rotary"):
        lay = "gptj" if op.endswith("gptj") else "neox"
        return (lambda s: smelt.rotary(s["x"], s["cos"], s["sin"], layout=lay),
                lambda s: torch_rotary(torch, s, lay == "gptj"))
    if op in ("rms", "layer"):
        f = smelt.rms_norm if kind == "rms" else smelt.layer_norm
        return ((lambda s: f(s["x"], s["w"])) if kind == "rms" else (lambda s: f(s["x"], s["w"], s["b"])),
                lambda s: torch_norm(torch, kind, s["x"], s["w"], s["b"]))
    if op.startswith("add_"):
        def smelt_add(s):
            if kind == "rms":
                return smelt.add_rms_norm(s["x"], s["r"], s["w"])[0]
            return smelt.add_layer_norm(s["x"], s["r"], s["w"], s["b"])[0]
        return smelt_add, lambda s: torch_norm(torch, kind, s["x"] + s["r"], s["w"], s["b"])

    def smelt_fb(s):
        if kind == "rms":
            y, rstd = smelt.rms_norm(s["x"], s["w"], return_stats=True)
            mean = None
        else:
            y, mean, rstd = smelt.layer_norm(s["x"], s["w"], s["b"], return_stats=True)
        return smelt.norm_backward(kind, s["dy"], s["x"], rstd, s["w"], mean)[0]

    def torch_fb(s):
        x = s["x"].detach().requires_grad_()
        w = s["w"].detach().requires_grad_()
        y = torch_norm(torch, kind, x, w, s["b"])
        return torch.autograd.grad(y, (x, w), s["dy"])[0]

    return smelt_fb, torch_fb


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------- the run


def run_case(torch, c, opts, copy_gbps):
    dtype = getattr(torch, opts.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    per_set = moved_bytes(c, esize)
    nsets = bench.rotation_sets(torch, per_set, 0.5, 8)
    data = [make_set(torch, c, dtype) for _ in range(nsets)]
    smelt_call, torch_call = calls(torch, c)
    r = dict(case=c["name"], op=c["op"], shape=list(c["shape"]), dtype=opts.dtype, bytes=per_set)
    r["check"] = err = rel_err(smelt_call(data[0]), torch_call(data[0]))
    if not err <= 2 * BOUND[opts.dtype]:
        r["error"] = f"smelt differs from torch: rel err {err:.3g}"
        return r
    for side, call in (("smelt", smelt_call), ("torch", torch_call)):
        ms, _ = bench.time_rotated(torch, call, data, opts)
        r[f"{side}_ms"] = ms[len(ms) // 2]
        r[f"{side}_gbps"] = per_set / (r[f"{side}_ms"] * 1e-3) / 1e9
    r["pct_of_copy"] = 100.0 * r["smelt_gbps"] / copy_gbps if copy_gbps else None
    return r


def copy_bandwidth(torch, nbytes, opts):
    """GB/s of torch's device copy of nbytes (read + write counted)."""
    src = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    dst = [torch.empty_like(s) for s in src]
    ms, _ = bench.time_rotated(torch, lambda i: dst[i].copy_(src[i]), [0, 1], opts)
    return 2 * nbytes / (ms[len(ms) // 2] * 1e-3) / 1e9


def main():
    ap = bench.case_parser(__doc__, CASES, "the 16384 x 4096 norms and rotary", "every case")
    bench.add_common_args(ap, warmup=10, iters=50)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(BOUND), help="element type (default bfloat16)")
    opts = ap.parse_args()
    if opts.list:
        for c in CASES:
            print(f"{c['name']:26s} {c['op']:12s} {c['shape']}")
        return 0
    if opts.iters < 20:
        ap.error("--iters must be at least 20")
    selected = [c for c in CASES if c["quick"]] if opts.quick and not opts.cases else \
        bench.select_cases(ap, opts, CASES, lambda c: True)
    torch = bench.cuda_torch("norm_vs_torch")
    if torch is None:
        return 1
    gpu = torch.cuda.get_device_name(0)
    record = bench.Recorder(opts, gpu)
    esize = torch.empty((), dtype=getattr(torch, opts.dtype)).element_size()
    print(f"{gpu}, torch {torch.__version__}, {opts.dtype}, median of {opts.iters} runs\n")
    print(f"{'case':26s} {'smelt ms':>9s} {'torch ms':>9s} {'smelt GB/s':>10s} {'torch GB/s':>10s} "
          f"{'x torch':>7s} {'% copy':>6s}  check")
    results, ok = [], True
    for c in selected:
        copy = copy_bandwidth(torch, math.prod(c["shape"]) * esize, opts)
        try:
            r = run_case(torch, c, opts, copy)
        except Exception as e:  # one case's failure must not hide the others
            r = dict(case=c["name"], error=str(e))
        r["copy_gbps"] = copy
        results.append(r)
        if "error" in r:
            ok = False
            print(f"{c['name']:26s} FAILED: {r['error']}")
            continue
        ratio = r["smelt_gbps"] / r["torch_gbps"]
        met = c["bar"] is None or (r["pct_of_copy"] or 0) >= c["bar"]
        ok = ok and met
        print(f"{c['name']:26s} {fmt(r['smelt_ms'], '9.4f')} {fmt(r['torch_ms'], '9.4f')} "
              f"{fmt(r['smelt_gbps'], '10.0f')} {fmt(r['torch_gbps'], '10.0f')} {fmt(ratio, '7.2f')} "
              f"{fmt(r['pct_of_copy'], '6.1f')}  {r['check']:.2e}{'' if met else '  (below the bar)'}")
        record("norm", c["name"], opts.dtype, r["smelt_gbps"], "torch", r["torch_gbps"], "GB/s")
        record("norm", c["name"], opts.dtype, r["pct_of_copy"], "copy", 100.0, "%", note="share of copy bandwidth")
    bench.write_json(opts, torch, record, bench.utc_now(), results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
