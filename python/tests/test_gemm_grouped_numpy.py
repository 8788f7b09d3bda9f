"""smelt.gemm_grouped (grouped GEMM by row offsets) on the CPU with numpy,
against a per-group float64 loop written here."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

from test_numpy import ref_act  # noqa: E402


def ref_grouped(a, b, offs, c=None, bias=None, out=None, alpha=1.0, beta=0.0, act="identity", slope=0.01):
    """The header's rule, offsets clamped: end[g] = min(T, max(0, offs[0..g]))."""
    t, n = a.shape[0], b.shape[2]
    d = np.zeros((t, n)) if out is None else out.astype(np.float64)
    start = 0
    for g in range(b.shape[0]):
        end = min(t, max(start, int(offs[g])))
        if end == start:
            continue  # an empty group (ref_act's gelu takes no empty arrays)
        z = alpha * (a[start:end].astype(np.float64) @ b[g].astype(np.float64))
        if c is not None and beta != 0:
            z = z + beta * c[start:end]
        if bias is not None:
            z = z + bias[g]
        d[start:end] = ref_act(z, act, slope)
        start = end
    return d


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def randn(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


# Groups: empty ones (first, middle, last), a 1-row one, and rows past the last offset.
OFFS = [[0, 3, 3, 4, 9, 9], [1, 1, 6, 6, 10, 13], [13, 13, 13, 13, 13, 13]]


@pytest.mark.parametrize("offs", OFFS)
@pytest.mark.parametrize("idt", [np.int32, np.int64])
def test_gemm_grouped_groups(rng, offs, idt):
    t, k, n = 13, 20, 11
    a = randn(rng, (t, k))
    b = randn(rng, (len(offs), k, n))
    o = np.array(offs, dtype=idt)
    d = smelt.gemm_grouped(a, b, o)
    assert d.shape == (t, n) and d.dtype == np.float32
    assert rel_err(d, ref_grouped(a, b, o)) < 1e-6
    assert not d[offs[-1]:].any()  # a new D is zero-filled past the last offset


@pytest.mark.parametrize("act", ["identity", "relu", "leaky_relu", "gelu", "silu"])
def test_gemm_grouped_epilogue(rng, act):
    t, k, n, g = 17, 24, 9, 4
    a = randn(rng, (t, k))
    b = randn(rng, (g, n, k)).transpose(0, 2, 1)  # the [G, N, K] view: K contiguous
    c = randn(rng, (t, n))
    bias = randn(rng, (g, n))
    offs = np.array([5, 6, 6, 15], dtype=np.int64)
    d = smelt.gemm_grouped(a, b, offs, c, bias, alpha=0.5, beta=2.0, activation=act, slope=0.2)
    want = ref_grouped(a, b, offs, c, bias, alpha=0.5, beta=2.0, act=act, slope=0.2)
    assert rel_err(d, want) < 1e-6
    assert not d[15:].any()


def test_gemm_grouped_out_untouched_past_last(rng):
    t, k, n = 12, 8, 6
    a, b = randn(rng, (t, k)), randn(rng, (3, k, n))
    offs = np.array([2, 7, 9], dtype=np.int32)
    out = np.full((t, n), 7.0, dtype=np.float32)
    d = smelt.gemm_grouped(a, b, offs, out=out)
    assert d is out
    assert (out[9:] == 7.0).all()
    assert rel_err(out[:9], ref_grouped(a, b, offs)[:9]) < 1e-6


def test_gemm_grouped_in_place(rng):
    t, k, n = 10, 8, 5
    a, b = randn(rng, (t, k)), randn(rng, (2, k, n))
    c = randn(rng, (t, n))
    offs = np.array([4, 8], dtype=np.int32)
    want = ref_grouped(a, b, offs, c, beta=1.0, out=c)
    d = smelt.gemm_grouped(a, b, offs, c, out=c)
    assert d is c and rel_err(c, want) < 1e-6


def test_gemm_grouped_offsets_clamped(rng):
    # Not non-decreasing, negative and past T: the clamping rule, nothing outside D written.
    t, k, n = 8, 6, 4
    a, b = randn(rng, (t, k)), randn(rng, (4, k, n))
    offs = np.array([5, 2, -1, 100], dtype=np.int64)
    assert rel_err(smelt.gemm_grouped(a, b, offs), ref_grouped(a, b, offs)) < 1e-6


def test_gemm_grouped_plan_reuse(rng):
    # Same shapes, new offsets: the cached plan reads the new ones.
    a, b = randn(rng, (9, 5)), randn(rng, (3, 5, 4))
    for offs in ([1, 4, 9], [0, 0, 9], [9, 9, 9], [3, 3, 5]):
        o = np.array(offs, dtype=np.int32)
        assert rel_err(smelt.gemm_grouped(a, b, o), ref_grouped(a, b, o)) < 1e-6


def test_gemm_grouped_bad_inputs():
    a = np.ones((10, 4), np.float32)
    b = np.ones((3, 4, 5), np.float32)
    offs = np.array([2, 2, 7], np.int32)
    with pytest.raises(TypeError, match="offs.dtype"):
        smelt.gemm_grouped(a, b, offs.astype(np.float32))
    with pytest.raises(ValueError, match="offs.shape"):
        smelt.gemm_grouped(a, b, offs[:2])
    with pytest.raises(smelt.ArgumentError, match="3-D"):
        smelt.gemm_grouped(a, b[0], offs)
    with pytest.raises(ValueError, match="K=3"):
        smelt.gemm_grouped(a[:, :3], b, offs)
    with pytest.raises(ValueError, match="D.shape"):
        smelt.gemm_grouped(a, b, offs, out=np.zeros((10, 4), np.float32))
    with pytest.raises(ValueError, match="bias"):
        smelt.gemm_grouped(a, b, offs, bias=np.zeros(5, np.float32))
    with pytest.raises(ValueError, match="C.shape"):
        smelt.gemm_grouped(a, b, offs, c=np.zeros((9, 5), np.float32))
    with pytest.raises(ValueError, match="act='nope'"):
        smelt.gemm_grouped(a, b, offs, activation="nope")
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((10, 5), np.float32)
        ro.flags.writeable = False
        smelt.gemm_grouped(a, b, offs, out=ro)
    with pytest.raises(smelt.ArgumentError, match="pass out="):
        smelt.gemm_grouped(memoryview(a), b, offs)
