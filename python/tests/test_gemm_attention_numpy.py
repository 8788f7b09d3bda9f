"""smelt.gemm and smelt.attention on the CPU with numpy, against float64
references written here (naive: materialized scores and probabilities)."""

import math

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

from test_numpy import ref_act  # noqa: E402


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


# ---- gemm


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (7, 5, 3), (33, 17, 127)])
def test_gemm_plain(rng, m, n, k):
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    d = smelt.gemm(a, b)
    assert d.shape == (m, n) and d.dtype == np.float32
    assert rel_err(d, a.astype(np.float64) @ b) < 1e-6


@pytest.mark.parametrize("act", ["identity", "relu", "leaky_relu", "gelu", "silu"])
def test_gemm_epilogue(rng, act):
    a = rng.standard_normal((9, 20)).astype(np.float32)
    b = rng.standard_normal((13, 20)).astype(np.float32).T  # column-major B
    c = rng.standard_normal((9, 13)).astype(np.float32)
    bias = rng.standard_normal(13).astype(np.float32)
    d = smelt.gemm(a, b, c, bias, alpha=0.5, beta=2.0, activation=act, slope=0.2)
    want = ref_act(0.5 * (a.astype(np.float64) @ b) + 2.0 * c + bias, act, 0.2)
    assert rel_err(d, want) < 1e-6


def test_gemm_batched_out_and_inplace(rng):
    a = rng.standard_normal((3, 6, 10)).astype(np.float32)
    b = rng.standard_normal((3, 10, 4)).astype(np.float32)
    out = np.full((3, 6, 4), np.nan, np.float32)
    r = smelt.gemm(a, b, out=out)
    assert r is out
    assert rel_err(out, np.matmul(a.astype(np.float64), b)) < 1e-6
    c = rng.standard_normal((3, 6, 4)).astype(np.float32)
    c0 = c.copy()
    smelt.gemm(a, b, c, out=c)  # D = a @ b + c, in place
    assert rel_err(c, np.matmul(a.astype(np.float64), b) + c0) < 1e-6


def test_gemm_out_dtype_and_errors(rng):
    a = rng.standard_normal((4, 8)).astype(np.float32)
    b = rng.standard_normal((8, 5)).astype(np.float32)
    d = smelt.gemm(a, b, out_dtype="f64")
    assert d.dtype == np.float64 and rel_err(d, a.astype(np.float64) @ b) < 1e-6
    with pytest.raises(ValueError):
        smelt.gemm(a, a)  # K mismatch
    with pytest.raises(ValueError):
        smelt.gemm(a, b, math="fp4")


# ---- attention


def ref_attention(q, k, v, causal=False, scale=None, window=(-1, -1)):
    """q [B, Sq, H, D], k, v [B, Sk, Hk, D] -> o [B, Sq, H, D], lse [B, H, Sq] in f64."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    k = np.repeat(k, H // Hk, axis=2)
    v = np.repeat(v, H // Hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i = np.arange(Sq)[:, None]
    j = np.arange(Sk)[None, :]
    wl, wr = window
    if causal:
        wr = 0
    vis = np.ones((Sq, Sk), bool)
    if wl >= 0:
        vis &= j >= i + Sk - Sq - wl
    if wr >= 0:
        vis &= j <= i + Sk - Sq + wr
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    tot = e.sum(-1, keepdims=True)
    p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0)
    o = np.einsum("bhqk,bkhd->bqhd", p, v)
    with np.errstate(divide="ignore"):
        lse = np.where(tot[..., 0] > 0, np.log(tot[..., 0]) + m[..., 0], np.inf)
    return o, lse, p


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk", [(1, 1, 1, 1), (5, 9, 4, 1), (17, 7, 4, 2), (8, 8, 2, 2)])
def test_attention(rng, causal, sq, sk, h, hk):
    q = rng.standard_normal((2, sq, h, 16)).astype(np.float32)
    k = rng.standard_normal((2, sk, hk, 16)).astype(np.float32)
    v = rng.standard_normal((2, sk, hk, 16)).astype(np.float32)
    o, lse = smelt.attention(q, k, v, causal=causal, return_lse=True)
    want_o, want_lse, _ = ref_attention(q, k, v, causal)
    assert o.shape == q.shape and lse.shape == (2, h, sq) and lse.dtype == np.float32
    assert rel_err(o, want_o) < 1e-5
    assert np.array_equal(np.isinf(lse), np.isinf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-5, atol=1e-5)


def test_attention_scale_window(rng):
    q = rng.standard_normal((1, 12, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 12, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 12, 2, 8)).astype(np.float32)
    o = smelt.attention(q, k, v, scale=0.3, window=(3, 1))
    assert rel_err(o, ref_attention(q, k, v, scale=0.3, window=(3, 1))[0]) < 1e-5


def ref_attention_bwd(q, k, v, d_o, causal):
    o, lse, p = ref_attention(q, k, v, causal)
    H, Hk = q.shape[2], k.shape[2]
    scale = 1 / math.sqrt(q.shape[3])
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, d_o))
    kr, vr = np.repeat(k64, H // Hk, axis=2), np.repeat(v64, H // Hk, axis=2)
    dv = np.einsum("bhqk,bqhd->bkhd", p, do64)
    dp = np.einsum("bqhd,bkhd->bhqk", do64, vr)
    dsum = np.einsum("bqhd,bqhd->bhq", do64, o)[..., None]
    ds = p * (dp - dsum)
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kr)
    dk = scale * np.einsum("bhqk,bqhd->bkhd", ds, q64)
    B, Sk, _, D = k.shape
    dk = dk.reshape(B, Sk, Hk, H // Hk, D).sum(3)
    dv = dv.reshape(B, Sk, Hk, H // Hk, D).sum(3)
    return dq, dk, dv


@pytest.mark.parametrize("causal", [False, True])
def test_attention_backward(rng, causal):
    q = rng.standard_normal((2, 7, 4, 8)).astype(np.float32)
    k = rng.standard_normal((2, 11, 2, 8)).astype(np.float32)
    v = rng.standard_normal((2, 11, 2, 8)).astype(np.float32)
    d_o = rng.standard_normal(q.shape).astype(np.float32)
    o, lse = smelt.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = smelt.attention_backward(q, k, v, o, d_o, lse, causal=causal)
    want = ref_attention_bwd(q, k, v, d_o, causal)
    for got, w in zip((dq, dk, dv), want):
        assert got.shape == w.shape
        assert rel_err(got, w) < 1e-5


def test_attention_varlen(rng):
    lq, lk = [3, 0, 5], [4, 2, 6]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], 4, 8)).astype(np.float32)
    k = rng.standard_normal((ck[-1], 2, 8)).astype(np.float32)
    v = rng.standard_normal((ck[-1], 2, 8)).astype(np.float32)
    o, lse = smelt.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True)
    assert o.shape == q.shape and lse.shape == (4, cq[-1])
    for b in range(3):
        if lq[b] == 0:
            continue
        sl, kl = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        wo, wl, _ = ref_attention(q[None, sl], k[None, kl], v[None, kl], causal=True)
        assert rel_err(o[sl], wo[0]) < 1e-5
        np.testing.assert_allclose(lse[:, sl], wl[0], rtol=1e-5)
    d_o = rng.standard_normal(q.shape).astype(np.float32)
    dq, dk, dv = smelt.attention_backward(q, k, v, o, d_o, lse, causal=True, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                          max_seqlen_q=max(lq), max_seqlen_k=max(lk))
    b = 2
    sl, kl = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
    wq, wk, wv = ref_attention_bwd(q[None, sl], k[None, kl], v[None, kl], d_o[None, sl], True)
    assert rel_err(dq[sl], wq[0]) < 1e-5 and rel_err(dk[kl], wk[0]) < 1e-5 and rel_err(dv[kl], wv[0]) < 1e-5


def test_attention_errors(rng):
    q = rng.standard_normal((1, 4, 3, 8)).astype(np.float32)
    k = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError):
        smelt.attention(q, k, k)  # H not a multiple of Hk
    with pytest.raises(ValueError):
        smelt.attention(q[0], k, k)
