"""smelt.attention_decode and smelt.kv_cache_append: numpy on the CPU
against a float64 reference written here (the cache gathered through the
block table into contiguous keys and values), and torch on CUDA (bf16)
against the same reference and against torch's scaled_dot_product_attention
on the gathered cache. Pages are handed out in shuffled order."""

import math

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


def make_cache(rng, lens, page, hk, d, dtype):
    """Caches with pages for every sequence in shuffled order, the block
    table (unused entries -1) and the lengths."""
    need = [(n + page - 1) // page for n in lens]
    pages = sum(need) + 2
    perm = rng.permutation(pages).astype(np.int32)
    table = np.full((len(lens), max(need) + 1), -1, np.int32)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    kc = rng.standard_normal((pages, page, hk, d)).astype(dtype)
    vc = rng.standard_normal((pages, page, hk, d)).astype(dtype)
    return kc, vc, table, np.asarray(lens, np.int32)


def gather(cache, table, b, n):
    """Positions 0..n-1 of sequence b: [n, Hk, D]."""
    page = cache.shape[1]
    return np.stack([cache[table[b, p // page], p % page] for p in range(n)]) if n else cache[:0, 0]


def reference(q, kc, vc, table, lens, causal=True, scale=None):
    B, sq, h, d = q.shape
    g = h // kc.shape[2]
    scale = 1 / math.sqrt(d) if scale is None else scale
    o = np.zeros(q.shape, np.float64)
    lse = np.full((B, h, sq), np.inf)
    for b in range(B):
        k = gather(kc, table, b, lens[b]).astype(np.float64)
        v = gather(vc, table, b, lens[b]).astype(np.float64)
        for i in range(sq):
            last = lens[b] - sq + i if causal else lens[b] - 1
            if last < 0:
                continue
            for hh in range(h):
                s = scale * (k[:last + 1, hh // g] @ q[b, i, hh].astype(np.float64))
                m = s.max()
                p = np.exp(s - m)
                o[b, i, hh] = p @ v[:last + 1, hh // g] / p.sum()
                lse[b, hh, i] = m + math.log(p.sum())
    return o, lse


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


@pytest.mark.parametrize("sq,h,hk,page,causal", [(1, 8, 2, 16, True), (5, 16, 2, 64, True), (3, 4, 4, 7, False)])
def test_decode_numpy(rng, sq, h, hk, page, causal):
    lens = [sq + 3, 70, 2 * page]
    kc, vc, table, sl = make_cache(rng, lens, page, hk, 32, np.float32)
    q = rng.standard_normal((3, sq, h, 32)).astype(np.float32)
    o, lse = smelt.attention_decode(q, kc, vc, table, sl, causal=causal, return_lse=True)
    want_o, want_lse = reference(q, kc, vc, table, lens, causal)
    assert o.shape == q.shape and lse.shape == (3, h, sq)
    assert rel_err(o, want_o) < 1e-6
    assert rel_err(lse, want_lse) < 1e-6


def test_append_numpy(rng):
    lens = [0, 17, 40]
    kc, vc, table, sl = make_cache(rng, [n + 4 for n in lens], 16, 2, 16, np.float32)
    before = np.asarray(lens, np.int32)
    kn = rng.standard_normal((3, 4, 2, 16)).astype(np.float32)
    vn = rng.standard_normal((3, 4, 2, 16)).astype(np.float32)
    smelt.kv_cache_append(kn, vn, table, before, kc, vc)
    for b in range(3):
        np.testing.assert_array_equal(gather(kc, table, b, lens[b] + 4)[lens[b]:], kn[b])
        np.testing.assert_array_equal(gather(vc, table, b, lens[b] + 4)[lens[b]:], vn[b])
    # The appended rows decode as the last Sq = 4 queries' keys.
    q = rng.standard_normal((3, 4, 8, 16)).astype(np.float32)
    o = smelt.attention_decode(q, kc, vc, table, sl)
    assert rel_err(o, reference(q, kc, vc, table, [n + 4 for n in lens])[0]) < 1e-6


def test_decode_errors(rng):
    kc, vc, table, sl = make_cache(rng, [5], 16, 2, 16, np.float32)
    with pytest.raises(smelt.Error, match="block_table"):
        smelt.attention_decode(np.zeros((1, 1, 4, 16), np.float32), kc, vc, table.astype(np.int64), sl)
    bad = table.copy()
    bad[0, 0] = kc.shape[0]
    with pytest.raises(smelt.ArgumentError, match=r"block_table\[0\]\[0\]"):
        smelt.attention_decode(np.zeros((1, 1, 4, 16), np.float32), kc, vc, bad, sl)
    with pytest.raises(smelt.Error, match="1..64"):
        smelt.attention_decode(np.zeros((1, 65, 4, 16), np.float32), kc, vc, table, np.asarray([70], np.int32))


def test_decode_torch_cuda(seed):
    torch = pytest.importorskip("torch")
    from torch_common import CUDA
    if not CUDA:
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(seed)
    lens = [1, 300, 4097]
    kc, vc, table, sl = make_cache(rng, lens, 64, 8, 128, np.float32)
    q = rng.standard_normal((3, 1, 32, 128)).astype(np.float32)
    dev = lambda a, dt=torch.bfloat16: torch.from_numpy(a).to("cuda", dt)  # noqa: E731
    qt, kt, vt = dev(q), dev(kc), dev(vc)
    o = smelt.attention_decode(qt, kt, vt, dev(table, torch.int32), dev(sl, torch.int32))
    rq, rk, rv = (t.float().cpu().numpy() for t in (qt, kt, vt))
    want = reference(rq, rk, rv, table, lens)[0]
    assert o.dtype == torch.bfloat16 and rel_err(o.float().cpu().numpy(), want) < 1e-2
    # torch's SDPA on the gathered cache of the longest sequence, as a second opinion.
    k, v = (torch.from_numpy(gather(c, table, 2, lens[2])).cuda().bfloat16().transpose(0, 1)[None]
            .repeat_interleave(4, dim=1) for c in (rk, rv))
    theirs = torch.nn.functional.scaled_dot_product_attention(qt[2:3].transpose(1, 2), k, v)
    assert rel_err(o[2:3].float().cpu().numpy(), theirs.transpose(1, 2).float().cpu().numpy()) < 2e-2
