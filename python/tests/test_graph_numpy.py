"""smelt.Graph (the fusion planner) on the CPU with numpy: each graph planned
fused and one op a kernel, both against float64 formulas written here, with
the kernel counts and the description; binding other tensors by name; bad
graphs raise with the C library's message. A torch case checks bf16 fused
against unfused within bf16's rounding."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402
from graph_common import gelu, rel_err, silu  # noqa: E402


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def mlp_graph(x, w, b, r, y):
    """y = gelu(x @ w + b) + r."""
    m, n = y.shape
    g = smelt.Graph(device="cpu")
    X, W, B, R = g.input("x", x), g.input("w", w), g.input("b", b), g.input("r", r)
    h, p, a = (g.tensor(name, (m, n), "f32") for name in ("h", "p", "a"))
    g.gemm(X, W, h)
    g.bias(h, B, p)
    g.act("gelu", p, a)
    g.residual_add(a, R, g.output("y", y))
    return g


@pytest.mark.parametrize("fuse", [True, False])
def test_mlp(rng, fuse):
    m, k, n = 13, 11, 9
    x, w, b, r = f32(rng, m, k), f32(rng, k, n), f32(rng, n), f32(rng, m, n)
    y = np.empty((m, n), np.float32)
    g = mlp_graph(x, w, b, r, y)
    g.plan(fuse=fuse)
    g.run()
    want = gelu(x.astype(np.float64) @ w + b) + r
    assert rel_err(y, want) < 1e-6
    st = g.stats()
    assert st["kernels"] == (1 if fuse else 4)
    assert st["fused_away"] == (3 if fuse else 0)
    if fuse:
        assert "kernel 0: gemm, epilogue graph of" in g.describe()
        assert 'not materialized: "h", "p", "a"' in g.describe()
    else:
        assert "unfused: one op a kernel" in g.describe()


def test_swiglu(rng):
    m, k, f, n = 10, 12, 16, 7
    x, w1, w3, w2 = f32(rng, m, k), f32(rng, k, f), f32(rng, k, f), f32(rng, f, n)
    y = np.empty((m, n), np.float32)
    g = smelt.Graph(device="cpu")
    X, W1, W3, W2 = (g.input(nm, t) for nm, t in (("x", x), ("w1", w1), ("w3", w3), ("w2", w2)))
    gate, up, act, hid = (g.tensor(nm, (m, f), "f32") for nm in ("gate", "up", "act", "hid"))
    g.gemm(X, W1, gate)
    g.gemm(X, W3, up)
    g.act("silu", gate, act)
    g.mul(act, up, hid)
    g.gemm(hid, W2, g.output("y", y))
    g.plan()
    g.run()
    x64 = x.astype(np.float64)
    assert rel_err(y, (silu(x64 @ w1) * (x64 @ w3)) @ w2) < 1e-6
    assert g.stats()["kernels"] == 3
    assert '"hid" goes to op 4 (gemm): it is a GEMM operand' in g.describe()


def test_prenorm(rng):
    c = 32
    x, r, wt = f32(rng, 2, 3, c), f32(rng, 2, 3, c), f32(rng, c)
    h, y = np.empty_like(x), np.empty_like(x)
    g = smelt.Graph(device="cpu")
    X, R, W = g.input("x", x), g.input("r", r), g.input("w", wt)
    H = g.output("h", h)
    g.residual_add(X, R, H)
    g.norm("rms", H, g.output("y", y), weight=W, eps=1e-6)
    g.plan()
    g.run()
    h64 = x.astype(np.float64) + r
    want = h64 / np.sqrt((h64 * h64).mean(axis=-1, keepdims=True) + 1e-6) * wt
    assert rel_err(h, h64) < 1e-7
    assert rel_err(y, want) < 1e-6
    assert g.stats()["kernels"] == 1
    assert "norm with the residual add" in g.describe()


def test_run_binds_by_name(rng):
    m, k, n = 6, 5, 4
    x, w, b, r = f32(rng, m, k), f32(rng, k, n), f32(rng, n), f32(rng, m, n)
    y = np.empty((m, n), np.float32)
    g = mlp_graph(x, w, b, r, y)
    g.plan()
    x2, y2 = f32(rng, m, k), np.full((m, n), np.nan, np.float32)
    g.run(x=x2, y=y2)
    assert rel_err(y2, gelu(x2.astype(np.float64) @ w + b) + r) < 1e-6
    with pytest.raises(smelt.ArgumentError, match="no input or output named 'z'"):
        g.run(z=x2)
    with pytest.raises(smelt.ArgumentError, match="smelt_graph_run: x"):
        g.run(x=f32(rng, m + 1, k))


def test_bad_graphs(rng):
    x, w = f32(rng, 4, 3), f32(rng, 5, 2)
    g = smelt.Graph(device="cpu")
    X, W = g.input("x", x), g.input("w", w)
    d = g.tensor("d", (4, 2), "f32")
    with pytest.raises(smelt.ArgumentError, match=r'b "w".shape\[0\]=5 must equal K=3'):
        g.gemm(X, W, d)
    with pytest.raises(smelt.ArgumentError, match="the graph is broken"):
        g.plan()

    g = smelt.Graph(device="cpu")
    a, b = g.input("a", f32(rng, 4, 4)), g.input("b", np.ones((4, 4), np.float64))
    with pytest.raises(smelt.DTypeError, match='b "b" is f64'):
        g.add(a, b, g.tensor("s", (4, 4), "f32"))

    g = smelt.Graph(device="cpu")
    t1, t2 = g.tensor("t1", (4, 4), "f32"), g.tensor("t2", (4, 4), "f32")
    g.act("relu", t1, t2)
    g.act("tanh", t2, t1)
    g.act("gelu", t1, g.output("y", np.empty((4, 4), np.float32)))
    with pytest.raises(smelt.ArgumentError, match="the ops form a cycle"):
        g.plan()
    with pytest.raises(smelt.ArgumentError, match="no tensor named 'nope'"):
        g.act("relu", "nope", t1)


def test_torch_bf16_fused_matches_unfused():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(5)
    m, k, n = 33, 40, 24
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(k, n, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    r = torch.randn(m, n, generator=gen).bfloat16()
    outs = []
    for fuse in (True, False):
        y = torch.empty(m, n, dtype=torch.bfloat16)
        g = smelt.Graph(device="cpu")
        X, W, B, R = g.input("x", x), g.input("w", w), g.input("b", b), g.input("r", r)
        h, p, a = (g.tensor(nm, (m, n), "bf16") for nm in ("h", "p", "a"))
        g.gemm(X, W, h)
        g.bias(h, B, p)
        g.act("gelu", p, a)
        g.residual_add(a, R, g.output("y", y))
        g.plan(fuse=fuse)
        g.run()
        outs.append(y.double())
    ref = torch.nn.functional.gelu(x.double() @ w.double() + b.double()) + r.double()
    ef, eu = ((o - ref).norm() / ref.norm() for o in outs)
    assert ef < 1e-2 and eu < 1e-2
    assert ef <= 1.5 * eu + 1e-6
