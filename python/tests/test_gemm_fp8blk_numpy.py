"""smelt.gemm(..., format='fp8-block'): DeepGEMM's block-scaled fp8 (1 x 128
scales of a, 128 x 128 scales of b given as the [K, N] view of a [N, K]
tensor) on the CPU with numpy and ml_dtypes, quantized here as smelt's
quantizers do (scale = amax / 448), against the float64 product of the
dequantized operands, plain and grouped by offsets; bad formats and scale
shapes raise."""

import pytest

np = pytest.importorskip("numpy")
ml_dtypes = pytest.importorskip("ml_dtypes")
import smelt  # noqa: E402

E4M3 = ml_dtypes.float8_e4m3fn


def quantize(x, rows_per_block):
    """x [R, K] f32 -> (q e4m3 [R, K], scales f32 [ceil(R/rb), ceil(K/128)])."""
    r, k = x.shape
    rb, kb = -(-r // rows_per_block), -(-k // 128)
    s = np.ones((rb, kb), np.float32)
    q = np.empty((r, k), E4M3)
    for i in range(rb):
        for j in range(kb):
            blk = x[i * rows_per_block:(i + 1) * rows_per_block, j * 128:(j + 1) * 128]
            amax = np.float32(np.abs(blk).max())
            s[i, j] = amax / np.float32(448) if amax > 0 else np.float32(1)
            q[i * rows_per_block:(i + 1) * rows_per_block, j * 128:(j + 1) * 128] = (blk / s[i, j]).astype(E4M3)
    return q, s


def dequantized(q, s, rows_per_block):
    x = q.astype(np.float64)
    rows = np.arange(q.shape[0]) // rows_per_block
    cols = np.arange(q.shape[1]) // 128
    return x * s[rows][:, cols]


@pytest.mark.parametrize("m,n,k", [(13, 9, 128), (70, 140, 300)])
def test_gemm_fp8_block(rng, m, n, k):
    # Blocks of K over many binades, as activation outliers make them.
    x = (rng.standard_normal((m, k)) * 2.0 ** (np.arange(k) // 128 * 4 - 4)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    qa, sa = quantize(x, 1)
    qw, sw = quantize(w, 128)
    bias = rng.standard_normal(n).astype(np.float32)
    d = smelt.gemm(qa, qw.T, bias=bias, scale_a=sa, scale_b=sw, format="fp8-block", out_dtype="f32")
    want = dequantized(qa, sa, 1) @ dequantized(qw, sw, 128).T + bias
    got = d.astype(np.float64)
    assert np.linalg.norm(got - want) <= 1e-6 * np.linalg.norm(want)


def test_gemm_fp8_block_errors(rng):
    q = np.zeros((4, 256), E4M3)
    sa, sb = np.ones((4, 2), np.float32), np.ones((1, 2), np.float32)
    with pytest.raises(smelt.ArgumentError, match="format="):
        smelt.gemm(q, q.T, scale_a=sa, scale_b=sb, format="mxfp8")
    with pytest.raises(smelt.ArgumentError, match="scales->a.shape"):
        smelt.gemm(q, q.T, scale_a=np.ones((4, 3), np.float32), scale_b=sb, format="fp8-block", out_dtype="f32")
    with pytest.raises(smelt.DTypeError, match="block scales need fp8"):
        smelt.gemm(q.astype(np.float32), q.T.astype(np.float32), scale_a=sa, scale_b=sb, format="fp8-block")


def test_gemm_grouped_fp8_block(rng):
    t, n, k, g = 40, 20, 200, 3
    offs = np.array([10, 10, 33], np.int64)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = rng.standard_normal((g, n, k)).astype(np.float32)
    qa, sa = quantize(x, 1)
    qw = np.empty((g, n, k), E4M3)
    sw = np.empty((g, 1, 2), np.float32)
    for i in range(g):
        qw[i], sw[i] = quantize(w[i], 128)
    d = np.zeros((t, n), np.float32)
    smelt.gemm_grouped(qa, np.transpose(qw, (0, 2, 1)), offs, out=d, scale_a=sa, scale_b=sw, format="fp8-block")
    da = dequantized(qa, sa, 1)
    want = np.zeros((t, n))
    for i, (r0, r1) in enumerate(zip([0, 10, 10], offs)):
        want[r0:r1] = da[r0:r1] @ dequantized(qw[i], sw[i], 128).T
    assert np.linalg.norm(d.astype(np.float64) - want) <= 1e-6 * np.linalg.norm(want)
