"""smelt.gemm and smelt.attention with torch: against torch.matmul and
scaled_dot_product_attention (forward and gradients), opcheck of the custom
ops, and torch.compile without graph breaks. CPU cases (f32, the reference
backend) run wherever torch is installed; bf16 cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402
from torch_common import DEVICES, randn, rel  # noqa: E402

F = torch.nn.functional

# ‖smelt - ref‖ / ‖ref‖ bounds, ref in float64.
REL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def params(device):
    """(device, dtype) cases: f32 on the CPU, bf16 on CUDA."""
    return (device, torch.float32 if device == "cpu" else torch.bfloat16)


# ---- gemm


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["identity", "gelu"])
def test_gemm_vs_matmul(gen, device, act):
    device, dtype = params(device)
    a = randn(gen, (67, 130), dtype, device)
    b = randn(gen, (130, 72), dtype, device)
    bias = randn(gen, (72,), dtype, device)
    d = smelt.gemm(a, b, bias=bias, activation=act)
    assert d.dtype == dtype and d.device == a.device and d.shape == (67, 72)
    want = a.double() @ b.double() + bias.double()
    want = F.gelu(want) if act == "gelu" else want
    assert rel(d, want) < REL[dtype]
    if dtype != torch.float32:  # no worse than torch.matmul's own bf16 result, within a margin
        theirs = torch.matmul(a, b) + bias
        theirs = F.gelu(theirs) if act == "gelu" else theirs
        assert rel(d, want) < 2 * rel(theirs, want) + 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_batched_out_no_copy(gen, device):
    device, dtype = params(device)
    a = randn(gen, (3, 17, 40), dtype, device)
    b = randn(gen, (3, 40, 24), dtype, device).transpose(-1, -2).contiguous().transpose(-1, -2)  # column-major
    out = torch.empty(3, 17, 24, dtype=torch.float32, device=device)
    assert smelt.gemm(a, b, out=out) is out
    assert rel(out, a.double() @ b.double()) < REL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_gemm_grad(gen, device):
    a = randn(gen, (9, 20), device=device).requires_grad_()
    b = randn(gen, (20, 11), device=device).requires_grad_()
    c = randn(gen, (9, 11), device=device).requires_grad_()
    bias = randn(gen, (11,), device=device).requires_grad_()
    dy = randn(gen, (9, 11), device=device)
    d = st.gemm(a, b, c, bias, alpha=0.5, beta=2.0, activation="silu")
    g = torch.autograd.grad(d, (a, b, c, bias), dy)
    xs = [t.detach().double().requires_grad_() for t in (a, b, c, bias)]
    ref = F.silu(0.5 * xs[0] @ xs[1] + 2.0 * xs[2] + xs[3])
    gr = torch.autograd.grad(ref, xs, dy.double())
    for x, y in zip(g, gr):
        assert rel(x, y) < 1e-5


# ---- attention


def sdpa_ref(q, k, v, causal):
    """SDPA in float64 on [B, S, H, D] tensors, bottom-right causal, GQA."""
    Sq, Sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        mask = j <= i + Sk - Sq
    H, Hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(H // Hk, dim=2)
    v = v.repeat_interleave(H // Hk, dim=2)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return o.transpose(1, 2)


def attn_inputs(gen, device, dtype, sq, sk, h, hk, d):
    q = randn(gen, (2, sq, h, d), dtype, device)
    k = randn(gen, (2, sk, hk, d), dtype, device)
    v = randn(gen, (2, sk, hk, d), dtype, device)
    return q, k, v


ATTN_SHAPES = [(1, 1, 2, 2), (17, 33, 4, 1), (40, 29, 4, 2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq,sk,h,hk", ATTN_SHAPES)
def test_attention_vs_sdpa(gen, device, causal, sq, sk, h, hk):
    device, dtype = params(device)
    q, k, v = attn_inputs(gen, device, dtype, sq, sk, h, hk, 16 if device == "cpu" else 64)
    o, lse = smelt.attention(q, k, v, causal=causal, return_lse=True)
    assert o.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, h, sq)
    want = sdpa_ref(q.double(), k.double(), v.double(), causal)
    assert rel(o, want) < REL[dtype]
    # Our bf16 error should be of the order of torch's own bf16 SDPA error.
    if dtype != torch.float32:
        theirs = sdpa_ref(q, k, v, causal)
        assert rel(o, want) < 3 * rel(theirs, want) + 2e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_grad_vs_sdpa(gen, device, causal):
    device, dtype = params(device)
    q, k, v = attn_inputs(gen, device, dtype, 37, 45, 4, 2, 16 if device == "cpu" else 64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = st.attention(q, k, v, causal=causal)
    do = randn(gen, o.shape, dtype, device)
    g = torch.autograd.grad(o, (q, k, v), do)
    xs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    gr = torch.autograd.grad(sdpa_ref(*xs, causal), xs, do.double())
    if dtype == torch.float32:
        bounds = [1e-5] * 3
    else:  # torch's own SDPA gradients in the same dtype set the scale
        ts = [t.detach().requires_grad_() for t in (q, k, v)]
        gt = torch.autograd.grad(sdpa_ref(*ts, causal), ts, do)
        bounds = [max(2e-2, 3 * rel(t, y)) for t, y in zip(gt, gr)]
    for name, x, y, bound in zip("qkv", g, gr, bounds):
        assert x.dtype == dtype and x.shape == y.shape
        assert rel(x, y) < bound, "d%s: %g" % (name, rel(x, y))


# ---- custom ops


def _opcheck_cases(device):
    g = torch.Generator().manual_seed(0)
    a = randn(g, (6, 10), device=device).requires_grad_()
    b = randn(g, (10, 7), device=device).requires_grad_()
    bias = randn(g, (7,), device=device).requires_grad_()
    c = randn(g, (6, 7), device=device)
    d = 16 if device == "cpu" else 64
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    q = randn(g, (1, 5, 4, d), dt, device).requires_grad_()
    k = randn(g, (1, 7, 2, d), dt, device).requires_grad_()
    v = randn(g, (1, 7, 2, d), dt, device).requires_grad_()
    o, lse = torch.ops.smelt.attention(q.detach(), k.detach(), v.detach(), True, None, -1, -1)
    return [
        (torch.ops.smelt.gemm.default, (a, b, None, bias, 1.0, 0.0, "gelu", 0.01, "default", None)),
        (torch.ops.smelt.gemm.default, (a, b, c, None, 0.5, 1.0, "identity", 0.01, "default", None)),
        (torch.ops.smelt.attention.default, (q, k, v, False, None, -1, -1)),
        (torch.ops.smelt.attention.default, (q, k, v, True, 0.2, -1, -1)),
        (torch.ops.smelt.attention_backward.default,
         (q.detach(), k.detach(), v.detach(), o, torch.randn_like(o), lse, True, None, -1, -1)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gemm_attention(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def _block(x, w, bias, q, k, v):
    h = smelt.gemm(x, w, bias=bias, activation="gelu")  # routes to torch.ops.smelt.gemm under compile
    o = smelt.attention(q, k, v, causal=True)
    return h.float().sum() + o.float().sum()


@pytest.mark.parametrize("device", DEVICES)
def test_compile_gemm_attention_no_graph_breaks(gen, device):
    device, dtype = params(device)
    x, w, bias = randn(gen, (8, 32), dtype, device), randn(gen, (32, 16), dtype, device), randn(gen, (16,), dtype, device)
    q, k, v = attn_inputs(gen, device, dtype, 9, 9, 2, 1, 16 if device == "cpu" else 64)
    args = (x, w, bias, q, k, v)
    ex = torch._dynamo.explain(_block)(*args)
    assert ex.graph_break_count == 0, ex.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_block, fullgraph=True)
    want = _block(*args)
    assert torch.allclose(compiled(*args), want, rtol=1e-3 if dtype == torch.float32 else 2e-2)
