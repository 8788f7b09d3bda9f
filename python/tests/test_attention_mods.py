"""Attention's score modifiers (softcap, ALiBi, sinks), causal ∩ window and
deterministic= through the Python bindings: numpy on the CPU against a
float64 reference written here (sinks' gradient against central
differences), torch autograd where torch is installed, and the
deterministic backward bitwise repeatable over 10 runs on CUDA."""

import math

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def ref(q, k, v, causal=False, window=(-1, -1), softcap=0.0, slopes=None, sinks=None):
    """o [B, Sq, H, D], lse [B, H, Sq] in f64, with the modifiers."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    k, v = np.repeat(k, H // Hk, axis=2), np.repeat(v, H // Hk, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    diag = i + Sk - Sq
    if slopes is not None:
        s = s - slopes.astype(np.float64)[None, :, None, None] * np.abs(diag - j)[None, None]
    vis = np.ones((Sq, Sk), bool)
    if causal:
        vis &= j <= diag
    if window[0] >= 0:
        vis &= j >= diag - window[0]
    if window[1] >= 0:
        vis &= j <= diag + window[1]
    s = np.where(vis, s, -np.inf)
    sink = np.full(H, -np.inf) if sinks is None else sinks.astype(np.float64)
    m = np.maximum(s.max(-1), sink[None, :, None])
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m[..., None])
    tot = e.sum(-1) + np.exp(sink[None, :, None] - m)
    any_key = vis.any(-1)[None, None]
    p = e / tot[..., None]
    o = np.einsum("bhqk,bkhd->bqhd", np.where(any_key[..., None], p, 0), v)
    with np.errstate(divide="ignore"):
        lse = np.where(any_key, np.log(tot) + m, np.inf)
    return o, lse


def inputs(rng, sq=9, sk=13, h=4, hk=2, d=8):
    q = rng.standard_normal((2, sq, h, d)).astype(np.float64)
    k = rng.standard_normal((2, sk, hk, d)).astype(np.float64)
    v = rng.standard_normal((2, sk, hk, d)).astype(np.float64)
    slopes = (2.0 ** -np.arange(1, h + 1)).astype(np.float32)
    sinks = rng.uniform(-1, 2, h).astype(np.float32)
    return q, k, v, slopes, sinks


MODS = [dict(softcap=1.5), dict(alibi=True), dict(sinks=True), dict(softcap=2.0, alibi=True, sinks=True)]


@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (3, 4)), (True, (-1, 2))])
def test_forward_modifiers(rng, mods, causal, window):
    q, k, v, slopes, sinks = inputs(rng)
    kw = dict(softcap=mods.get("softcap", 0.0), alibi_slopes=slopes if mods.get("alibi") else None,
              sinks=sinks if mods.get("sinks") else None)
    o, lse = smelt.attention(q, k, v, causal=causal, window=window, return_lse=True, **kw)
    wo, wl = ref(q, k, v, causal, window, kw["softcap"], kw["alibi_slopes"], kw["sinks"])
    assert rel_err(o, wo) < 1e-12
    assert np.array_equal(np.isinf(lse), np.isinf(wl))
    fin = np.isfinite(wl)
    np.testing.assert_allclose(lse[fin], wl[fin], rtol=1e-6)


def test_varlen_modifiers(rng):
    lq, lk = [3, 0, 6], [5, 2, 4]
    cq = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = rng.standard_normal((cq[-1], 4, 8))
    k = rng.standard_normal((ck[-1], 2, 8))
    v = rng.standard_normal((ck[-1], 2, 8))
    slopes = (2.0 ** -np.arange(1, 5)).astype(np.float32)
    sinks = rng.uniform(-1, 2, 4).astype(np.float32)
    kw = dict(causal=True, window=(2, 3), softcap=1.5, alibi_slopes=slopes, sinks=sinks)
    o, lse = smelt.attention_varlen(q, k, v, cq, ck, max(lq), max(lk), return_lse=True, **kw)
    d_o = rng.standard_normal(q.shape)
    dq, dk, dv, ds = smelt.attention_backward(q, k, v, o, d_o, lse, cu_seqlens_q=cq, cu_seqlens_k=ck,
                                              max_seqlen_q=max(lq), max_seqlen_k=max(lk), **kw)
    want_ds = np.zeros(4)
    for b in range(3):
        sl, kl = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        wo, wl = ref(q[None, sl], k[None, kl], v[None, kl], True, (2, 3), 1.5, slopes, sinks)
        assert rel_err(o[sl], wo[0]) < 1e-12
        np.testing.assert_allclose(lse[:, sl], wl[0], rtol=1e-6)
        # dsinks_h = -sum_i exp(sink_h - lse_i) (dO_i . O_i), over every sequence's rows
        dsum = np.einsum("qhd,qhd->hq", d_o[sl], o[sl])
        with np.errstate(over="ignore"):
            want_ds -= (np.exp(sinks.astype(np.float64)[:, None] - lse[:, sl].astype(np.float64)) * dsum).sum(1)
    assert rel_err(ds, want_ds) < 1e-5


def test_causal_window_is_intersection(rng):
    q, k, v, _, _ = inputs(rng)
    a = smelt.attention(q, k, v, causal=True, window=(4, 6))
    b = smelt.attention(q, k, v, window=(4, 0))
    assert np.array_equal(a, b)


def test_backward_modifiers_finite_differences(rng):
    q, k, v, slopes, sinks = inputs(rng, sq=5, sk=7, h=2, hk=1, d=4)
    sinks64 = sinks.astype(np.float64)
    kw = dict(causal=True, window=(3, 2), softcap=2.0)
    g = rng.standard_normal(q.shape)
    o, lse = smelt.attention(q, k, v, alibi_slopes=slopes, sinks=sinks, return_lse=True, **kw)
    dq, dk, dv, ds = smelt.attention_backward(q, k, v, o, g, lse, alibi_slopes=slopes, sinks=sinks, **kw)
    assert ds.shape == (2,) and ds.dtype == np.float32

    def loss(q_, k_, v_, s_):
        return float((ref(q_, k_, v_, True, (3, 2), 2.0, slopes, s_)[0] * g).sum())

    def fd(x, i, f):
        h, x0 = 1e-6, x[i]
        x[i] = x0 + h
        a = f()
        x[i] = x0 - h
        b = f()
        x[i] = x0
        return (a - b) / (2 * h)

    for got, x in ((dq, q), (dk, k), (dv, v)):
        want = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            want[i] = fd(x, i, lambda: loss(q, k, v, sinks64))
        assert rel_err(got, want) < 1e-5
    want_ds = np.array([fd(sinks64, (h,), lambda: loss(q, k, v, sinks64)) for h in range(2)])
    assert rel_err(ds, want_ds) < 1e-5


def test_modifier_tensors_with_cached_plans(rng):
    # A plan keeps its modifier tensors' memory: an update in place and
    # another tensor must both be seen by the next call.
    q, k, v, slopes, sinks = inputs(rng)
    before = sinks.copy()
    a = smelt.attention(q, k, v, sinks=sinks, alibi_slopes=slopes)
    sinks += 1.0
    b = smelt.attention(q, k, v, sinks=sinks, alibi_slopes=slopes)
    other = slopes * 2
    c = smelt.attention(q, k, v, sinks=sinks, alibi_slopes=other)
    assert rel_err(a, ref(q, k, v, sinks=before, slopes=slopes)[0]) < 1e-12
    assert rel_err(b, ref(q, k, v, sinks=sinks, slopes=slopes)[0]) < 1e-12
    assert rel_err(c, ref(q, k, v, sinks=sinks, slopes=other)[0]) < 1e-12


def test_modifier_errors(rng):
    q, k, v, slopes, sinks = inputs(rng)
    with pytest.raises(ValueError):
        smelt.attention(q, k, v, softcap=-1.0)
    with pytest.raises(ValueError):
        smelt.attention(q, k, v, alibi_slopes=slopes[:2])
    with pytest.raises(TypeError):
        smelt.attention(q, k, v, softcap="big")


# ---- torch: autograd with sinks, and deterministic= bitwise over 10 runs


def test_torch_sinks_grad(rng):
    torch = pytest.importorskip("torch")
    import smelt.torch as st

    q, k, v, slopes, sinks = (torch.from_numpy(x) for x in inputs(rng, sq=6, sk=8, h=2, hk=1, d=4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    s = sinks.clone().requires_grad_()
    o = st.attention(q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes, sinks=s)
    g = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v, s), g)
    xs = [t.detach().double().requires_grad_() for t in (q, k, v, s)]
    want = torch.autograd.grad(_torch_ref(*xs, slopes.double(), 3.0), xs, g.double())
    for a, b in zip(got, want):
        assert rel_err(a.detach().numpy(), b.numpy()) < 1e-5


def _torch_ref(q, k, v, sinks, slopes, softcap):
    import torch

    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(H // Hk, 2), v.repeat_interleave(H // Hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    s = softcap * torch.tanh(s / softcap)
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    diag = i + Sk - Sq
    s = s - slopes[None, :, None, None] * (diag - j).abs()
    s = s.masked_fill(j > diag, float("-inf"))
    s = torch.cat([s, sinks[None, :, None, None].expand(B, H, Sq, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _cuda_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


@pytest.mark.parametrize("d", [64, 96, 128])
def test_deterministic_backward_bitwise_10_runs(d):
    torch = _cuda_torch()
    import smelt.torch as st

    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q, shape_k = (2, 700, 8, d), (2, 900, 2, d)
    q = torch.randn(shape_q, generator=g, device="cuda").bfloat16().requires_grad_()
    k = torch.randn(shape_k, generator=g, device="cuda").bfloat16().requires_grad_()
    v = torch.randn(shape_k, generator=g, device="cuda").bfloat16().requires_grad_()
    sinks = torch.randn(8, generator=g, device="cuda").requires_grad_()
    do = torch.randn(shape_q, generator=g, device="cuda").bfloat16()
    runs = []
    for _ in range(10):
        o = st.attention(q, k, v, causal=True, sinks=sinks, deterministic=True)
        runs.append(torch.autograd.grad(o, (q, k, v, sinks), do))
    for r in runs[1:]:
        for a, b in zip(runs[0], r):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    # The same through smelt.attention_backward (no autograd).
    o, lse = smelt.attention(q.detach(), k.detach(), v.detach(), return_lse=True)
    first = smelt.attention_backward(q.detach(), k.detach(), v.detach(), o, do, lse, deterministic=True)
    for _ in range(9):
        again = smelt.attention_backward(q.detach(), k.detach(), v.detach(), o, do, lse, deterministic=True)
        for a, b in zip(first, again):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
