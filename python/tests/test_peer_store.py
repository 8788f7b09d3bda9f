"""smelt.PeerStore: PEER's hierarchical expert store from Python. On the CPU
(the reference backend, numpy) and, where a GPU is, with torch on CUDA: the
store's results equal dense u and v with the same values bit for bit, its
counters add up, and bad input is refused with a clear error."""

import math

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


def make(rng, T=7, d_in=12, d_out=9, h=2, dq=8, sizes=(4, 5), he=1, dt=np.float32):
    N = int(np.prod(sizes))
    c = dict(
        x=rng.standard_normal((T, d_in)).astype(dt),
        wq=(rng.standard_normal((d_in, h * dq)) / math.sqrt(d_in)).astype(dt),
        sub_keys=[rng.standard_normal((n, dq // len(sizes))).astype(dt) for n in sizes],
        u=(rng.standard_normal((N, d_in, he)) / math.sqrt(d_in)).astype(dt),
        v=rng.standard_normal((N, he, d_out)).astype(dt),
    )
    c["dy"] = rng.standard_normal((T, d_out)).astype(dt)
    return c


def cpu_store(c, slots=8):
    """A store of c's experts (f32) whose cache holds `slots` of them."""
    N, d_in, he = c["u"].shape
    row = (c["u"][0].size + c["v"][0].size) * 4
    s = smelt.PeerStore(N, d_in, c["v"].shape[-1], expert_hidden_size=he, dtype="f32",
                        cache_mb=(slots + 0.5) * row / 2**20, use_env=False, device="cpu")
    s.write(0, c["u"], c["v"])
    return s


@pytest.mark.parametrize("he", [1, 4])
def test_cpu_forward_backward_match_dense(he):
    rng = np.random.default_rng(11 + he)
    c = make(rng, he=he)
    s = cpu_store(c)
    u_t, v_t = (np.from_dlpack(t) for t in s.tables())
    assert u_t.shape == c["u"].shape and v_t.shape == c["v"].shape
    assert np.array_equal(u_t, c["u"]) and np.array_equal(v_t, c["v"])
    y, ids, _ = smelt.peer(c["x"], c["wq"], c["sub_keys"], c["u"], c["v"], k=3, return_ids=True)
    for _ in range(2):  # a cold cache, then a warm one
        ys = smelt.peer(c["x"], c["wq"], c["sub_keys"], store=s, k=3)
        assert np.array_equal(ys, y)
    dense = smelt.peer_backward(c["x"], ids, c["dy"], c["wq"], c["sub_keys"], c["u"], c["v"], k=3)
    sparse = smelt.peer_backward(c["x"], ids, c["dy"], c["wq"], c["sub_keys"], store=s, k=3)
    assert np.array_equal(sparse["dx"], dense["dx"]) and np.array_equal(sparse["dwq"], dense["dwq"])
    gi = sparse["grad_ids"]
    assert list(gi) == sorted(set(ids.ravel().tolist()))
    assert np.array_equal(sparse["du_rows"], dense["du"][gi]) and np.array_equal(sparse["dv_rows"], dense["dv"][gi])
    st = s.stats()
    assert st["batches"] == 2 and st["hits"] + st["misses"] == st["lookups"] > 0
    assert st["uses"] == 2 * ids.size and 0.0 <= st["hit_rate"] <= 1.0
    assert st["slots"] == 8 and st["resident"] == 8 and st["uses_mapped"] > 0  # more experts than slots
    heat = np.from_dlpack(s.heat())
    assert heat.shape == (s.num_experts,) and heat.sum() == 2 * ids.size
    assert np.array_equal(heat, 2 * np.bincount(ids.ravel(), minlength=s.num_experts))
    assert np.array_equal(np.from_dlpack(s.heat(3, 4)), heat[3:7])
    assert "hit" in s.report()
    s.reset_stats()
    assert s.stats()["lookups"] == 0


def test_cpu_prefetch_and_invalidate_drive_the_policy():
    rng = np.random.default_rng(5)
    c = make(rng)
    s = cpu_store(c, slots=20)
    ids = np.array([3, 1, 3, 7], np.int64)
    s.prefetch(ids)
    st = s.stats()
    assert (st["lookups"], st["hits"], st["misses"], st["resident"]) == (3, 0, 3, 3)
    s.prefetch(ids)
    assert s.stats()["hits"] == 3
    s.invalidate()
    assert s.stats()["resident"] == 0


def test_cpu_write_through_tables_then_invalidate():
    rng = np.random.default_rng(6)
    c = make(rng)
    s = cpu_store(c)
    s.prefetch(np.arange(5, dtype=np.int64))
    u_t, v_t = (np.from_dlpack(t) for t in s.tables())
    c["u"][:] *= 2.0
    u_t[:] = c["u"]
    s.invalidate()  # no stale cached copy
    y = smelt.peer(c["x"], c["wq"], c["sub_keys"], c["u"], c["v"], k=3)
    assert np.array_equal(smelt.peer(c["x"], c["wq"], c["sub_keys"], store=s, k=3), y)


def test_views_keep_the_store_alive():
    rng = np.random.default_rng(7)
    c = make(rng)
    u_view = cpu_store(c).tables()[0]  # the store itself is dropped at once
    assert np.array_equal(np.from_dlpack(u_view), c["u"])


def test_errors():
    rng = np.random.default_rng(8)
    c = make(rng)
    s = cpu_store(c)
    args = (c["x"], c["wq"], c["sub_keys"])
    with pytest.raises(smelt.ArgumentError, match="either u and v or store"):
        smelt.peer(*args, c["u"], c["v"], store=s)
    with pytest.raises(smelt.ArgumentError, match="u and v are required"):
        smelt.peer(*args)
    with pytest.raises(smelt.ArgumentError, match="u_rows must be"):
        s.write(0, c["u"][:, :5], c["v"])
    with pytest.raises(smelt.ArgumentError, match="u_rows must be"):
        s.write(0, c["u"].astype(np.float64), c["v"])
    with pytest.raises(smelt.ArgumentError, match="experts"):
        s.write(0, c["u"], c["v"][:3])
    with pytest.raises(smelt.Error):
        s.write(s.num_experts - 1, c["u"][:2], c["v"][:2])  # past the last expert
    with pytest.raises(smelt.ArgumentError, match="heat"):
        s.heat(5, s.num_experts)
    with pytest.raises(smelt.ArgumentError, match="not both|absent"):
        smelt.peer_backward(*args[:1], np.zeros((7, 2, 3), np.int64), c["dy"], *args[1:], store=s, k=3,
                            needs=["du"])
    with pytest.raises(smelt.DTypeError):
        smelt.PeerStore(16, 4, 4, dtype="i7", device="cpu")
    with pytest.raises(smelt.Error):
        smelt.PeerStore(16, 4, 4, dtype="f32", cache_mb=1e-6, use_env=False, device="cpu")  # < one expert
    s.close()
    assert s.closed
    with pytest.raises(smelt.ArgumentError, match="closed"):
        smelt.peer(*args, store=s, k=3)
    with pytest.raises(smelt.ArgumentError, match="closed"):
        s.stats()


def test_cuda_torch_bf16_store_matches_dense():
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and smelt.info()["device_count"] > 0):
        pytest.skip("needs a CUDA device")
    g = torch.Generator().manual_seed(3)
    T, d_in, d_out, h, dq, n, k = 64, 64, 48, 4, 32, 16, 8
    x = torch.randn(T, d_in, generator=g).to("cuda", torch.bfloat16)
    wq = (torch.randn(d_in, h * dq, generator=g) / 8).to("cuda", torch.bfloat16)
    keys = [torch.randn(n, dq // 2, generator=g).to("cuda", torch.bfloat16) for _ in range(2)]
    u = (torch.randn(n * n, d_in, 1, generator=g) / 8).to(torch.bfloat16)
    v = torch.randn(n * n, 1, d_out, generator=g).to(torch.bfloat16)
    dy = torch.randn(T, d_out, generator=g).to("cuda", torch.bfloat16)
    # a cache of ~1/4 of the experts: hits, misses and evictions all happen
    row = (d_in + d_out) * 2
    s = smelt.PeerStore(n * n, d_in, d_out, dtype="bf16", cache_mb=n * n * row / 4 / 2**20, use_env=False)
    s.write(0, u, v)
    uc, vc = u.cuda(), v.cuda()
    y, ids, _ = smelt.peer(x, wq, keys, uc, vc, k=k, return_ids=True)
    for _ in range(3):
        assert torch.equal(smelt.peer(x, wq, keys, store=s, k=k), y)
    st = s.stats()
    assert st["batches"] == 3 and st["hits"] + st["misses"] == st["lookups"] and st["hits"] > 0
    dense = smelt.peer_backward(x, ids, dy, wq, keys, uc, vc, k=k)
    sparse = smelt.peer_backward(x, ids, dy, wq, keys, store=s, k=k)
    assert torch.equal(sparse["dx"], dense["dx"])
    gi = sparse["grad_ids"]
    assert torch.equal(gi, torch.unique(ids))
    assert torch.equal(sparse["du_rows"], dense["du"][gi]) and torch.equal(sparse["dv_rows"], dense["dv"][gi])
    heat = torch.from_dlpack(s.heat())
    assert int(heat.sum()) == 3 * ids.numel()
