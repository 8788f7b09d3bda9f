"""smelt.peer, smelt.peer_retrieve and smelt.peer_backward on the CPU with
numpy, against a float64 reference written here: the exhaustive top-k over
every expert (no product-key shortcut), and finite differences of the
forward for the gradients."""

import math

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def gelu(z):
    return 0.5 * z * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))


class Case:
    """Random PEER weights (float64) for one set of options."""

    def __init__(self, rng, T=6, d_in=10, d_out=7, h=2, dq=8, sizes=(4, 5), he=1, k=3, norm="none",
                 key_l2=False, per_head=False, gate="softmax", act="gelu", bias=True):
        p = len(sizes)
        self.opts = dict(k=k, activation=act, query_norm=norm, key_l2_norm=key_l2, gate=gate)
        self.h, self.dq, self.sizes, self.k = h, dq, sizes, k
        self.x = rng.standard_normal((T, d_in))
        self.wq = rng.standard_normal((d_in, h * dq)) / math.sqrt(d_in)
        self.w = {"bq": rng.standard_normal(h * dq) * 0.1 if bias else None}
        lead = (h,) if per_head else ()
        self.sub_keys = [rng.standard_normal(lead + (n, dq // p)) for n in sizes]
        N = int(np.prod(sizes))
        self.u = rng.standard_normal((N, d_in, he)) / math.sqrt(d_in)
        self.v = rng.standard_normal((N, he, d_out)) / math.sqrt(he)
        if norm in ("layernorm", "batchnorm"):
            self.w["norm_weight"] = 1.0 + 0.1 * rng.standard_normal(dq)
            self.w["norm_bias"] = 0.1 * rng.standard_normal(dq)
        if norm == "batchnorm":
            self.w["bn_mean"] = 0.1 * rng.standard_normal(dq)
            self.w["bn_var"] = 0.5 + rng.random(dq)
        self.w = {n: t for n, t in self.w.items() if t is not None}

    def cast(self, dt):
        c = Case.__new__(Case)
        c.__dict__.update(self.__dict__)
        c.x, c.wq, c.u, c.v = (t.astype(dt) for t in (self.x, self.wq, self.u, self.v))
        c.sub_keys = [t.astype(dt) for t in self.sub_keys]
        c.w = {n: t.astype(dt) for n, t in self.w.items()}
        return c

    def args(self):
        return (self.x, self.wq, self.sub_keys, self.u, self.v)

    def kw(self):
        return dict(self.opts, **self.w)

    # ---- the reference

    def expert_scores(self):
        """Σ_i s_i[a_i] for every expert e = mixed radix (a_1..a_p): [T, h, N]."""
        o = self.opts
        T, h, dq, p = self.x.shape[0], self.h, self.dq, len(self.sizes)
        q = (self.x.astype(np.float64) @ self.wq.astype(np.float64) + self.w.get("bq", 0.0)).reshape(T, h, dq)
        w = {n: t.astype(np.float64) for n, t in self.w.items()}
        if o["query_norm"] == "layernorm":
            mu = q.mean(-1, keepdims=True)
            var = ((q - mu) ** 2).mean(-1, keepdims=True)
            q = (q - mu) / np.sqrt(var + 1e-5) * w.get("norm_weight", 1.0) + w.get("norm_bias", 0.0)
        elif o["query_norm"] == "batchnorm":
            q = (q - w["bn_mean"]) / np.sqrt(w["bn_var"] + 1e-5) * w.get("norm_weight", 1.0) + w.get("norm_bias", 0.0)
        elif o["query_norm"] == "l2":
            q = q / np.maximum(np.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
        total = np.zeros((T, h, 1))
        c = dq // p
        for i, keys in enumerate(self.sub_keys):
            keys = keys.astype(np.float64)
            if o["key_l2_norm"]:
                keys = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
            qi = q[:, :, i * c:(i + 1) * c]
            s = np.einsum("thc,hnc->thn", qi, keys) if keys.ndim == 3 else qi @ keys.T
            total = (total[:, :, :, None] + s[:, :, None, :]).reshape(T, h, -1)  # id = prev * n_i + a_i
        return total

    def select(self):
        """Exhaustive top-k: largest score first, ties to the lower id."""
        scores = self.expert_scores()
        order = np.lexsort((np.broadcast_to(np.arange(scores.shape[-1]), scores.shape), -scores), axis=-1)
        ids = order[..., :self.k]
        return ids, np.take_along_axis(scores, ids, -1)

    def forward_with(self, ids, scores):
        o = self.opts
        if o["gate"] == "softmax":
            e = np.exp(scores - scores.max(-1, keepdims=True))
            g = e / e.sum(-1, keepdims=True)
        elif o["gate"] == "sigmoid":
            g = 1.0 / (1.0 + np.exp(-scores))
        else:
            g = np.maximum(scores, 0.0)
        x, u, v = (t.astype(np.float64) for t in (self.x, self.u, self.v))
        hid = np.einsum("td,thkde->thke", x, u[ids])
        hid = gelu(hid) if o["activation"] == "gelu" else np.maximum(hid, 0.0)
        return np.einsum("thk,thke,thkeo->to", g, hid, v[ids])

    def forward(self):
        ids, scores = self.select()
        return self.forward_with(ids, scores), ids, scores


OPTIONS = [
    {},
    dict(sizes=(3, 4, 2), dq=12, he=4, k=4),
    dict(norm="layernorm", gate="sigmoid", act="relu"),
    dict(norm="batchnorm", key_l2=True),
    dict(norm="l2", per_head=True, gate="relu", bias=False),
    dict(d_in=12, d_out=5, he=2, sizes=(6, 6), k=5),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: ",".join("%s=%s" % kv for kv in o.items()) or "defaults")
def test_peer_forward_f64(rng, opts):
    c = Case(rng, **opts)
    want, want_ids, want_scores = c.forward()
    y, ids, scores = smelt.peer(*c.args(), return_ids=True, **c.kw())
    assert y.shape == want.shape and y.dtype == np.float64
    assert ids.dtype == np.int64 and scores.dtype == np.float32
    np.testing.assert_array_equal(ids, want_ids)
    assert rel_err(scores, want_scores) < 1e-6
    assert rel_err(y, want) < 1e-10
    rid, rscores = smelt.peer_retrieve(*c.args(), **c.kw())
    np.testing.assert_array_equal(rid, ids)
    np.testing.assert_array_equal(rscores, scores)


@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_peer_forward_low_precision(rng, dt):
    """f32/f16 storage (f64 math on the CPU): the selection is a true top-k
    of the stored weights' scores, and y matches the reference given it."""
    c = Case(rng, norm="layernorm", he=2).cast(np.dtype(dt))
    y, ids, scores = smelt.peer(*c.args(), return_ids=True, **c.kw())
    assert y.dtype == np.dtype(dt)
    all_scores = c.expert_scores()
    chosen = np.take_along_axis(all_scores, ids, -1)
    assert rel_err(scores, chosen) < 1e-6
    kth = chosen.min(-1)
    masked = all_scores.copy()
    np.put_along_axis(masked, ids, -np.inf, -1)
    assert (masked.max(-1) <= kth + 1e-6).all()  # nothing left out beats the k-th
    assert rel_err(y, c.forward_with(ids, chosen)) < (1e-6 if dt == "float32" else 2e-3)


def test_peer_out_and_ids_arguments(rng):
    c = Case(rng)
    want, want_ids, _ = c.forward()
    out = np.full(want.shape, np.nan)
    ids = np.full(want_ids.shape, -1, np.int64)
    r = smelt.peer(*c.args(), out=out, ids=ids, **c.kw())
    assert r is out and rel_err(out, want) < 1e-10
    np.testing.assert_array_equal(ids, want_ids)


def _loss(c, dy):
    return float((c.forward_with(*c.select()) * dy).sum())


@pytest.mark.parametrize("opts", [dict(norm="layernorm", he=2), dict(norm="batchnorm", per_head=True, gate="sigmoid"),
                                  dict(norm="l2", key_l2=True, sizes=(3, 2, 3), dq=9, act="relu")],
                         ids=["layernorm", "batchnorm-per-head", "l2-p3"])
def test_peer_backward_finite_differences(rng, opts):
    c = Case(rng, **opts)
    y, ids, _ = smelt.peer(*c.args(), return_ids=True, **c.kw())
    dy = rng.standard_normal(y.shape)
    g = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, **c.kw())
    names = {"dx", "dwq", "dsub_keys", "du", "dv"} | ({"dbq"} if "bq" in c.w else set())
    names |= {"dnorm_weight", "dnorm_bias"} if "norm_weight" in c.w else set()
    assert set(g) == names
    params = {"dx": c.x, "dwq": c.wq, "du": c.u, "dv": c.v}
    params.update({"d" + n: c.w[n] for n in ("bq", "norm_weight", "norm_bias") if n in c.w})
    params.update({"dsub_keys%d" % i: t for i, t in enumerate(c.sub_keys)})
    eps = 1e-6
    for name, t in params.items():
        grad = g["dsub_keys"][int(name[-1])] if name.startswith("dsub_keys") else g[name]
        assert grad.shape == t.shape
        for flat in rng.choice(t.size, size=min(t.size, 6), replace=False):
            i = np.unravel_index(flat, t.shape)
            keep = t[i]
            t[i] = keep + eps
            up = _loss(c, dy)
            t[i] = keep - eps
            down = _loss(c, dy)
            t[i] = keep
            num = (up - down) / (2 * eps)
            assert abs(grad[i] - num) <= 1e-6 * (1 + abs(num)), (name, i, grad[i], num)


def test_peer_backward_needs_and_out(rng):
    c = Case(rng)
    y, ids, _ = smelt.peer(*c.args(), return_ids=True, **c.kw())
    dy = rng.standard_normal(y.shape)
    full = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, **c.kw())
    dx = np.full(c.x.shape, np.nan)
    part = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("dx", "dv"), out={"dx": dx},
                               **c.kw())
    assert set(part) == {"dx", "dv"} and part["dx"] is dx
    np.testing.assert_array_equal(part["dx"], full["dx"])
    np.testing.assert_array_equal(part["dv"], full["dv"])
    with pytest.raises(smelt.ArgumentError, match="no gradient named 'dwk'"):
        smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("dwk",), **c.kw())
    with pytest.raises(smelt.ArgumentError, match="dbq is asked for"):
        smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("dbq",), **dict(c.kw(), bq=None))


@pytest.mark.parametrize("opts", [dict(he=2), dict(sizes=(3, 4, 2), dq=12, he=4, k=4, norm="layernorm"),
                                  dict(T=1, sizes=(2, 2), k=4)],
                         ids=["he2", "p3-he4-k4", "every-expert"])
@pytest.mark.parametrize("dt", ["float64", "float32"])
def test_peer_backward_sparse_rows(rng, opts, dt):
    """The sparse expert gradients: the distinct experts of ids ascending,
    and their rows of the dense du and dv, bit for bit, in u's dtype."""
    c = Case(rng, **opts).cast(np.dtype(dt))
    y, ids, _ = smelt.peer(*c.args(), return_ids=True, **c.kw())
    dy = rng.standard_normal(y.shape).astype(dt)
    g = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("du", "dv", "du_rows", "dv_rows"),
                            **c.kw())
    assert set(g) == {"du", "dv", "grad_ids", "du_rows", "dv_rows"}
    np.testing.assert_array_equal(g["grad_ids"], np.unique(ids))
    m = len(g["grad_ids"])
    assert g["du_rows"].shape == (m,) + c.u.shape[1:] and g["dv_rows"].shape == (m,) + c.v.shape[1:]
    assert g["du_rows"].dtype == np.dtype(dt) and g["grad_ids"].dtype == np.int64
    np.testing.assert_array_equal(g["du_rows"], g["du"][g["grad_ids"]])
    np.testing.assert_array_equal(g["dv_rows"], g["dv"][g["grad_ids"]])
    # Without the dense tables, and each kind of row alone.
    only_u = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("du_rows",), **c.kw())
    assert set(only_u) == {"grad_ids", "du_rows"}
    np.testing.assert_array_equal(only_u["du_rows"], g["du_rows"])
    only_ids = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("grad_ids", "dx"), **c.kw())
    assert set(only_ids) == {"grad_ids", "dx"}
    np.testing.assert_array_equal(only_ids["grad_ids"], g["grad_ids"])


def test_peer_backward_sparse_untrimmed_and_out(rng):
    """'grad_count' (asked or given) returns the whole [T·h·k] outputs with
    no trimming; given sparse outputs otherwise come back as views of
    their first M rows."""
    c = Case(rng, he=2)
    y, ids, _ = smelt.peer(*c.args(), return_ids=True, **c.kw())
    dy = rng.standard_normal(y.shape)
    want = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("du_rows", "dv_rows"), **c.kw())
    m, nuse = len(want["grad_ids"]), ids.size
    assert m < nuse  # experts repeat: there is something to trim
    g = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("grad_count", "du_rows"), **c.kw())
    assert set(g) == {"grad_ids", "grad_count", "du_rows"}
    assert g["grad_count"].shape == (1,) and g["grad_count"][0] == m
    np.testing.assert_array_equal(g["grad_ids"][:m], want["grad_ids"])
    assert (g["grad_ids"][m:] == -1).all() and g["du_rows"].shape == (nuse,) + c.u.shape[1:]
    np.testing.assert_array_equal(g["du_rows"][:m], want["du_rows"])
    out = {"grad_ids": np.full(nuse, 7, np.int64), "grad_count": np.full(1, -5, np.int64),
           "dv_rows": np.full((nuse,) + c.v.shape[1:], np.nan)}
    g = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=(), out=out, **c.kw())
    assert set(g) == set(out) and all(g[n] is out[n] for n in out)
    assert out["grad_count"][0] == m and (out["grad_ids"][m:] == -1).all()
    np.testing.assert_array_equal(out["dv_rows"][:m], want["dv_rows"])
    assert (out["dv_rows"][m:] == 0).all()  # zeros past the count
    rows = np.full((nuse,) + c.u.shape[1:], np.nan)
    g = smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("dx",), out={"du_rows": rows}, **c.kw())
    assert set(g) == {"dx", "grad_ids", "du_rows"} and np.shares_memory(g["du_rows"], rows)
    np.testing.assert_array_equal(g["du_rows"], want["du_rows"])
    with pytest.raises(smelt.ArgumentError, match="no gradient named 'du_row'.*du_rows"):
        smelt.peer_backward(c.x, ids, dy, c.wq, c.sub_keys, c.u, c.v, needs=("du_row",), **c.kw())


def test_peer_errors(rng):
    c = Case(rng)
    with pytest.raises(smelt.ArgumentError, match="activation='tanh' is not one of 'relu', 'gelu'"):
        smelt.peer(*c.args(), **dict(c.kw(), activation="tanh"))
    with pytest.raises(smelt.ArgumentError, match="gate='max'"):
        smelt.peer(*c.args(), **dict(c.kw(), gate="max"))
    with pytest.raises(smelt.ArgumentError, match="product_key_dims must be 2..4"):
        smelt.peer(c.x, c.wq, c.sub_keys[:1], c.u, c.v, **c.kw())
    with pytest.raises(smelt.ArgumentError, match=r"k=1000 must be in \[1, 20\]"):
        smelt.peer(*c.args(), **dict(c.kw(), k=1000))
    with pytest.raises(smelt.ArgumentError, match="bn_mean"):  # batchnorm needs its statistics
        smelt.peer(*c.args(), **dict(c.kw(), query_norm="batchnorm"))
    with pytest.raises(smelt.DTypeError):
        smelt.peer(c.x, c.wq, c.sub_keys, c.u.astype(np.float32), c.v, **c.kw())


def test_peer_kernel_choices(rng):
    # cfg.kernels from the kernels= dict: the CPU takes and ignores valid
    # choices; names and fields are checked either way
    c = Case(rng)
    y0 = smelt.peer(*c.args(), **c.kw())
    y1 = smelt.peer(*c.args(), **dict(c.kw(), kernels={"route": "reg", "expert_kernel": "rows", "overlap": "after",
                                                       "projection": "gemm", "head_groups": 1}))
    np.testing.assert_array_equal(y0, y1)
    with pytest.raises(smelt.ArgumentError, match="route='sort' is not one of 'auto', 'reg', 'wg'"):
        smelt.peer(*c.args(), **dict(c.kw(), kernels={"route": "sort"}))
    with pytest.raises(smelt.ArgumentError, match="cfg has no field 'threshold'"):
        smelt.peer(*c.args(), **dict(c.kw(), kernels={"threshold": 1}))
    with pytest.raises(smelt.ArgumentError, match="head_groups=3"):
        smelt.peer(*c.args(), **dict(c.kw(), kernels={"head_groups": 3}))
