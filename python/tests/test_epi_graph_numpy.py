"""smelt.gemm with an epilogue graph (smelt.Epilogue) on the CPU with numpy,
against float64 formulas written here: bias + gelu with the pre-activation
stored and a row abs-max, and a residual graph with C, vectors, clamp and a
column sum; bad graphs raise."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402
from graph_common import gelu, rel_err  # noqa: E402


def test_bias_gelu_pre_amax(rng):
    m, n, k = 13, 9, 17
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    pre_out = np.empty((m, n), np.float32)
    amax = np.empty(m, np.float32)
    g = smelt.Epilogue()
    pre = g.acc + g.bias
    g.store(pre, pre_out)
    d = g.out(g.act("gelu", pre))
    g.row_reduce(d, amax, "amax")
    got = smelt.gemm(a, b, bias=bias, alpha=0.5, epilogue=g)
    want_pre = 0.5 * (a.astype(np.float64) @ b.astype(np.float64)) + bias
    want = gelu(want_pre)
    assert rel_err(pre_out, want_pre) < 1e-6
    assert rel_err(got, want) < 1e-6
    assert rel_err(amax, np.abs(want).max(axis=1)) < 1e-6


def test_residual_vectors_clamp_colsum(rng):
    m, n, k = 11, 7, 5
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    c = rng.standard_normal((m, n)).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    row = rng.standard_normal(m).astype(np.float32)
    col = rng.standard_normal(n).astype(np.float32)
    csum = np.empty(n, np.float32)
    g = smelt.Epilogue()
    x = (g.acc + g.c) * g.row(row) - g.col(col) / 2 + g.aux(res)
    y = g.out(g.clamp(g.max(x, -1.0), -2.0, 1.5))
    g.col_reduce(y, csum, "sum")
    got = smelt.gemm(a, b, c, beta=0.25, epilogue=g)
    x64 = ((a.astype(np.float64) @ b.astype(np.float64)) + 0.25 * c) * row[:, None] - col[None, :] / 2 + res
    want = np.clip(np.maximum(x64, -1.0), -2.0, 1.5)
    assert rel_err(got, want) < 1e-6
    assert rel_err(csum, want.sum(axis=0)) < 1e-6


def test_bad_graph(rng):
    a = rng.standard_normal((4, 3)).astype(np.float32)
    b = rng.standard_normal((3, 5)).astype(np.float32)
    g = smelt.Epilogue()
    g.out(g.acc + g.bias)
    with pytest.raises(smelt.ArgumentError, match="BIAS node but bias is NULL"):
        smelt.gemm(a, b, epilogue=g)
    g = smelt.Epilogue()
    g.store(g.acc, np.empty((5, 5), np.float32))
    g.out(g.acc)
    with pytest.raises(smelt.ArgumentError, match=r"must be \[M, N\]=\[4, 5\]"):
        smelt.gemm(a, b, epilogue=g)
    with pytest.raises(ValueError, match="g.out"):
        smelt.gemm(a, b, epilogue=smelt.Epilogue())
