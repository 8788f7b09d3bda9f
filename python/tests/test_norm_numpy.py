"""smelt.rms_norm, layer_norm, their fused residual forms, norm_backward,
residual_add, rotary and rotary_tables on the CPU with numpy, against
float64 references written here; errors name the argument."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402
from norm_common import ref_rotary  # noqa: E402

TOL = {np.float32: 2e-5, np.float16: 2e-3}


def close(got, want, dt):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    err = np.abs(got - want) / (np.abs(want) + 1)
    assert err.max() <= TOL[dt], "max err %g" % err.max()


def ref_norm(kind, h, w, b, eps):
    h = h.astype(np.float64)
    mean = h.mean(-1, keepdims=True) if kind == "layer" else np.zeros(h.shape[:-1] + (1,))
    rstd = 1 / np.sqrt(((h - mean) ** 2).mean(-1, keepdims=True) + eps)
    y = (h - mean) * rstd
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return y, mean[..., 0], rstd[..., 0]


def ref_norm_bwd(kind, dy, h, w, mean, rstd):
    dy, h = dy.astype(np.float64), h.astype(np.float64)
    xh = (h - mean[..., None]) * rstd[..., None]
    g = dy * (w if w is not None else 1.0)
    mg = g.mean(-1, keepdims=True) if kind == "layer" else 0.0
    dx = rstd[..., None] * (g - mg - xh * (g * xh).mean(-1, keepdims=True))
    red = tuple(range(dy.ndim - 1))
    return dx, (dy * xh).sum(red), dy.sum(red)


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dt", [np.float32, np.float16])
@pytest.mark.parametrize("C", [1, 7, 64, 1000])
def test_norm_forward(rng, kind, dt, C):
    x = rng.uniform(-1, 3, (3, 5, C)).astype(dt)
    w = rng.uniform(0.5, 1.5, C).astype(np.float32)
    b = rng.uniform(-0.5, 0.5, C).astype(np.float32)
    f = smelt.rms_norm if kind == "rms" else smelt.layer_norm
    eps = 1e-5
    r = f(x, w, bias=b, eps=eps, return_stats=True) if kind == "rms" else f(x, w, b, eps, return_stats=True)
    y, rstd = r[0], r[-1]
    ry, rmean, rrstd = ref_norm(kind, x, w, b, eps)
    assert y.dtype == dt and y.shape == x.shape and rstd.dtype == np.float32 and rstd.shape == x.shape[:-1]
    close(y, ry, dt)
    close(rstd, rrstd, np.float32)
    if kind == "layer":
        close(r[1], rmean, np.float32)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_residual(rng, kind):
    x = rng.uniform(-1, 1, (4, 96)).astype(np.float16)
    res = rng.uniform(-1, 1, (4, 96)).astype(np.float16)
    w = rng.uniform(0.5, 1.5, 96).astype(np.float16)
    y, h = (smelt.add_rms_norm(x, res, w) if kind == "rms" else smelt.add_layer_norm(x, res, w))
    want_h = (x.astype(np.float64) + res).astype(np.float16)
    assert np.array_equal(h, want_h)
    close(y, ref_norm(kind, want_h, w, None, 1e-6 if kind == "rms" else 1e-5)[0], np.float16)
    # In place: the residual stream updated, y over x.
    r2 = res.copy()
    x2 = x.copy()
    smelt.rms_norm(x2, w, residual=r2, out=x2, residual_out=r2)
    assert np.array_equal(r2, want_h)
    close(x2, ref_norm("rms", want_h, w, None, 1e-6)[0], np.float16)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_backward(rng, kind):
    dt = np.float32
    x = rng.uniform(-1, 3, (6, 33)).astype(dt)
    dy = rng.uniform(-1, 1, (6, 33)).astype(dt)
    dh = rng.uniform(-1, 1, (6, 33)).astype(dt)
    w = rng.uniform(0.5, 1.5, 33).astype(dt)
    r = smelt.rms_norm(x, w, return_stats=True) if kind == "rms" else smelt.layer_norm(x, w, return_stats=True)
    rstd = r[-1]
    mean = r[1] if kind == "layer" else None
    dx, dw, db = smelt.norm_backward(kind, dy, x, rstd, w, mean, dh=dh, need_dbias=True)
    rdx, rdw, rdb = ref_norm_bwd(kind, dy, x, w, mean if mean is not None else np.zeros(6), rstd)
    close(dx, rdx + dh, dt)
    close(dw, rdw, dt)
    close(db, rdb, dt)
    dx2, dw2, db2 = smelt.norm_backward(kind, dy, x, rstd, None, mean)
    assert dw2 is None and db2 is None
    close(dx2, ref_norm_bwd(kind, dy, x, None, mean if mean is not None else np.zeros(6), rstd)[0], dt)


def test_residual_add(rng):
    x = rng.uniform(-1, 1, (3, 17)).astype(np.float16)
    r = rng.uniform(-1, 1, (3, 17)).astype(np.float16)
    want = (x.astype(np.float64) + r).astype(np.float16)
    assert np.array_equal(smelt.residual_add(x, r), want)
    smelt.residual_add(x, r, out=r)
    assert np.array_equal(r, want)


@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("R", [16, 32])
def test_rotary(rng, layout, R):
    x = rng.uniform(-1, 1, (2, 5, 3, 32)).astype(np.float32)
    cos, sin = smelt.rotary_tables(8, R)
    pos = rng.integers(-2, 10, (2, 5)).astype(np.int64)
    for p in (None, pos):
        for inverse in (False, True):
            y = smelt.rotary(x, cos, sin, p, layout=layout, inverse=inverse)
            close(y, ref_rotary(x, cos, sin, p, layout, inverse), np.float32)
    back = smelt.rotary(smelt.rotary(x, cos, sin, layout=layout), cos, sin, layout=layout, inverse=True)
    close(back, x, np.float32)
    # Q of a packed QKV buffer, rotated in place.
    qkv = rng.uniform(-1, 1, (2, 5, 9, 32)).astype(np.float32)
    q = qkv[:, :, 0:3]
    want = ref_rotary(q, cos, sin, None, layout, False)
    smelt.rotary(q, cos, sin, layout=layout, out=q)
    close(qkv[:, :, 0:3], want, np.float32)


def test_rotary_tables():
    cos, sin = smelt.rotary_tables(4, 8, theta=500.0)
    a = np.arange(4)[:, None] * 500.0 ** (-2.0 * np.arange(4) / 8)
    assert cos.dtype == np.float32 and cos.shape == (4, 4)
    assert np.array_equal(cos, np.cos(a).astype(np.float32)) and np.array_equal(sin, np.sin(a).astype(np.float32))
    with pytest.raises(smelt.ArgumentError, match="rot_dim=7"):
        smelt.rotary_tables(4, 7)


def test_errors(rng):
    x = rng.uniform(-1, 1, (2, 8)).astype(np.float32)
    with pytest.raises(smelt.ArgumentError, match="weight must be"):
        smelt.rms_norm(x, np.ones(7, np.float32))
    with pytest.raises(smelt.DTypeError, match="weight.dtype=f16"):
        smelt.rms_norm(x, np.ones(8, np.float16))
    with pytest.raises(smelt.ArgumentError, match="kind='batch'"):
        smelt.norm_backward("batch", x, x, np.ones(2, np.float32))
    with pytest.raises(smelt.ArgumentError, match="layout='llama'"):
        smelt.rotary(x.reshape(1, 2, 1, 8), *smelt.rotary_tables(4, 8), layout="llama")
    cos, sin = smelt.rotary_tables(4, 8)
    with pytest.raises(smelt.ArgumentError, match="x must be"):
        smelt.rotary(x, cos, sin)
