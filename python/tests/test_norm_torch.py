"""The norms, the residual add and rotary with torch: values against
torch's F.rms_norm / F.layer_norm and a rotary written in torch ops (in
float64), autograd against torch's own (in float64), opcheck of the custom
ops, and torch.compile. CPU cases run wherever torch is installed; CUDA
cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch  # noqa: E402,F401  (registers torch.ops.smelt)
from torch_common import DEVICES, randn, rel  # noqa: E402

from norm_common import ref_rotary  # noqa: E402

F = torch.nn.functional
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative L2 bounds (src/core/error_bound.c: smelt__bound_norm).
BOUND = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def torch_norm(kind, h, w, b, eps):
    h = h.double()
    if kind == "layer":
        return F.layer_norm(h, h.shape[-1:], None if w is None else w.double(), None if b is None else b.double(), eps)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    y = y if w is None else y * w.double()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("C", [7, 768, 4096])
def test_values(gen, device, dtype, kind, C):
    x = randn(gen, (3, 5, C), dtype, device)
    res = randn(gen, (3, 5, C), dtype, device)
    w = randn(gen, (C,), torch.float32, device, scale=0.2) + 1
    b = randn(gen, (C,), torch.float32, device, scale=0.2)
    f = smelt.rms_norm if kind == "rms" else smelt.layer_norm
    y = f(x, w, bias=b) if kind == "rms" else f(x, w, b)
    eps = 1e-6 if kind == "rms" else 1e-5
    assert rel(y, torch_norm(kind, x, w, b, eps)) <= BOUND[dtype]
    y2, h = (smelt.add_rms_norm(x, res, w, bias=b) if kind == "rms" else smelt.add_layer_norm(x, res, w, b))
    assert torch.equal(h, x + res)
    assert rel(y2, torch_norm(kind, x + res, w, b, eps)) <= BOUND[dtype]
    if kind == "rms" and hasattr(F, "rms_norm"):  # torch's own RMSNorm (2.4 on)
        want = F.rms_norm(x.double(), (C,), w.double(), eps)
        assert rel(smelt.rms_norm(x, w), want) <= BOUND[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("residual", [False, True])
def test_autograd(gen, device, kind, residual):
    C = 257
    x = randn(gen, (4, 6, C), torch.float32, device).requires_grad_()
    res = randn(gen, (4, 6, C), torch.float32, device).requires_grad_()
    w = (randn(gen, (C,), torch.float32, device, scale=0.2) + 1).requires_grad_()
    b = randn(gen, (C,), torch.float32, device, scale=0.2).requires_grad_()
    dy = randn(gen, (4, 6, C), torch.float32, device)
    dh = randn(gen, (4, 6, C), torch.float32, device)
    eps = 1e-5
    inputs = [x, w, b] + ([res] if residual else [])
    if residual:
        y, h = smelt.torch_norm.norm(kind, x, w, b, eps, res)
        loss = (y * dy).sum() + (h * dh).sum()
    else:
        loss = (smelt.torch_norm.norm(kind, x, w, b, eps) * dy).sum()
    got = torch.autograd.grad(loss, inputs)
    xd, wd, bd, rd = (t.detach().double().requires_grad_() for t in (x, w, b, res))
    hd = xd + rd if residual else xd
    loss_d = (torch_norm(kind, hd, wd, bd, eps) * dy.double()).sum() + ((hd * dh.double()).sum() if residual else 0)
    want = torch.autograd.grad(loss_d, [xd, wd, bd] + ([rd] if residual else []))
    for g, wg in zip(got, want):
        assert rel(g, wg) <= 1e-5


def torch_rotary(x, cos, sin, pos, layout, inverse):
    """norm_common.ref_rotary on the tensors, as a float64 CPU tensor."""
    np_of = lambda t: None if t is None else t.detach().double().cpu().numpy()  # noqa: E731
    p = None if pos is None else pos.cpu().numpy()
    return torch.from_numpy(ref_rotary(np_of(x), np_of(cos), np_of(sin), p, layout, inverse))


def tables(P, R, device):
    cos, sin = smelt.rotary_tables(P, R)
    return torch.from_numpy(cos).to(device), torch.from_numpy(sin).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["neox", "gptj"])
@pytest.mark.parametrize("R", [64, 128])
def test_rotary(gen, device, dtype, layout, R):
    qkv = randn(gen, (2, 9, 3 * 4, 128), dtype, device)
    q = qkv[:, :, 4:8]  # K of packed QKV: strided heads
    cos, sin = tables(16, R, device)
    pos = torch.randint(-2, 18, (2, 9), generator=gen).to(device)
    for p in (None, pos):
        y = smelt.rotary(q, cos, sin, p, layout=layout)
        assert rel(y, torch_rotary(q, cos, sin, p, layout, False)) <= BOUND[dtype]
    x = q.float().contiguous().requires_grad_()
    dy = randn(gen, x.shape, torch.float32, device)
    (g,) = torch.autograd.grad((smelt.torch_norm.rotary(x, cos, sin, pos, layout) * dy).sum(), x)
    # The rotation is orthogonal: the gradient of <dy, R x> is R⁻¹ dy.
    assert rel(g, torch_rotary(dy, cos, sin, pos, layout, True)) <= 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    g = torch.Generator().manual_seed(0)
    x = randn(g, (6, 40), device=device).requires_grad_()
    r = randn(g, (6, 40), device=device).requires_grad_()
    w = (randn(g, (40,), device=device) + 1).requires_grad_()
    b = randn(g, (40,), device=device).requires_grad_()
    cos, sin = tables(8, 32, device)
    xr = randn(g, (2, 4, 3, 40), device=device).requires_grad_()
    pos = torch.tensor([[0, 3, 5, 7], [1, 2, 9, -1]], device=device)
    cases = [
        (torch.ops.smelt.norm.default, (x, None, w, None, 0, 1e-6)),
        (torch.ops.smelt.norm.default, (x, r, w, b, 1, 1e-5)),
        (torch.ops.smelt.residual_add.default, (x, r)),
        (torch.ops.smelt.rotary.default, (xr, cos, sin, None, 0, False)),
        (torch.ops.smelt.rotary.default, (xr, cos, sin, pos, 1, True)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


def test_compile(gen):
    x = randn(gen, (4, 64))
    res = randn(gen, (4, 64))
    w = randn(gen, (64,)) + 1

    def block(x, res, w):
        y, h = smelt.add_rms_norm(x, res, w)
        return smelt.residual_add(y, h)

    got = torch.compile(block, fullgraph=True)(x, res, w)
    assert rel(got, block(x, res, w)) <= 1e-6
