"""smelt.conv2d, conv2d_dgrad, conv2d_wgrad and the torch op with autograd:
against torch.nn.functional.conv2d (forward and gradients, in float64) on
odd shapes, stride 2, dilation 2, padding 0/1/3 and asymmetric, 1x1 and
7x7 filters, C = 3; NCHW channels_last tensors through views; opcheck of
the custom ops; torch.compile without graph breaks, backward included; bad
arguments raising smelt.Error. CPU cases (f32, the reference backend) run
wherever torch is installed; bf16 cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402
from torch_common import CUDA, DEVICES, needs_cuda, randn, rel  # noqa: E402

F = torch.nn.functional

# ‖smelt - ref‖ / ‖ref‖ bounds, ref in float64 (bf16: one rounding of the
# output and of each operand, checked against torch's own bf16 error too).
REL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}

# (N, H, W, C, K, R, S, stride, padding, dilation): stride and dilation an
# int or (h, w); padding an int, (h, w) or (top, bottom, left, right).
CASES = [
    (2, 7, 9, 3, 5, 3, 3, 1, 1, 1),             # C = 3, the first layer's channels
    (1, 11, 6, 4, 3, 3, 2, 2, 0, 1),            # stride 2, padding 0, R != S
    (2, 9, 10, 5, 6, 3, 3, 1, 3, 2),            # dilation 2, padding 3
    (1, 13, 13, 3, 8, 7, 7, 2, 3, 1),           # 7x7 stride 2 (the stem)
    (2, 5, 6, 8, 4, 1, 1, 1, 0, 1),             # 1x1
    (1, 10, 7, 2, 3, 3, 3, 2, 1, 1),            # stride 2 with an odd H
    (2, 8, 9, 3, 2, 3, 2, (2, 1), (1, 0, 2, 1), (1, 2)),  # per-axis and asymmetric
    (1, 1, 1, 1, 1, 1, 1, 1, 0, 1),
]
IDS = ["c3", "s2p0", "d2p3", "7x7s2", "1x1", "s2odd", "asym", "1"]


def params(device):
    return (device, torch.float32 if device == "cpu" else torch.bfloat16)


def geometry(case):
    """(stride, padding, dilation) of a case, and torch's F.pad tuple."""
    *_, stride, padding, dilation = case
    p = padding if isinstance(padding, tuple) else (padding,) * 4
    p = p if len(p) == 4 else (p[0], p[0], p[1], p[1])
    return stride, padding, dilation, (p[2], p[3], p[0], p[1])


def ref_conv(x_nchw, w_kcrs, case):
    """torch's conv2d of NCHW tensors with the case's (maybe asymmetric) padding."""
    stride, _, dilation, pads = geometry(case)
    return F.conv2d(F.pad(x_nchw, pads), w_kcrs, stride=stride, dilation=dilation)


def inputs(gen, case, dtype, device):
    """x [N, H, W, C] and w [K, R, S, C], NHWC and KRSC."""
    n, h, w, c, k, r, s = case[:7]
    return randn(gen, (n, h, w, c), dtype, device), randn(gen, (k, r, s, c), dtype, device)


def problem(gen, device, case):
    """(dtype, the case's stride/padding/dilation keywords, x, w) on device:
    f32 on the CPU, bf16 on CUDA."""
    device, dtype = params(device)
    stride, padding, dilation, _ = geometry(case)
    return (dtype, dict(stride=stride, padding=padding, dilation=dilation)) + inputs(gen, case, dtype, device)


def nchw(t):
    return t.permute(0, 3, 1, 2)


def nhwc(t):
    return t.permute(0, 2, 3, 1)


# ---- fprop


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_fprop_vs_torch(gen, device, case):
    dtype, kw, x, w = problem(gen, device, case)
    y = smelt.conv2d(x, w, **kw)
    want = nhwc(ref_conv(nchw(x).double(), nchw(w).double(), case))
    assert y.dtype == dtype and y.device == x.device and y.shape == want.shape
    assert rel(y, want) < REL[dtype]
    if dtype != torch.float32:  # of the order of torch's own bf16 conv (cuDNN, channels_last)
        theirs = nhwc(ref_conv(nchw(x).contiguous(memory_format=torch.channels_last),
                               nchw(w).contiguous(memory_format=torch.channels_last), case))
        assert rel(y, want) < 2 * rel(theirs, want) + 2e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", ["identity", "relu", "gelu", "leaky_relu"])
def test_fprop_epilogue(gen, device, act):
    """act(alpha · conv + beta · c + bias), in one call, c read as NPQK."""
    case = CASES[2]
    dtype, kw, x, w = problem(gen, device, case)
    bias = randn(gen, (w.shape[0],), dtype, device)
    conv = nhwc(ref_conv(nchw(x).double(), nchw(w).double(), case))
    c = randn(gen, conv.shape, dtype, device)
    y = smelt.conv2d(x, w, bias, c, alpha=0.5, beta=-2.0, activation=act, slope=0.2, **kw)
    pre = 0.5 * conv - 2.0 * c.double() + bias.double()
    want = {"identity": lambda t: t, "relu": F.relu, "gelu": F.gelu,
            "leaky_relu": lambda t: F.leaky_relu(t, 0.2)}[act](pre)
    assert rel(y, want) < REL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_fprop_in_place_and_out_dtype(gen, device):
    """out may be c exactly (a residual added in place); out_dtype widens D."""
    case = CASES[0]
    dtype, kw, x, w = problem(gen, device, case)
    want = nhwc(ref_conv(nchw(x).double(), nchw(w).double(), case))
    c = randn(gen, want.shape, dtype, device)
    c0 = c.double()
    assert smelt.conv2d(x, w, c=c, out=c, **kw) is c
    assert rel(c, want + c0) < REL[dtype]
    y = smelt.conv2d(x, w, out_dtype=torch.float32, **kw)
    assert y.dtype == torch.float32 and rel(y, want) < REL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_nchw_channels_last_views(gen, device):
    """layout='nchw' reads channels_last NCHW tensors as NHWC without a copy
    (the result is channels_last too), contiguous NCHW ones through strides,
    and out= in NCHW is written in place."""
    case = CASES[3]
    dtype, kw, x, w = problem(gen, device, case)
    xl, wl = nchw(x), nchw(w)  # NCHW shapes over NHWC memory: channels_last
    assert xl.is_contiguous(memory_format=torch.channels_last)
    want = ref_conv(xl.double(), wl.double(), case)
    y = smelt.conv2d(xl, wl, layout="nchw", **kw)
    assert y.shape == want.shape and y.is_contiguous(memory_format=torch.channels_last)
    assert rel(y, want) < REL[dtype]
    y2 = smelt.conv2d(xl.contiguous(), wl.contiguous(), layout="nchw", **kw)  # may take another kernel
    assert y2.shape == want.shape and rel(y2, want) < REL[dtype]
    out = torch.empty_like(y, memory_format=torch.channels_last)
    assert smelt.conv2d(xl, wl, layout="nchw", **kw, out=out) is out
    assert torch.equal(out, y)
    with pytest.raises(smelt.ArgumentError, match="channels_last"):
        smelt.conv2d(xl, wl, **kw)  # NCHW given as NHWC


# ---- dgrad and wgrad


def torch_grads(x, w, dy, case):
    """(dx, dw) of sum(conv(x, w) * dy) in float64, NHWC and KRSC."""
    xd = nchw(x).double().requires_grad_()
    wd = nchw(w).double().requires_grad_()
    gx, gw = torch.autograd.grad(ref_conv(xd, wd, case), (xd, wd), nchw(dy).double())
    return nhwc(gx), nhwc(gw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_dgrad_wgrad_vs_torch(gen, device, case):
    dtype, kw, x, w = problem(gen, device, case)
    y = smelt.conv2d(x, w, **kw)
    dy = randn(gen, y.shape, dtype, device)
    want_dx, want_dw = torch_grads(x, w, dy, case)
    dx = smelt.conv2d_dgrad(dy, w, x.shape, **kw)
    dw = smelt.conv2d_wgrad(dy, x, w.shape, **kw)
    assert dx.shape == x.shape and dw.shape == w.shape and dx.dtype == dw.dtype == dtype
    # wgrad sums N·P·Q products: bf16's bound grows with it as torch's own does.
    assert rel(dx, want_dx) < REL[dtype]
    assert rel(dw, want_dw) < REL[dtype]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_adjoint_identity(gen, case):
    """gradcheck's question without finite differences: dgrad and wgrad are
    the adjoints of fprop, <conv(x, w), dy> = <x, dgrad(dy, w)> =
    <w, wgrad(dy, x)>, each side summed in float64 from smelt's f32 results."""
    _, kw, x, w = problem(gen, "cpu", case)
    y = smelt.conv2d(x, w, **kw)
    dy = randn(gen, y.shape)
    lhs = (y.double() * dy.double()).sum()
    via_x = (x.double() * smelt.conv2d_dgrad(dy, w, x.shape, **kw).double()).sum()
    via_w = (w.double() * smelt.conv2d_wgrad(dy, x, w.shape, **kw).double()).sum()
    scale = (y.double().abs() * dy.double().abs()).sum()
    assert abs(lhs - via_x) <= 1e-5 * scale and abs(lhs - via_w) <= 1e-5 * scale


@pytest.mark.parametrize("device", DEVICES)
def test_grads_accumulate_with_beta(gen, device):
    """dgrad and wgrad take alpha, beta and c: dx = alpha · dgrad + beta · c."""
    case = CASES[1]
    dtype, kw, x, w = problem(gen, device, case)
    dy = randn(gen, smelt.conv2d(x, w, **kw).shape, dtype, device)
    want_dx, want_dw = torch_grads(x, w, dy, case)
    cx, cw = randn(gen, x.shape, dtype, device), randn(gen, w.shape, dtype, device)
    dx = smelt.conv2d_dgrad(dy, w, c=cx, out=cx.clone(), alpha=2.0, beta=0.5, **kw)
    dw = smelt.conv2d_wgrad(dy, x, w.shape, c=cw, alpha=2.0, **kw)  # beta defaults to 1 with c
    assert rel(dx, 2 * want_dx + 0.5 * cx.double()) < REL[dtype]
    assert rel(dw, 2 * want_dw + cw.double()) < REL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_grads_nchw(gen, device):
    """dgrad and wgrad in layout 'nchw': shapes in torch's order, as
    torch.nn.grad.conv2d_input and conv2d_weight take them."""
    case = CASES[3]
    dtype, kw, x, w = problem(gen, device, case)
    dy = randn(gen, smelt.conv2d(x, w, **kw).shape, dtype, device)
    want_dx, want_dw = torch_grads(x, w, dy, case)
    xl, wl, dyl = nchw(x), nchw(w), nchw(dy)
    dx = smelt.conv2d_dgrad(dyl, wl, xl.shape, layout="nchw", **kw)
    dw = smelt.conv2d_wgrad(dyl, xl, wl.shape, layout="nchw", **kw)
    assert dx.shape == xl.shape and dw.shape == wl.shape
    assert rel(dx, nchw(want_dx)) < REL[dtype] and rel(dw, nchw(want_dw)) < REL[dtype]


# ---- autograd


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("act", ["identity", "silu"])
def test_autograd_vs_torch(gen, device, case, act):
    """smelt.torch.conv2d's backward (smelt's dgrad and wgrad) against
    torch's autograd in float64, bias and c included."""
    dtype, kw, x, w = problem(gen, device, case)
    bias = randn(gen, (w.shape[0],), dtype, device)
    c = randn(gen, smelt.conv2d(x, w, **kw).shape, dtype, x.device)
    leaves = [t.requires_grad_() for t in (x, w, bias, c)]
    y = st.conv2d(x, w, bias, c, alpha=0.5, beta=2.0, activation=act, **kw)
    dy = randn(gen, y.shape, dtype, device)
    got = torch.autograd.grad(y, leaves, dy)
    xs = [t.detach().double().requires_grad_() for t in leaves]
    pre = 0.5 * nhwc(ref_conv(nchw(xs[0]), nchw(xs[1]), case)) + 2.0 * xs[3] + xs[2]
    want = torch.autograd.grad(F.silu(pre) if act == "silu" else pre, xs, dy.double())
    bound = REL[dtype] if dtype == torch.float32 else 3e-2  # bf16: dz is rounded before dgrad and wgrad
    for name, g, r in zip(("x", "w", "bias", "c"), got, want):
        assert g.shape == r.shape and g.dtype == dtype
        assert rel(g, r) < bound, "d%s: %g" % (name, rel(g, r))


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_nchw_sum(gen, device):
    """Through layout 'nchw' views, with y.sum()'s broadcast gradient (stride 0)."""
    case = CASES[5]
    dtype, kw, x, w = problem(gen, device, case)
    xl, wl = nchw(x).detach().requires_grad_(), nchw(w).detach().requires_grad_()
    st.conv2d(xl, wl, layout="nchw", **kw).sum().backward()
    xd, wd = xl.detach().double().requires_grad_(), wl.detach().double().requires_grad_()
    ref_conv(xd, wd, case).sum().backward()
    assert rel(xl.grad, xd.grad) < REL[dtype] and rel(wl.grad, wd.grad) < REL[dtype]


# ---- custom ops and torch.compile


def _opcheck_cases(device):
    g = torch.Generator().manual_seed(0)
    dt = torch.float32 if device == "cpu" else torch.bfloat16
    x = randn(g, (2, 6, 7, 3), dt, device).requires_grad_()
    w = randn(g, (4, 3, 3, 3), dt, device).requires_grad_()
    bias = randn(g, (4,), dt, device).requires_grad_()
    geom = [1, 1, 0, 2, 2, 1, 1, 1]
    y = torch.ops.smelt.conv2d(x.detach(), w.detach(), None, None, geom, 1.0, 0.0, "identity", 0.01, "default", None)
    c = randn(g, y.shape, dt, device).requires_grad_()
    dy = randn(g, y.shape, dt, device)
    return [
        (torch.ops.smelt.conv2d.default, (x, w, bias, None, geom, 1.0, 0.0, "relu", 0.01, "default", None)),
        (torch.ops.smelt.conv2d.default, (x, w, None, c, geom, 0.5, 1.0, "identity", 0.01, "default", None)),
        (torch.ops.smelt.conv2d_dgrad.default, (dy, w.detach(), None, list(x.shape), geom, 1.0, 0.0, "default", None)),
        (torch.ops.smelt.conv2d_wgrad.default, (dy, x.detach(), None, list(w.shape), geom, 1.0, 0.0, "default", None)),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_conv2d(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


def _block(x, w, bias):
    """A residual unit in NCHW: smelt.conv2d routes to torch.ops.smelt.conv2d under compile."""
    h = smelt.conv2d(x, w, bias, padding=1, activation="relu", layout="nchw")
    return smelt.conv2d(h, w, c=x, padding=1, layout="nchw")


@pytest.mark.parametrize("device", DEVICES)
def test_compile_no_graph_breaks(gen, device):
    device, dtype = params(device)
    x = randn(gen, (2, 8, 9, 8), dtype, device).permute(0, 3, 1, 2)  # NCHW, channels_last
    w = randn(gen, (8, 3, 3, 8), dtype, device).permute(0, 3, 1, 2)
    bias = randn(gen, (8,), dtype, device)
    ex = torch._dynamo.explain(_block)(x, w, bias)
    assert ex.graph_break_count == 0, ex.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(_block, fullgraph=True)
    assert torch.allclose(compiled(x, w, bias), _block(x, w, bias), rtol=1e-4 if dtype == torch.float32 else 2e-2,
                          atol=1e-4 if dtype == torch.float32 else 2e-2)


def _loss(x, w, bias):
    return st.conv2d(x, w, bias, stride=2, padding=1, activation="gelu").float().square().sum()


@pytest.mark.parametrize("device", DEVICES)
def test_compile_backward(gen, device):
    """The backward (dgrad and wgrad custom ops) traced by torch.compile too."""
    device, dtype = params(device)
    x, w = inputs(gen, CASES[0], dtype, device)
    bias = randn(gen, (w.shape[0],), dtype, device)
    leaves = [t.requires_grad_() for t in (x, w, bias)]
    want = torch.autograd.grad(_loss(*leaves), leaves)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(_loss, fullgraph=True)(*leaves), leaves)
    for g, r in zip(got, want):
        assert rel(g, r) < (1e-5 if dtype == torch.float32 else 2e-2)


# ---- bad arguments


def _problem():
    g = torch.Generator().manual_seed(1)
    x, w = randn(g, (2, 6, 7, 3)), randn(g, (4, 3, 3, 3))
    return x, w, randn(g, (2, 4, 5, 4))


def _bad_calls(f, dgrad, wgrad):
    """(what the message names, call) pairs; f, dgrad, wgrad are the
    smelt.* or smelt.torch.* functions."""
    x, w, dy = _problem()
    for bad in (3, None, [1.0, 2.0], "x"):
        yield "x", lambda bad=bad: f(bad, w)
        yield "w", lambda bad=bad: f(x, bad)
        yield "dy", lambda bad=bad: dgrad(bad, w, x.shape)
        yield "x", lambda bad=bad: wgrad(dy, bad, w.shape)
    yield "x", lambda: f(x[0], w)                                    # 3-D
    yield "C", lambda: f(x, w[..., :2])                              # channels differ
    yield "dtype", lambda: f(x.to(torch.int32), w.to(torch.int32))
    yield "dtype", lambda: f(x, w.half())                            # A and B of one dtype
    yield "dtype", lambda: f(x.double(), w.double())
    yield "bias", lambda: f(x, w, torch.zeros(5))
    yield "C", lambda: f(x, w, c=torch.zeros(2, 4, 4, 4))
    yield "larger", lambda: f(x, torch.zeros(4, 9, 3, 3))            # filter past the input
    yield "padding", lambda: f(x, w, padding=-1)
    yield "padding", lambda: f(x, w, padding=(1, 2, 3))
    yield "stride", lambda: f(x, w, stride=0)
    yield "dilation", lambda: f(x, w, dilation=1.5)
    yield "layout", lambda: f(x, w, layout="chwn")
    yield "activation", lambda: f(x, w, activation="swish")
    yield "math", lambda: f(x, w, math="fast")
    yield "x_shape", lambda: dgrad(dy, w, (2, 6, 7))
    yield "x_shape", lambda: dgrad(dy, w)
    yield "w_shape", lambda: wgrad(dy, x, 7)
    yield "w", lambda: dgrad(dy[..., :3], w, x.shape)                # K differs from w's
    yield "dy", lambda: wgrad(dy[:, :3], x, w.shape)                 # P differs from x's


@pytest.mark.parametrize("api", ["smelt", "smelt.torch"])
def test_bad_arguments_raise_smelt_errors(api):
    """Every bad call raises a smelt.Error (ValueError or TypeError) whose
    message names what is wrong; none leaks an AttributeError, IndexError or
    KeyError from inside."""
    mod = smelt if api == "smelt" else st
    for what, call in _bad_calls(mod.conv2d, mod.conv2d_dgrad, mod.conv2d_wgrad):
        with pytest.raises(Exception) as exc:
            call()
        assert isinstance(exc.value, smelt.Error), "%s: %r" % (what, exc.value)
        assert what.lower() in str(exc.value).lower(), "%s not in %r" % (what, str(exc.value))


@needs_cuda
def test_cuda_matches_cpu_reference(gen):
    """The GPU's result against the CPU reference on the same bf16 inputs,
    an odd stride-2 7x7 layer with C = 3 (the stem's shape, small)."""
    case = (2, 23, 19, 3, 16, 7, 7, 2, 3, 1)
    x, w = inputs(gen, case, torch.bfloat16, "cpu")
    bias = randn(gen, (16,), torch.bfloat16)
    kw = dict(stride=2, padding=3, activation="relu")
    cpu = smelt.conv2d(x, w, bias, **kw)
    gpu = smelt.conv2d(x.cuda(), w.cuda(), bias.cuda(), **kw)
    assert CUDA and gpu.device.type == "cuda"
    assert rel(gpu, cpu.double()) < 1e-2
