"""smelt.flash_attn_compat: FlashAttention's entry points on smelt give
smelt's results (the same call through smelt.torch), refuse what smelt
does not offer, and the KV-cache call appends then attends. CUDA only (the
torch ops' attention runs on the CPU too, but the decode path is the point
here and its reference is the attention of the whole cache)."""
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

import smelt.torch as st  # noqa: E402
from smelt import flash_attn_compat as fa  # noqa: E402


def _qkv(b, sq, sk, h, hk, d, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(7)
    mk = lambda *s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return mk(b, sq, h, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def test_func_is_smelt_attention():
    q, k, v = _qkv(2, 77, 77, 8, 2, 64)
    got = fa.flash_attn_func(q, k, v, causal=True, window_size=(16, 0), softcap=30.0)
    want = st.attention(q, k, v, causal=True, window=(16, 0), softcap=30.0)
    assert torch.equal(got, want)
    qkv = torch.stack([q, q, q], dim=2)
    assert torch.equal(fa.flash_attn_qkvpacked_func(qkv), st.attention(q, q, q))


def test_refusals():
    q, k, v = _qkv(1, 16, 16, 2, 2, 64)
    with pytest.raises(NotImplementedError, match="dropout"):
        fa.flash_attn_func(q, k, v, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="return_attn_probs"):
        fa.flash_attn_func(q, k, v, return_attn_probs=True)
    with pytest.raises(NotImplementedError, match="rotary_cos"):
        fa.flash_attn_with_kvcache(q, k, v, rotary_cos=torch.ones(16, 32, device="cuda"))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_appends_then_attends(paged):
    b, h, hk, d, smax, snew = 3, 8, 2, 128, 96, 2
    q, kn, vn = _qkv(b, snew, snew, h, hk, d)
    lens = torch.tensor([0, 17, 94], dtype=torch.int32, device="cuda")
    kfull, vfull = _qkv(b, smax, smax, hk, hk, d)[1:]
    if paged:  # pages of 16 in shuffled order
        ps, per = 16, smax // 16
        order = torch.randperm(b * per, generator=torch.Generator().manual_seed(3)).to("cuda")
        table = order.view(b, per).to(torch.int32)
        kc = torch.empty(b * per, ps, hk, d, device="cuda", dtype=q.dtype)
        vc = torch.empty_like(kc)
        kc[order] = kfull.reshape(b * per, ps, hk, d)
        vc[order] = vfull.reshape(b * per, ps, hk, d)
    else:
        table, kc, vc = None, kfull.clone(), vfull.clone()
    out = fa.flash_attn_with_kvcache(q, kc, vc, kn, vn, cache_seqlens=lens, block_table=table, causal=True)
    for i in range(b):
        n = int(lens[i])
        k = torch.cat([kfull[i, :n], kn[i]]).unsqueeze(0)
        v = torch.cat([vfull[i, :n], vn[i]]).unsqueeze(0)
        want = st.attention(q[i:i + 1], k, v, causal=True)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-2, rtol=2e-2)
