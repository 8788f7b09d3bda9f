"""smelt.torch.bem_update, torch.ops.smelt.bem_update / bem_backward and
smelt.torch.BEMLinear: the forward and every gradient (x, v, codes, u, and
y with accumulate) against a torch reference in float64 with autograd,
u pre-transposed through a view, segments of several adapters with an
empty one, opcheck of the custom ops, torch.compile without graph breaks
(backward included), the module, and bad arguments raising smelt.Error.
CPU cases (f32, the reference backend; BEM has no f64) run wherever torch
is installed; bf16 cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402
from torch_common import DEVICES, needs_cuda, randn, rel  # noqa: E402

# ‖smelt - ref‖ / ‖ref‖ bounds, ref in float64. f32 on the CPU: the reference
# backend computes in double and rounds once. bf16 on CUDA: H rounded to
# bf16 before the second product, and the composed backward keeps its [M, r]
# intermediates in bf16 (smelt/bem.h), checked against torch's own bf16
# error too.
REL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
REL_GRAD = {torch.float32: 1e-5, torch.bfloat16: 4e-2}


def params(device):
    return device, torch.float32 if device == "cpu" else torch.bfloat16


def ref_update(x, v, codes, u, scale, offsets=None, scales=None):
    """ΔY in float64 torch ops (differentiable by autograd); v and u
    [A, ., r] with offsets, [., r] without."""
    x, v, codes, u = (t.double() for t in (x, v, codes, u))
    if offsets is None:
        s = scale * (1.0 if scales is None else float(scales[0]))
        return s * ((x @ v) * codes) @ u.T
    M, rows, run = x.shape[0], [], 0
    o = []
    for a in range(v.shape[0] + 1):
        run = max(run, int(offsets[a]))
        o.append(min(run, M))
    rows = [torch.zeros(o[0], u.shape[1], dtype=torch.float64, device=x.device)]
    for a in range(v.shape[0]):
        s = scale * (1.0 if scales is None else float(scales[a]))
        lo, hi = o[a], o[a + 1]
        rows.append(s * ((x[lo:hi] @ v[a]) * codes[lo:hi]) @ u[a].T)
    rows.append(torch.zeros(M - o[-1], u.shape[1], dtype=torch.float64, device=x.device))
    return torch.cat(rows)


def problem(gen, dtype, device, M=37, din=24, dout=40, r=8, A=0):
    """x, v, codes, u as leaves that require gradients (A adapters when A > 0)."""
    w = (A,) if A else ()
    x = randn(gen, (M, din), dtype, device)
    v = randn(gen, w + (din, r), dtype, device, din ** -0.5)
    codes = randn(gen, (M, r), dtype, device)
    u = randn(gen, w + (dout, r), dtype, device, r ** -0.5)
    return [t.requires_grad_() for t in (x, v, codes, u)]


def ref_grads(fn, leaves, dy):
    """fn of float64 copies of leaves and the gradients of sum(fn · dy), all
    in float64."""
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want = fn(*wide)
    return want, torch.autograd.grad((want * dy.double()).sum(), wide)


def grads_of(leaves, y, dy):
    for t in leaves:
        t.grad = None
    wide = torch.promote_types(dy.dtype, torch.float32)
    (y.to(wide) * dy.to(wide)).sum().backward()
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return got


# ---- forward and autograd against the reference


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("M,din,dout,r", [(37, 24, 40, 8), (5, 7, 3, 1), (64, 128, 96, 16)])
def test_autograd_vs_reference(gen, device, M, din, dout, r):
    device, dtype = params(device)
    leaves = problem(gen, dtype, device, M, din, dout, r)
    dy = randn(gen, (M, dout), dtype, device)
    y = st.bem_update(*leaves, scale=0.5)
    assert y.dtype == dtype and y.shape == (M, dout) and y.device == leaves[0].device
    got = grads_of(leaves, y, dy)
    want, wgrads = ref_grads(lambda *t: ref_update(*t, 0.5), leaves, dy)
    assert rel(y, want) < REL[dtype]
    if dtype != torch.float32:  # of the order of torch's own bf16 update
        x, v, codes, u = (t.detach() for t in leaves)
        theirs = 0.5 * ((x @ v) * codes) @ u.T
        assert rel(y, want) < 2 * rel(theirs, want) + 2e-3
    for g, w, t, n in zip(got, wgrads, leaves, ("dx", "dv", "dcodes", "du")):
        assert g.dtype == dtype and g.shape == t.shape, n
        assert rel(g, w) < REL_GRAD[dtype], n


@pytest.mark.parametrize("device", DEVICES)
def test_accumulate_and_u_transposed(gen, device):
    """y += ΔY (y's gradient is dy) with U stored [r, d_out], the seed's
    layout, read through its transposed view; du comes back [r, d_out]."""
    device, dtype = params(device)
    x, v, codes, u = problem(gen, dtype, device, 19, 16, 24, 4)
    ut = u.detach().T.contiguous().requires_grad_()
    base = randn(gen, (19, 24), dtype, device).requires_grad_()
    dy = randn(gen, (19, 24), dtype, device)
    y = torch.ops.smelt.bem_update(x, v, codes, ut.transpose(0, 1), None, None, base, 2.0)
    leaves = [x, v, codes, ut, base]
    got = grads_of(leaves, y, dy)
    want, wgrads = ref_grads(lambda x, v, c, ut, b: b + ref_update(x, v, c, ut.T, 2.0), leaves, dy)
    assert rel(y, want) < REL[dtype]
    assert got[3].shape == (4, 24)
    for g, w in zip(got, wgrads):
        assert rel(g, w) < REL_GRAD[dtype]
    # The Python form: out given, filled in place.
    out = base.detach().clone()
    assert st.bem_update(x.detach(), v.detach(), codes.detach(), ut.detach(), scale=2.0, accumulate=True,
                         u_transposed=True, out=out) is out
    assert rel(out, want) < REL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_segments(gen, device):
    """Three adapters over rows [2, 9), [9, 9) (empty) and [9, 20); the rows
    before and after get zero (forward and every gradient, CPU)."""
    device, dtype = params(device)
    x, v, codes, u = problem(gen, dtype, device, 23, 16, 24, 4, A=3)
    offsets = torch.tensor([2, 9, 9, 20], dtype=torch.int32, device=device)
    scales = torch.tensor([0.5, 2.0, -1.0], dtype=torch.float32, device=device)
    y = st.bem_update(x, v, codes, u, scale=1.5, offsets=offsets, scales=scales)
    want = ref_update(x, v, codes, u, 1.5, offsets.cpu(), scales.cpu())
    assert rel(y, want) < REL[dtype]
    assert not y[:2].any() and not y[20:].any()
    if device != "cpu":  # the CUDA backward runs one adapter only
        with pytest.raises(smelt.UnsupportedError):
            y.float().sum().backward()
        return
    dy = randn(gen, y.shape, dtype, device)
    got = grads_of([x, v, codes, u], y, dy)
    _, wgrads = ref_grads(lambda *t: ref_update(*t, 1.5, offsets.cpu(), scales.cpu()), [x, v, codes, u], dy)
    for g, w in zip(got, wgrads):
        assert rel(g, w) < REL_GRAD[dtype]
    assert not got[0][20:].any() and not got[2][:2].any()


@pytest.mark.parametrize("device", DEVICES)
def test_backward_function(gen, device):
    """smelt.bem_backward with torch tensors (the C call, no autograd), and
    smelt.torch.bem_backward (the custom op) agree with autograd's."""
    device, dtype = params(device)
    leaves = problem(gen, dtype, device, 21, 16, 8, 4)
    dy = randn(gen, (21, 8), dtype, device)
    want = dict(zip(("dx", "dv", "dcodes", "du"), grads_of(leaves, st.bem_update(*leaves, scale=0.25), dy)))
    x, v, codes, u = (t.detach() for t in leaves)
    same = 1e-6 if dtype == torch.float32 else 1e-2  # the same kernels (one may take u through strides)
    for got in (smelt.bem_backward(dy, x, v, codes, u, scale=0.25), st.bem_backward(dy, x, v, codes, u, scale=0.25)):
        assert sorted(got) == ["dcodes", "du", "dv", "dx"]
        for n in got:
            assert got[n].shape == want[n].shape and rel(got[n], want[n]) < same, n
    part = st.bem_backward(dy, x, v, codes, u.T.contiguous(), scale=0.25, u_transposed=True, needs=["du"])
    assert list(part) == ["du"] and part["du"].shape == (4, 8) and rel(part["du"], want["du"].T) < same


@needs_cuda
def test_cuda_stream(gen):
    """The update on CUDA writes into out= on torch's current stream."""
    x, v, codes, u = (t.detach() for t in problem(gen, torch.bfloat16, "cuda", 33, 64, 48, 16))
    s = torch.cuda.Stream()
    out = torch.full((33, 48), float("nan"), dtype=torch.bfloat16, device="cuda")
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        smelt.bem_update(x, v, codes, u, scale=0.5, out=out)
    torch.cuda.current_stream().wait_stream(s)
    assert rel(out, ref_update(x, v, codes, u, 0.5)) < REL[torch.bfloat16]


# ---- custom ops and torch.compile


def _opcheck_cases(device):
    g = torch.Generator().manual_seed(0)
    device, dt = params(device)
    x, v, codes, u = problem(g, dt, device, 9, 8, 6, 2)
    y = randn(g, (9, 6), dt, device).requires_grad_()
    dy = randn(g, (9, 6), dt, device)
    return [
        (torch.ops.smelt.bem_update.default, (x, v, codes, u, None, None, None, 0.5)),
        (torch.ops.smelt.bem_update.default, (x, v, codes, u, None, None, y, 2.0)),
        (torch.ops.smelt.bem_backward.default, (x.detach(), v.detach(), codes.detach(), u.detach(), None, None, dy,
                                                0.5, [True, True, False, True])),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_bem(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def _update(x, v, codes, u):
    """smelt.bem_update routes to torch.ops.smelt.bem_update under compile."""
    return smelt.bem_update(x, v, codes, u, scale=0.5) * 2


@pytest.mark.parametrize("device", DEVICES)
def test_compile_no_graph_breaks(gen, device):
    device, dtype = params(device)
    args = [t.detach() for t in problem(gen, dtype, device, 17, 16, 8, 4)]
    ex = torch._dynamo.explain(_update)(*args)
    assert ex.graph_break_count == 0, ex.break_reasons
    torch._dynamo.reset()
    assert torch.equal(torch.compile(_update, fullgraph=True)(*args), _update(*args))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_module_backward(gen, device):
    """BEMLinear under torch.compile(fullgraph=True): the forward and the
    gradients of x, codes, V and U as in eager."""
    device, dtype = params(device)
    torch.manual_seed(0)
    m = st.BEMLinear(torch.nn.Linear(16, 24, device=device, dtype=dtype), rank=4, alpha=8.0)
    torch.nn.init.normal_(m.u, std=0.5)  # nonzero, so every gradient is
    x = randn(gen, (3, 5, 16), dtype, device).requires_grad_()
    codes = randn(gen, (3, 5, 4), dtype, device).requires_grad_()
    leaves = [x, codes, m.v, m.u]

    def loss(x, codes):
        return m(x, codes).float().square().sum()

    want = torch.autograd.grad(loss(x, codes), leaves)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(loss, fullgraph=True)(x, codes), leaves)
    for g, r in zip(got, want):
        assert rel(g, r) < (1e-5 if dtype == torch.float32 else 2e-2)


# ---- the module


@pytest.mark.parametrize("device", DEVICES)
def test_bem_linear(gen, device):
    device, dtype = params(device)
    base = torch.nn.Linear(16, 12, device=device, dtype=dtype)
    m = st.BEMLinear(base, rank=8)
    assert m.scale == 2.0 and m.v.shape == (16, 8) and m.u.shape == (12, 8) and m.v.dtype == dtype
    assert not base.weight.requires_grad and not any(p.requires_grad for p in base.parameters())
    assert "rank=8" in repr(m)
    x = randn(gen, (2, 7, 16), dtype, device).requires_grad_()
    codes = randn(gen, (2, 7, 8), dtype, device)
    assert torch.allclose(m(x, codes), base(x), rtol=1e-6, atol=1e-6)  # U starts at zero
    torch.nn.init.normal_(m.u, std=0.3)
    y = m(x, codes)
    want = base(x).double() + ref_update(x.reshape(14, 16), m.v, codes.reshape(14, 8), m.u, 2.0).reshape(2, 7, 12)
    assert y.shape == (2, 7, 12) and rel(y, want) < REL[dtype]
    y.float().sum().backward()
    assert m.v.grad is not None and m.u.grad is not None and x.grad is not None and base.weight.grad is None
    with pytest.raises(TypeError, match="nn.Linear"):
        st.BEMLinear(torch.nn.Conv1d(2, 2, 1), rank=2)
    with pytest.raises(smelt.ArgumentError, match="rank"):
        st.BEMLinear(base, rank=129)


# ---- bad arguments


def test_bad_arguments():
    g = torch.Generator().manual_seed(1)
    x, v, codes, u = (t.detach() for t in problem(g, torch.float32, "cpu", 6, 5, 4, 2))
    out = torch.full((6, 4), 7.0)
    for f in (smelt.bem_update, st.bem_update):
        with pytest.raises(smelt.ArgumentError, match="codes"):
            f(x, v, codes[:5], u)
        with pytest.raises(smelt.DTypeError, match="dtype"):
            f(x, v.half(), codes, u)
        with pytest.raises(smelt.ArgumentError, match="accumulate"):
            f(x, v, codes, u, accumulate=True)
    with pytest.raises(smelt.ArgumentError, match=r"out\.shape"):
        smelt.bem_update(x, v, codes, u, out=out[:, :3])
    with pytest.raises(smelt.DTypeError, match="x"):
        smelt.bem_update(3, v, codes, u)
    assert torch.equal(out, torch.full((6, 4), 7.0))
