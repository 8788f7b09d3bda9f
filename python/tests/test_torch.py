"""The binding with torch: against torch's own ops, no copies, streams,
opcheck, autograd and torch.compile. CPU cases run wherever torch is
installed; CUDA cases need a GPU (and are what the GPU machine checks)."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402,F401  (registers torch.ops.smelt)
from torch_common import CUDA, DEVICES, needs_cuda, randn  # noqa: E402

F = torch.nn.functional

TORCH_ACT = {
    "identity": lambda t, s: t,
    "relu": lambda t, s: F.relu(t),
    "leaky_relu": lambda t, s: F.leaky_relu(t, s),
    "tanh": lambda t, s: torch.tanh(t),
    "sigmoid": lambda t, s: torch.sigmoid(t),
    "silu": lambda t, s: F.silu(t),
    "hardswish": lambda t, s: F.hardswish(t),
    "gelu": lambda t, s: F.gelu(t),
    "gelu_tanh": lambda t, s: F.gelu(t, approximate="tanh"),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Bounds on |smelt - ref| / (|ref| + 1), ref computed in float64 and rounded.
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(got, want, dtype):
    got64, want64 = got.double().cpu(), want.double().cpu()
    assert torch.equal(torch.isfinite(got64), torch.isfinite(want64))
    fin = torch.isfinite(want64)
    err = ((got64 - want64).abs() / (want64.abs() + 1))[fin]
    assert err.numel() == 0 or err.max().item() <= TOL[dtype], "max err %g" % err.max().item()


# ---- results against torch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", smelt.ACTIVATIONS)
def test_activation_vs_torch(gen, device, dtype, act):
    x = randn(gen, (33, 65), dtype, device, scale=4)
    y = smelt.activation(x, act, slope=0.2)
    assert isinstance(y, torch.Tensor) and y.device == x.device and y.dtype == dtype
    want = TORCH_ACT[act](x.double(), 0.2).to(dtype)
    assert_close(y, want, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_vs_torch(gen, device, dtype):
    x = randn(gen, (3, 17, 1000), dtype, device, scale=3)[:, 1:]  # odd, non-contiguous
    y, lse = smelt.softmax(x, return_lse=True)
    assert y.dtype == dtype and lse.dtype == torch.float32 and lse.shape == x.shape[:-1]
    assert_close(y, torch.softmax(x.double(), -1).to(dtype), dtype)
    assert_close(lse, torch.logsumexp(x.double(), -1).float(), torch.float32 if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 5, 64])
def test_topk_vs_torch(gen, device, dtype, k):
    x = randn(gen, (9, 300), dtype, device)
    v, i = smelt.topk(x, k)
    rv, _ = torch.topk(x.cpu().float(), k)  # torch's tie order is unspecified: compare values,
    assert torch.equal(v.cpu().float(), rv)  # and that the indices point at them
    assert torch.equal(torch.gather(x, -1, i), v)
    assert i.dtype == torch.int64
    v32, i32 = smelt.topk(x, k, index_dtype=torch.int32)
    assert i32.dtype == torch.int32 and torch.equal(i32.long(), i)


# ---- no copies, allocation by torch


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_written_in_place(gen, device):
    x = randn(gen, (8, 40), device=device)
    out = torch.empty_like(x)
    ptr = out.data_ptr()
    r = smelt.activation(x, "relu", out=out)
    assert r is out and out.data_ptr() == ptr
    assert torch.equal(out, F.relu(x))
    y, lse = torch.empty_like(x), torch.empty(8, device=device)
    r = smelt.softmax(x, out=y, lse=lse, return_lse=True)
    assert r[0] is y and r[1] is lse
    v, i = torch.empty(8, 3, device=device), torch.empty(8, 3, dtype=torch.int64, device=device)
    rv, ri = smelt.topk(x, 3, values=v, indices=i)
    assert rv is v and ri is i and v.data_ptr() == rv.data_ptr()
    # A view of a larger tensor: written through the view.
    big = torch.zeros(8, 80, device=device)
    smelt.activation(x, "identity", out=big[:, ::2])
    assert torch.equal(big[:, ::2], x) and not big[:, 1::2].any()


@pytest.mark.parametrize("device", DEVICES)
def test_errors_from_torch_tensors(device):
    x = torch.randn(4, 4, device=device)
    with pytest.raises(TypeError):
        smelt.activation(x.double())
    with pytest.raises(ValueError, match="shape"):
        smelt.activation(x, out=torch.empty(4, 5, device=device))


def test_generic_protocol_path_matches_fast_path(gen):
    """With the exchange API off, torch tensors go through __dlpack__."""
    x = randn(gen, (5, 7))
    out = torch.empty_like(x)
    prev = smelt._C._use_exchange_api(False)
    try:
        smelt.activation(x, "gelu", out=out)
    finally:
        smelt._C._use_exchange_api(prev)
    assert torch.equal(out, smelt.activation(x, "gelu"))


@pytest.mark.parametrize(
    "name,tdtype",
    [("f32", torch.float32), ("f16", torch.float16), ("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn),
     ("e5m2", torch.float8_e5m2), ("i8", torch.int8), ("i32", torch.int32), ("i64", torch.int64),
     ("u8", torch.uint8), ("bool", torch.bool), ("f64", torch.float64)],
)
def test_dtype_codes_both_ways(name, tdtype):
    """smelt.Tensor exports each dtype with the DLPack code torch reads back,
    and torch tensors of each dtype come in as that smelt dtype (the op's
    dtype error names what smelt saw)."""
    t = smelt.empty((2, 3), name, device="cpu")
    tt = torch.from_dlpack(t)
    assert tt.dtype == tdtype and tt.shape == (2, 3) and tt.data_ptr() == t.data_ptr
    if name in ("f32", "f16", "bf16"):
        return
    for fast in (True, False):
        prev = smelt._C._use_exchange_api(fast)
        try:
            with pytest.raises(TypeError, match=r"\b%s\b" % name):
                smelt.activation(torch.zeros(4, dtype=tdtype))
        finally:
            smelt._C._use_exchange_api(prev)


# ---- custom ops: opcheck, autograd, compile


def _opcheck_cases(device):
    g = torch.Generator().manual_seed(0)
    x = randn(g, (6, 37), device=device).requires_grad_()
    cases = [(torch.ops.smelt.activation.default, (x, act, 0.1)) for act in smelt.ACTIVATIONS]
    cases += [
        (torch.ops.smelt.activation_out.default, (x.detach(), torch.empty_like(x.detach()), "silu", 0.01)),
        (torch.ops.smelt.softmax.default, (x,)),
        (torch.ops.smelt.topk.default, (x, 4)),
        (torch.ops.smelt.topk.default, (x, 4, True)),
    ]
    return cases


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in _opcheck_cases(device):
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("act", smelt.ACTIVATIONS)
def test_activation_grad(gen, device, act):
    x = randn(gen, (5, 31), device=device, scale=3).requires_grad_()
    dy = randn(gen, (5, 31), device=device)
    (g,) = torch.autograd.grad(st.activation(x, act, 0.3), x, dy)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad(TORCH_ACT[act](xr, 0.3), xr, dy.double())
    assert_close(g, gr.float(), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_and_topk_grad(gen, device):
    x = randn(gen, (4, 50), device=device).requires_grad_()
    y, lse = st.softmax(x, return_lse=True)
    dy, dl = randn(gen, (4, 50), device=device), randn(gen, (4,), device=device)
    (g,) = torch.autograd.grad((y * dy).sum() + (lse * dl).sum(), x)
    xr = x.detach().double().requires_grad_()
    (gr,) = torch.autograd.grad((torch.softmax(xr, -1) * dy.double()).sum() + (torch.logsumexp(xr, -1) * dl.double()).sum(), xr)
    assert_close(g, gr.float(), torch.float32)
    v, i = st.topk(x, 3)
    (g,) = torch.autograd.grad(v.sum(), x)
    want = torch.zeros_like(x).scatter(-1, i, 1.0)
    assert torch.equal(g, want)


def _model(a):
    h = smelt.activation(a, "silu")  # the plain API routes to the custom ops under compile
    p, lse = smelt.softmax(h, return_lse=True)
    v, i = smelt.topk(p, 4)
    return v.sum(-1) + lse + torch.ops.smelt.activation(a, "gelu", 0.01).mean(-1)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_no_graph_breaks(gen, device):
    x = randn(gen, (16, 64), device=device)
    ex = torch._dynamo.explain(_model)(x)
    assert ex.graph_break_count == 0, ex.break_reasons
    assert ex.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True)
    assert torch.allclose(compiled(x), _model(x), atol=1e-5)


# ---- CUDA: streams and devices


@needs_cuda
def test_cuda_current_stream_is_honoured(gen):
    """Work queued behind a long sleep on a side stream: if smelt ran anywhere
    but that stream it would read x before the fill and the check would fail;
    an event recorded right after shows the call did not wait for it."""
    x = torch.empty(1 << 16, device="cuda")
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    ctx = smelt.default_context("cuda:0")
    with torch.cuda.stream(s):
        torch.cuda._sleep(50_000_000)
        x.fill_(2.0)
        smelt.activation(x, "relu", out=out)
        done = torch.cuda.Event()
        done.record(s)
        assert ctx.stream == s.cuda_stream
    assert not done.query(), "the call synchronized (or the sleep was too short)"
    s.synchronize()
    assert torch.equal(out, torch.full_like(x, 2.0))


@needs_cuda
def test_cuda_explicit_stream_argument(gen):
    x = randn(gen, (1000,), device="cuda")
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.cuda._sleep(20_000_000)
    smelt.activation(x, "tanh", out=out, stream=s)
    assert smelt.default_context("cuda").stream == s.cuda_stream
    torch.cuda.current_stream().wait_stream(s)
    assert_close(out, torch.tanh(x.double()).float(), torch.float32)
    smelt.activation(x, "tanh", out=out, stream=s.cuda_stream)  # a raw handle works too


@needs_cuda
def test_cuda_stream_without_exchange_api(gen):
    """The __dlpack__ road (torch < 2.10) also launches on torch's current stream."""
    x = randn(gen, (1000,), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    prev = smelt._C._use_exchange_api(False)
    try:
        with torch.cuda.stream(s):
            y = smelt.activation(x, "silu")
            assert smelt.default_context("cuda").stream == s.cuda_stream
            got = torch.from_dlpack(y).clone()
    finally:
        smelt._C._use_exchange_api(prev)
    s.synchronize()
    assert_close(got, F.silu(x.double()).float(), torch.float32)


@needs_cuda
def test_cuda_default_stream_is_the_legacy_one(gen):
    x = randn(gen, (100,), device="cuda")
    smelt.activation(x)
    assert smelt.default_context("cuda").stream == torch.cuda.current_stream().cuda_stream == 0


@needs_cuda
def test_cuda_smelt_tensor_to_torch(gen):
    t = smelt.empty((5, 6), "f32", device="cuda")
    tt = torch.from_dlpack(t)
    assert tt.device.type == "cuda" and tt.data_ptr() == t.data_ptr
    tt.copy_(randn(gen, (5, 6), device="cuda"))
    y = smelt.activation(t, "relu")  # smelt.Tensor in, smelt.Tensor out
    assert isinstance(y, smelt.Tensor)
    assert torch.equal(torch.from_dlpack(y), F.relu(tt))
    ctx = smelt.default_context("cuda")
    assert ctx.pool_stats()["used"] > 0
    ctx.synchronize()


@needs_cuda
def test_cuda_wrong_device(gen):
    x = randn(gen, (10,), device="cuda")
    with pytest.raises(RuntimeError):
        smelt.activation(x, ctx=smelt.default_context("cpu"))
    with pytest.raises(RuntimeError):
        smelt.activation(x, out=torch.empty(10))


@pytest.mark.skipif(not CUDA or torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_cuda_second_device(gen):
    x = randn(gen, (64,), device="cuda:1")
    y = smelt.activation(x, "gelu")
    assert y.device == x.device
    assert_close(y, F.gelu(x.double()).float(), torch.float32)


@needs_cuda
def test_cuda_cache_stats():
    st_ = smelt.default_context("cuda").cache_stats()
    assert st_["compiles"] + st_["disk_hits"] >= 1
