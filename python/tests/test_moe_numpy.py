"""smelt.moe and smelt.moe_backward on the CPU backend with numpy arrays:
the forward against a numpy reference written here (softmax or sigmoid
scores, top-k, renormalization, capacity by probs, SwiGLU and the MLP), the
routing outputs, and every gradient against central finite differences of
the layer's objective sum(y * dy) + the aux losses in float64; bad
arguments are refused."""

import math

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


def silu(v):
    return v / (1.0 + np.exp(-v))


def ref_moe(x, wr, w1, w2, w3, b1, k, score="softmax", cap=0.0, aux=0.0, z=0.0):
    """The layer and its aux losses in float64 (no groups, no noise, drop
    policy probs when cap > 0)."""
    T, E = x.shape[0], wr.shape[1]
    logits = x @ wr
    if score == "softmax":
        s = np.exp(logits - logits.max(1, keepdims=True))
        s /= s.sum(1, keepdims=True)
    else:
        s = 1.0 / (1.0 + np.exp(-logits))
    sel = np.argsort(-s, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(s, sel, 1)
    if score == "softmax" or k > 1:
        w = w / (w.sum(1, keepdims=True) + (1e-20 if score == "sigmoid" else 0.0))
    kept = np.ones_like(w, dtype=bool)
    if cap > 0:
        c = min(T, math.ceil(T * k / E * cap))
        for e in range(E):
            a = [(-w[t, i], t * k + i) for t in range(T) for i in range(k) if sel[t, i] == e]
            for _, j in sorted(a)[c:]:
                kept[j // k, j % k] = False
    y = np.zeros_like(x)
    for t in range(T):
        for i in range(k):
            if kept[t, i]:
                e = sel[t, i]
                h = silu(x[t] @ w1[e]) * (x[t] @ w3[e]) if w3 is not None else np.tanh(x[t] @ w1[e] + b1[e])
                y[t] += w[t, i] * (h @ w2[e])
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    count = np.bincount(sel.ravel(), minlength=E)
    lse = logits.max(1) + np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1))
    losses = (aux * E / (k * T * T) * (count * p.sum(0)).sum(), z * (lse ** 2).mean())
    return y, sel, np.where(kept, w, 0.0), losses


def problem(rng, T=9, d=6, E=5, F=4, mlp=False):
    x = rng.uniform(-1, 1, (T, d))
    wr = rng.uniform(-1, 1, (d, E))
    w1 = rng.uniform(-0.5, 0.5, (E, d, F))
    w2 = rng.uniform(-0.5, 0.5, (E, F, d))
    w3 = None if mlp else rng.uniform(-0.5, 0.5, (E, d, F))
    b1 = rng.uniform(-0.3, 0.3, (E, F)) if mlp else None
    return x, wr, w1, w2, w3, b1


@pytest.mark.parametrize("score,k,cap", [("softmax", 2, 0.0), ("sigmoid", 3, 0.0), ("softmax", 1, 0.8)])
def test_moe_forward(rng, score, k, cap):
    x, wr, w1, w2, w3, b1 = problem(rng)
    opts = dict(score=score, aux_loss_coeff=0.01, z_loss_coeff=0.001)
    if cap:
        opts.update(capacity_factor=cap, drop_policy="probs")
    y, r = smelt.moe(x, wr, w1, w2, w3, top_k=k, return_routing=True, **opts)
    ry, sel, w, losses = ref_moe(x, wr, w1, w2, w3, b1, k, score, cap, 0.01, 0.001)
    assert r["logits"].dtype == np.float64 and r["weights"].dtype == np.float64  # f64 x routes in f64
    assert np.allclose(y, ry, rtol=1e-10, atol=1e-12)
    ids = np.asarray(r["ids"])
    assert np.array_equal(ids, np.where(w != 0, sel, -1))
    assert np.allclose(r["weights"], w, atol=1e-12)
    assert np.array_equal(r["counts"], np.bincount(ids[ids >= 0], minlength=wr.shape[1]))
    assert r["offsets"][0] == 0 and np.array_equal(np.diff(r["offsets"]), r["counts"])
    assert r["dropped"][0] == (ids < 0).sum()
    assert np.allclose(r["aux"], losses, rtol=1e-5)


@pytest.mark.parametrize("mlp", [False, True])
def test_moe_saved(rng, mlp):
    """save=True returns the backward's state (empty on the CPU, which
    recomputes) and smelt.moe_backward(saved=) gives the same gradients;
    the routing is aux, counts and dropped only."""
    x, wr, w1, w2, w3, b1 = problem(rng, mlp=mlp)
    opts = dict(aux_loss_coeff=0.05, z_loss_coeff=0.01)
    y, r = smelt.moe(x, wr, w1, w2, w3, b1=b1, top_k=2, return_routing=True, **opts)
    ys, rs, saved = smelt.moe(x, wr, w1, w2, w3, b1=b1, top_k=2, return_routing=True, save=True, **opts)
    assert saved.dtype == np.uint8 and saved.size == 0
    assert sorted(rs) == ["aux", "counts", "dropped"]
    assert np.array_equal(y, ys) and all(np.array_equal(r[n], rs[n]) for n in rs)
    y2, saved2 = smelt.moe(x, wr, w1, w2, w3, b1=b1, top_k=2, save=True, **opts)
    assert np.array_equal(y, y2)
    dy = rng.uniform(-1, 1, x.shape)
    g = smelt.moe_backward(dy, x, wr, w1, w2, w3, b1=b1, top_k=2, **opts)
    gs = smelt.moe_backward(dy, x, wr, w1, w2, w3, b1=b1, top_k=2, saved=saved2, **opts)
    assert sorted(g) == sorted(gs) and all(np.array_equal(g[n], gs[n]) for n in g)


@pytest.mark.parametrize("mlp", [False, True])
def test_moe_backward_finite_differences(rng, mlp):
    x, wr, w1, w2, w3, b1 = problem(rng, mlp=mlp)
    k, opts = 2, dict(aux_loss_coeff=0.05, z_loss_coeff=0.01, activation="tanh")
    dy = rng.uniform(-1, 1, x.shape)

    def objective():
        y = smelt.moe(x, wr, w1, w2, w3, b1=b1, top_k=k, **opts)
        losses = ref_moe(x, wr, w1, w2, w3, b1, k, aux=0.05, z=0.01)[3]  # in f64: smelt's aux output is f32
        return float((y * dy).sum() + losses[0] + losses[1])

    g = smelt.moe_backward(dy, x, wr, w1, w2, w3, b1=b1, top_k=k, **opts)
    assert sorted(g) == sorted(["dx", "dwr", "dw1", "dw2"] + (["db1"] if mlp else ["dw3"]))
    named = {"dx": x, "dwr": wr, "dw1": w1, "dw2": w2, "dw3": w3, "db1": b1}
    for name, grad in g.items():
        t = named[name]
        assert grad.shape == t.shape and grad.dtype == t.dtype
        for i in rng.choice(t.size, size=min(6, t.size), replace=False):
            j = np.unravel_index(i, t.shape)
            keep, h = t[j], 1e-6
            t[j] = keep + h
            up = objective()
            t[j] = keep - h
            down = objective()
            t[j] = keep
            assert abs((up - down) / (2 * h) - grad[j]) <= 1e-5 * max(1.0, abs(grad[j])), (name, j)


def test_moe_backward_needs_and_out(rng):
    x, wr, w1, w2, w3, _ = problem(rng)
    dy = rng.uniform(-1, 1, x.shape)
    dw2 = np.full(w2.shape, np.nan)
    g = smelt.moe_backward(dy, x, wr, w1, w2, w3, top_k=2, needs=["dx"], out={"dw2": dw2})
    assert sorted(g) == ["dw2", "dx"] and g["dw2"] is dw2 and not np.isnan(dw2).any()
    full = smelt.moe_backward(dy, x, wr, w1, w2, w3, top_k=2)
    assert np.array_equal(full["dw2"], dw2) and np.array_equal(full["dx"], g["dx"])


def test_moe_bad_arguments(rng):
    x, wr, w1, w2, w3, _ = problem(rng)
    with pytest.raises(smelt.ArgumentError, match="top_k"):
        smelt.moe(x, wr, w1, w2, w3, top_k=6)
    with pytest.raises(smelt.ArgumentError, match="drop_policy"):
        smelt.moe(x, wr, w1, w2, w3, top_k=2, capacity_factor=1.0, drop_policy="random")
    with pytest.raises(smelt.ArgumentError, match="no option"):
        smelt.moe(x, wr, w1, w2, w3, top_k=2, capacity=1.0)
    with pytest.raises(smelt.ArgumentError, match="no gradient"):
        smelt.moe_backward(x, x, wr, w1, w2, w3, top_k=2, needs=["dw4"])
    with pytest.raises(smelt.ArgumentError, match="db1"):
        smelt.moe_backward(x, x, wr, w1, w2, w3, top_k=2, needs=["db1"])
    with pytest.raises(smelt.ArgumentError, match="capacity_factor"):
        smelt.moe(x, wr, w1, w2, w3, top_k=2, capacity_factor=1.0)
