"""smelt.qgemm (NVFP4 weights x 16-bit activations) on the CPU with numpy,
against float64 products written here from the formats' definitions; the
unimplemented formats and a K that is not a multiple of 16 raise."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def e4m3(b):
    b = b.astype(np.int64)
    e, m = (b >> 3) & 15, b & 7
    v = np.where(e > 0, np.ldexp(1 + m / 8, e - 7), np.ldexp(m.astype(np.float64), -9))
    return np.where(b & 0x80, -v, v)


def dequant(q, s, ts):
    codes = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1)
    return E2M1[codes] * np.repeat(e4m3(s), 16, axis=1) * float(ts[0])


def weights(rng, n, k):
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = (rng.integers(4, 11, (n, k // 16)) << 3 | rng.integers(0, 8, (n, k // 16))).astype(np.uint8)
    return q, s, np.array([rng.uniform(0.5, 2.0)], np.float32)


@pytest.mark.parametrize("m,n,k", [(1, 37, 64), (3, 5, 16), (17, 11, 96)])
def test_qgemm(rng, m, n, k):
    x = rng.uniform(-1, 1, (m, k)).astype(np.float16)
    q, s, ts = weights(rng, n, k)
    bias = rng.uniform(-1, 1, n).astype(np.float32)
    want = 0.5 * (x.astype(np.float64) @ dequant(q, s, ts).T) + bias
    want = np.maximum(want, 0)
    d = smelt.qgemm(x, q, s, ts, bias, alpha=0.5, activation="relu", out_dtype="f32")
    assert d.shape == (m, n) and d.dtype == np.float32
    assert np.linalg.norm(d - want) <= 1e-6 * max(np.linalg.norm(want), 1e-30)


def test_qgemm_default_out_is_x_dtype(rng):
    x = rng.uniform(-1, 1, (2, 32)).astype(np.float16)
    q, s, ts = weights(rng, 3, 32)
    d = smelt.qgemm(x, q, s, ts)
    assert d.dtype == np.float16
    want = x.astype(np.float64) @ dequant(q, s, ts).T
    assert np.allclose(d, want, rtol=2e-3, atol=1e-3)


def test_qgemm_refuses(rng):
    x = rng.uniform(-1, 1, (2, 32)).astype(np.float16)
    q, s, ts = weights(rng, 3, 32)
    with pytest.raises(smelt.UnsupportedError, match="mxfp8"):
        smelt.qgemm(x, q, s, ts, format="mxfp8")
    with pytest.raises(smelt.UnsupportedError, match="f32 activations"):
        smelt.qgemm(x.astype(np.float32), q, s, ts)
    with pytest.raises(smelt.Error, match="multiple of 16"):
        smelt.qgemm(x[:, :24], q[:, :12], s[:, :2], ts)
    with pytest.raises(smelt.ArgumentError, match="format"):
        smelt.qgemm(x, q, s, ts, format="nvfp5")
