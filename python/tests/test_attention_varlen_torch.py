"""torch.ops.smelt.attention_varlen: packed sequences of different lengths
against per-sequence attention in float64 (forward and gradients), opcheck
of the custom ops, torch.compile without graph breaks. CPU cases (f32, the
reference backend) run wherever torch is installed; bf16 cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402
from torch_common import DEVICES, rel  # noqa: E402

F = torch.nn.functional

REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def params(device):
    """(device, dtype, head dim): f32 on the CPU, bf16 on CUDA."""
    return (device, torch.float32, 16) if device == "cpu" else (device, torch.bfloat16, 64)


def one_seq(q, k, v, causal, scale):
    """Attention of one sequence: q [Sq, H, D], k, v [Sk, Hk, D]; bottom-right
    causal; a query that sees no key gives 0."""
    sq, sk, h, hk = q.shape[0], k.shape[0], q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if causal:
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        s = s.masked_fill(~(j <= i + sk - sq).to(s.device), float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)  # rows with no key: 0
    return torch.einsum("hqk,khd->qhd", p, v)


def varlen_ref(q, k, v, cu_q, cu_k, causal):
    scale = q.shape[-1] ** -0.5
    outs = []
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        outs.append(one_seq(q[qs], k[ks], v[ks], causal, scale))
    return torch.cat(outs)


def packed(gen, device, dtype, d, lens_q, lens_k, h=4, hk=2):
    cu_q = [0]
    cu_k = [0]
    for a, b in zip(lens_q, lens_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    mk = lambda *shape: torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    q, k, v = mk(cu_q[-1], h, d), mk(cu_k[-1], hk, d), mk(cu_k[-1], hk, d)
    tq = torch.tensor(cu_q, dtype=torch.int32, device=device)
    tk = torch.tensor(cu_k, dtype=torch.int32, device=device)
    return q, k, v, tq, tk, cu_q, cu_k


LENS = [([5, 17, 1], [9, 17, 4]), ([0, 12, 30], [3, 12, 30])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", LENS, ids=["uneven", "with-empty"])
def test_varlen_forward_backward_vs_reference(gen, device, causal, lens):
    device, dtype, d = params(device)
    q, k, v, tq, tk, cu_q, cu_k = packed(gen, device, dtype, d, *lens)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = st.attention_varlen(q, k, v, tq, tk, max(lens[0]), max(lens[1]), causal=causal, return_lse=True)
    assert o.dtype == dtype and o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = varlen_ref(*xs, cu_q, cu_k, causal)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(device=device)
    g = torch.autograd.grad(o, (q, k, v), do.to(dtype))
    gr = torch.autograd.grad(want, xs, do)
    if dtype == torch.float32:
        bounds = [REL[dtype]] * 4
    else:  # the same reference computed by torch in bf16 sets the scale of bf16 error
        ts = [t.detach().requires_grad_() for t in (q, k, v)]
        theirs = varlen_ref(*ts, cu_q, cu_k, causal)
        gt = torch.autograd.grad(theirs, ts, do.to(dtype))
        bounds = [max(REL[dtype], 3 * rel(t, y)) for t, y in zip((theirs,) + gt, (want,) + gr)]
    assert rel(o, want) < bounds[0]
    for name, x, y, bound in zip("qkv", g, gr, bounds[1:]):
        assert x.dtype == dtype and x.shape == y.shape
        assert rel(x, y) < bound, "d%s: %g (bound %g)" % (name, rel(x, y), bound)
    # The plain binding gives the same forward.
    o2 = smelt.attention_varlen(q.detach(), k.detach(), v.detach(), tq, tk, max(lens[0]), max(lens[1]), causal=causal)
    assert torch.equal(o2, o.detach())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_attention_varlen(gen, device):
    device, dtype, d = params(device)
    q, k, v, tq, tk, _, _ = packed(gen, device, dtype, d, [3, 6], [5, 6])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.smelt.attention_varlen.default, (q, k, v, tq, tk, 6, 6, True, None, -1, -1))
    torch.library.opcheck(torch.ops.smelt.attention_varlen.default, (q, k, v, tq, tk, 6, 6, False, 0.3, 2, 1))
    o, lse = torch.ops.smelt.attention_varlen(q.detach(), k.detach(), v.detach(), tq, tk, 6, 6, True, None, -1, -1)
    torch.library.opcheck(torch.ops.smelt.attention_varlen_backward.default,
                          (q.detach(), k.detach(), v.detach(), o, torch.randn_like(o), lse, tq, tk, 6, 6, True, None,
                           -1, -1))


def _block(q, k, v, tq, tk):
    o = smelt.attention_varlen(q, k, v, tq, tk, 8, 8, causal=True)  # routes to the custom op under compile
    return o.float().sum()


@pytest.mark.parametrize("device", DEVICES)
def test_compile_varlen_no_graph_breaks(gen, device):
    device, dtype, d = params(device)
    q, k, v, tq, tk, _, _ = packed(gen, device, dtype, d, [8, 3], [8, 5])
    args = (q, k, v, tq, tk)
    ex = torch._dynamo.explain(_block)(*args)
    assert ex.graph_break_count == 0, ex.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_block, fullgraph=True)
    assert torch.allclose(compiled(*args), _block(*args), rtol=1e-3 if dtype == torch.float32 else 2e-2)
