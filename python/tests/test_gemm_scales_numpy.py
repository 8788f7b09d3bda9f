"""smelt.gemm and smelt.gemm_grouped with row scales of a and column scales
of b (scale_a, scale_b: torch._scaled_mm's row-wise form) on the CPU with
numpy, against float64 products written here; bad scales raise with the
vector's name."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("sa_shape,sb_shape", [("m", "n"), ("m1", "1n"), (None, "n"), ("m", None)])
def test_gemm_scales(rng, sa_shape, sb_shape):
    m, n, k = 13, 9, 17
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    sa = rng.uniform(0.25, 2.0, m).astype(np.float32)
    sb = rng.uniform(0.25, 2.0, n).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    if sa_shape:
        want = want * sa[:, None]
    if sb_shape:
        want = want * sb[None, :]
    want = 0.5 * want + bias
    scale_a = None if sa_shape is None else sa if sa_shape == "m" else sa.reshape(m, 1)
    scale_b = None if sb_shape is None else sb if sb_shape == "n" else sb.reshape(1, n)
    d = smelt.gemm(a, b, bias=bias, alpha=0.5, scale_a=scale_a, scale_b=scale_b)
    assert rel_err(d, want) < 1e-6


def test_gemm_grouped_scales(rng):
    t, n, k, g = 20, 6, 8, 3
    offs = np.array([5, 5, 17], np.int64)
    a = rng.standard_normal((t, k)).astype(np.float32)
    b = rng.standard_normal((g, k, n)).astype(np.float32)
    sa = rng.uniform(0.25, 2.0, t).astype(np.float32)
    sb = rng.uniform(0.25, 2.0, (g, n)).astype(np.float32)
    want = np.zeros((t, n))
    start = 0
    for gi, end in enumerate(offs):
        want[start:end] = (a[start:end].astype(np.float64) @ b[gi]) * sa[start:end, None] * sb[gi]
        start = end
    d = smelt.gemm_grouped(a, b, offs, scale_a=sa, scale_b=sb)
    assert rel_err(d, want) < 1e-6


def test_gemm_bad_scales(rng):
    a = np.ones((4, 3), np.float32)
    b = np.ones((3, 5), np.float32)
    with pytest.raises(smelt.ArgumentError, match="scales->a.shape"):
        smelt.gemm(a, b, scale_a=np.ones(5, np.float32))
    with pytest.raises(smelt.DTypeError, match="scales->b"):
        smelt.gemm(a, b, scale_b=np.ones(5, np.float64))
