"""smelt.bem_update, bem_backward, bem_validate and bem_benchmark on the CPU
backend with numpy arrays: the update against a float64 reference written
here (rank 1 and odd sizes, accumulate, u pre-transposed through strides,
segments of several adapters with an empty one and rows in none, per-adapter
scales), every gradient against central finite differences of the
reference's objective sum(ΔY ∘ dy), the validation and benchmark dicts, and
bad arguments refused with an error naming the tensor and nothing written."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

CPU = smelt.default_context("cpu")


def bounds(offsets, A, M):
    """The segments' row ends: a running maximum of offsets clamped to [0, M]."""
    if offsets is None:
        return [0, M]
    run, o = 0, []
    for a in range(A + 1):
        run = max(run, int(offsets[a]))
        o.append(min(run, M))
    return o


def ref_update(x, v, codes, u, scale=1.0, offsets=None, scales=None):
    """ΔY in float64; v and u [A, ., r] with offsets, [., r] without."""
    x, codes = x.astype(np.float64), codes.astype(np.float64)
    v = v.astype(np.float64)[None] if offsets is None else v.astype(np.float64)
    u = u.astype(np.float64)[None] if offsets is None else u.astype(np.float64)
    M, A = x.shape[0], v.shape[0]
    o = bounds(offsets, A, M)
    y = np.zeros((M, u.shape[1]))
    for a in range(A):
        s = scale * (1.0 if scales is None else float(scales[a]))
        lo, hi = o[a], o[a + 1]
        y[lo:hi] = s * ((x[lo:hi] @ v[a]) * codes[lo:hi]) @ u[a].T
    return y


def problem(rng, M=7, din=5, dout=6, r=3, A=0, dtype=np.float32):
    """x, v, codes, u (A adapters when A > 0)."""
    w = (A,) if A else ()
    x = rng.uniform(-1, 1, (M, din)).astype(dtype)
    v = rng.uniform(-0.5, 0.5, w + (din, r)).astype(dtype)
    codes = rng.uniform(-2, 2, (M, r)).astype(dtype)
    u = rng.uniform(-0.5, 0.5, w + (dout, r)).astype(dtype)
    return x, v, codes, u


def close(got, want, rtol=2e-6):
    """|got - want| <= rtol · max |want| everywhere (the reference computes in
    double and rounds once: f32 results are within an ulp or two)."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= rtol * max(np.abs(want).max(), 1e-30)


# ---- the update


@pytest.mark.parametrize("M,din,dout,r", [(7, 5, 6, 3), (1, 1, 1, 1), (13, 33, 17, 1), (9, 16, 24, 128)])
def test_update(rng, M, din, dout, r):
    x, v, codes, u = problem(rng, M, din, dout, r)
    y = smelt.bem_update(x, v, codes, u, scale=0.75)
    assert y.dtype == np.float32 and y.shape == (M, dout)
    close(y, ref_update(x, v, codes, u, 0.75))


def test_update_f16(rng):
    x, v, codes, u = problem(rng, 11, 20, 9, 4, dtype=np.float16)
    y = smelt.bem_update(x, v, codes, u, scale=2.0)
    assert y.dtype == np.float16
    close(y, ref_update(x, v, codes, u, 2.0), rtol=1e-3)


def test_accumulate_and_out(rng):
    x, v, codes, u = problem(rng)
    base = rng.uniform(-1, 1, (7, 6)).astype(np.float32)
    out = base.copy()
    assert smelt.bem_update(x, v, codes, u, scale=0.5, accumulate=True, out=out, ctx=CPU) is out
    close(out, base + ref_update(x, v, codes, u, 0.5))
    out2 = np.full((7, 6), np.nan, np.float32)
    assert smelt.bem_update(x, v, codes, u, out=out2) is out2  # overwritten, NaN not read
    close(out2, ref_update(x, v, codes, u))


def test_u_transposed_through_strides(rng):
    """u stored [r, d_out] (the seed's layout): given as such with
    u_transposed=True, or as its transposed numpy view; same result as u."""
    x, v, codes, u = problem(rng, 9, 8, 10, 4)
    want = ref_update(x, v, codes, u, 1.5)
    ut = np.ascontiguousarray(u.T)
    close(smelt.bem_update(x, v, codes, ut, scale=1.5, u_transposed=True), want)
    close(smelt.bem_update(x, v, codes, ut.T, scale=1.5), want)  # strides (1, d_out) elements
    # v and codes through strides too: column slices of wider arrays.
    vw = np.zeros((8, 9), np.float32)
    vw[:, ::2][:, :4] = v
    close(smelt.bem_update(x, vw[:, ::2][:, :4], codes, ut.T, scale=1.5), want)


@pytest.mark.parametrize("offsets", [[0, 4, 4, 9], [2, 6, 3, 40]], ids=["empty_segment", "clamped"])
@pytest.mark.parametrize("itype", [np.int32, np.int64])
def test_segments(rng, offsets, itype):
    """Three adapters; an empty segment (or a decreasing end, clamped to the
    running maximum) and rows in no segment: zero, or left as they were
    with accumulate."""
    M = 11
    x, v, codes, u = problem(rng, M, 6, 5, 3, A=3)
    offs = np.array(offsets, itype)
    scales = np.array([0.5, -2.0, 1.25], np.float32)
    want = ref_update(x, v, codes, u, 0.8, offs, scales)
    y = np.full((M, 5), np.nan, np.float32)
    smelt.bem_update(x, v, codes, u, scale=0.8, offsets=offs, scales=scales, out=y)
    close(y, want)
    o = bounds(offs, 3, M)
    assert not y[: o[0]].any() and not y[o[3]:].any()
    base = rng.uniform(-1, 1, (M, 5)).astype(np.float32)
    acc = base.copy()
    smelt.bem_update(x, v, codes, u, scale=0.8, offsets=offs, scales=scales, accumulate=True, out=acc)
    close(acc, base + want)
    assert np.array_equal(acc[o[3]:], base[o[3]:])


def test_scales_one_adapter(rng):
    x, v, codes, u = problem(rng)
    close(smelt.bem_update(x, v, codes, u, scale=2.0, scales=np.array([-0.25], np.float32)),
          ref_update(x, v, codes, u, -0.5))


# ---- the backward


def fd_grads(dy, x, v, codes, u, scale, offsets, scales, u_transposed=False):
    """Central differences of sum(ΔY ∘ dy) in float64 (exact up to rounding:
    ΔY is linear in each argument); du in u's layout as given."""
    args = [a.astype(np.float64) for a in (x, v, codes, u)]

    def f(a):
        uu = np.swapaxes(a[3], -1, -2) if u_transposed else a[3]
        return (ref_update(a[0], a[1], a[2], uu, scale, offsets, scales) * dy).sum()

    grads = []
    for i in range(4):
        g = np.zeros_like(args[i])
        for j in np.ndindex(*args[i].shape):
            keep = args[i][j]
            args[i][j] = keep + 0.5
            hi = f(args)
            args[i][j] = keep - 0.5
            lo = f(args)
            args[i][j] = keep
            g[j] = hi - lo
        grads.append(g)
    return dict(zip(("dx", "dv", "dcodes", "du"), grads))


@pytest.mark.parametrize("segments", [False, True], ids=["one", "segments"])
def test_backward_vs_finite_differences(rng, segments):
    M, dout = 9, 5
    x, v, codes, u = problem(rng, M, 4, dout, 3, A=3 if segments else 0)
    offs = np.array([1, 4, 4, 7], np.int64) if segments else None
    scales = np.array([0.5, 3.0, -1.0], np.float32) if segments else None
    dy = rng.uniform(-1, 1, (M, dout)).astype(np.float32)
    g = smelt.bem_backward(dy, x, v, codes, u, scale=0.7, offsets=offs, scales=scales)
    want = fd_grads(dy.astype(np.float64), x, v, codes, u, 0.7, offs, scales)
    assert sorted(g) == ["dcodes", "du", "dv", "dx"]
    for n in g:
        assert g[n].dtype == np.float32
        close(g[n], want[n], 1e-5)
    if segments:  # rows in no segment (before 1, from 7 on)
        assert not g["dx"][0].any() and not g["dx"][7:].any() and not g["dcodes"][7:].any()


def test_backward_needs_out_and_u_transposed(rng):
    x, v, codes, u = problem(rng, 6, 5, 7, 2)
    ut = np.ascontiguousarray(u.T)
    dy = rng.uniform(-1, 1, (6, 7)).astype(np.float32)
    want = fd_grads(dy.astype(np.float64), x, v, codes, ut, 1.3, None, None, u_transposed=True)
    du = np.full(ut.shape, np.nan, np.float32)
    g = smelt.bem_backward(dy, x, v, codes, ut, scale=1.3, u_transposed=True, needs=["du", "dcodes"],
                           out={"du": du})
    assert sorted(g) == ["dcodes", "du"] and g["du"] is du and du.shape == (2, 7)
    close(du, want["du"], 1e-5)
    close(g["dcodes"], want["dcodes"], 1e-5)


# ---- validation and the benchmark


def test_validate(rng):
    x, v, codes, u = problem(rng, 10, 12, 8, 4)
    base = rng.uniform(-1, 1, (10, 8)).astype(np.float32)
    out = base.copy()
    c = smelt.bem_validate(x, v, codes, u, scale=0.5, accumulate=True, out=out)
    assert c["passed"] is True and c["max_rel"] <= c["tolerance"] and c["tolerance"] > 0
    assert c["out"] is out and 0 <= c["worst"] < out.size and c["max_abs"] >= 0 and c["rel_l2"] >= 0
    close(out, base + ref_update(x, v, codes, u, 0.5))
    c = smelt.bem_validate(x, v, codes, u, tolerance=1e-3)
    assert c["passed"] and c["tolerance"] == 1e-3 and c["out"].shape == (10, 8)


def test_benchmark(rng):
    x, v, codes, u = problem(rng, 16, 8, 8, 2)
    t = smelt.bem_benchmark(x, v, codes, u, scale=2.0, warmup=0, iters=2)
    assert sorted(t) == ["base_ms", "fused_gbps", "fused_ms", "overhead_pct", "speedup", "unfused_ms"]
    assert all(t[k] > 0 for k in ("fused_ms", "unfused_ms", "base_ms", "speedup", "overhead_pct"))


# ---- errors: the tensor named, nothing written


def refused(exc, match, call, out):
    before = out.copy()
    with pytest.raises(exc, match=match):
        call()
    assert np.array_equal(out, before, equal_nan=True)


def test_errors_write_nothing(rng):
    x, v, codes, u = problem(rng)
    out = np.full((7, 6), 3.0, np.float32)
    refused(smelt.ArgumentError, r"bem_update: codes\.shape", lambda: smelt.bem_update(x, v, codes[:5], u, out=out), out)
    refused(smelt.ArgumentError, r"v\.shape", lambda: smelt.bem_update(x, v[:4], codes, u, out=out), out)
    refused(smelt.ArgumentError, r"u\.shape", lambda: smelt.bem_update(x, v, codes, u[:, :2], out=out), out)
    refused(smelt.DTypeError, r"codes\.dtype", lambda: smelt.bem_update(x, v, codes.astype(np.float16), u, out=out), out)
    refused(smelt.DTypeError, r"x\.dtype", lambda: smelt.bem_update(x.astype(np.float64), v.astype(np.float64),
                                                           codes.astype(np.float64), u.astype(np.float64),
                                                           out=out.astype(np.float64)), out)
    refused(smelt.ArgumentError, "scale=inf", lambda: smelt.bem_update(x, v, codes, u, scale=float("inf"), out=out), out)
    refused(smelt.ArgumentError, r"out\.shape", lambda: smelt.bem_update(x, v, codes, u, out=out[:, :5]), out)
    refused(smelt.ArgumentError, r"offsets\.shape", lambda: smelt.bem_update(
        x, v[None], codes, u[None], offsets=np.array([0, 7, 7], np.int64), out=out), out)
    refused(smelt.ArgumentError, r"scales\.shape", lambda: smelt.bem_update(
        x, v, codes, u, scales=np.ones(2, np.float32), out=out), out)
    with pytest.raises(smelt.ArgumentError, match="accumulate"):
        smelt.bem_update(x, v, codes, u, accumulate=True)
    with pytest.raises(smelt.DTypeError, match="codes"):
        smelt.bem_update(x, v, [[1.0]], u)
    big = problem(rng, 3, 4, 5, 129)
    with pytest.raises(smelt.UnsupportedError, match="rank"):
        smelt.bem_update(*big)


def test_backward_errors_write_nothing(rng):
    x, v, codes, u = problem(rng)
    dy = rng.uniform(-1, 1, (7, 6)).astype(np.float32)
    dx = np.full(x.shape, 5.0, np.float32)
    refused(smelt.ArgumentError, r"bem_backward: dy\.shape", lambda: smelt.bem_backward(dy[:6], x, v, codes, u, out={"dx": dx}), dx)
    refused(smelt.ArgumentError, r"dv\.shape", lambda: smelt.bem_backward(
        dy, x, v, codes, u, out={"dx": dx, "dv": np.zeros((4, 3), np.float32)}), dx)
    with pytest.raises(smelt.ArgumentError, match="dw"):
        smelt.bem_backward(dy, x, v, codes, u, needs=["dw"])
