"""smelt.gemm_grouped with torch: against a per-group loop and
torch._grouped_mm, the op smelt::gemm_grouped (opcheck, torch.compile) and
its backward's clear error. CPU cases (f32, the reference backend) run
wherever torch is installed; bf16 cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402
from torch_common import DEVICES, needs_cuda, randn, rel  # noqa: E402

GROUPED_MM = hasattr(torch, "_grouped_mm")


def ref(a, b, offs, c=None, bias=None, alpha=1.0, beta=0.0):
    """float64, zero past the last offset; offs non-decreasing within [0, T]."""
    d = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        z = alpha * (a[start:end].double().cpu() @ b[g].double().cpu())
        if c is not None and beta != 0:
            z = z + beta * c[start:end].double().cpu()
        if bias is not None:
            z = z + bias[g].double().cpu()
        d[start:end] = z
        start = end
    return d


def case(gen, device, dtype, idt=torch.int32):
    t, k, n = 40, 32, 24
    a = randn(gen, (t, k), dtype, device)
    b = randn(gen, (5, n, k), dtype, device).transpose(1, 2)  # [G, K, N], K contiguous
    offs = torch.tensor([0, 8, 9, 9, 33], dtype=idt, device=device)  # empty, 1-row, rows past the last
    return a, b, offs


@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
def test_gemm_grouped_cpu(gen, idt):
    a, b, offs = case(gen, "cpu", torch.float32, idt)
    c = randn(gen, (a.shape[0], b.shape[2]))
    bias = randn(gen, (b.shape[0], b.shape[2]))
    want = ref(a, b, offs, c, bias, 0.5, 2.0)
    for d in (smelt.gemm_grouped(a, b, offs, c, bias, alpha=0.5, beta=2.0),
              st.gemm_grouped(a, b, offs, c, bias, alpha=0.5, beta=2.0)):
        assert d.shape == (40, 24) and d.dtype == torch.float32
        assert rel(d, want) < 1e-6
        assert not d[33:].any()


def test_gemm_grouped_out(gen):
    a, b, offs = case(gen, "cpu", torch.float32)
    for f in (smelt.gemm_grouped, st.gemm_grouped):
        out = torch.full((40, 24), 7.0)
        assert f(a, b, offs, out=out) is out
        assert (out[33:] == 7.0).all() and rel(out[:33], ref(a, b, offs)[:33]) < 1e-6


@pytest.mark.skipif(not GROUPED_MM, reason="torch has no _grouped_mm")
@pytest.mark.parametrize("device", DEVICES)
def test_gemm_grouped_vs_torch_grouped_mm(gen, device):
    dtype, where, bound = (torch.float32, "the CPU", 1e-6) if device == "cpu" else (torch.bfloat16, "this GPU", 1e-2)
    a, b, offs = case(gen, device, dtype)
    try:
        want = torch._grouped_mm(a, b, offs)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip("torch._grouped_mm on %s: %s" % (where, e))
    assert rel(smelt.gemm_grouped(a, b, offs)[:33], want[:33]) < bound


@needs_cuda
@pytest.mark.parametrize("idt", [torch.int32, torch.int64])
def test_gemm_grouped_cuda_bf16(gen, idt):
    a, b, offs = case(gen, "cuda", torch.bfloat16, idt)
    bias = randn(gen, (5, 24), torch.bfloat16, "cuda")
    d = smelt.gemm_grouped(a, b, offs, bias=bias)
    assert d.device.type == "cuda" and d.dtype == torch.bfloat16
    assert rel(d, ref(a, b, offs, bias=bias)) < 1e-2
    assert not d[33:].any()
    assert rel(st.gemm_grouped(a, b, offs, bias=bias), d) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_gemm_grouped(gen, device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    a, b, offs = case(gen, device, dtype)
    bias = randn(gen, (5, 24), dtype, device)
    c = randn(gen, (40, 24), dtype, device)
    torch.library.opcheck(torch.ops.smelt.gemm_grouped.default,
                          (a, b, offs, None, None, 1.0, 0.0, "identity", 0.01, "default"))
    torch.library.opcheck(torch.ops.smelt.gemm_grouped.default,
                          (a, b, offs, c, bias, 0.5, 2.0, "gelu", 0.01, "default"))


def test_gemm_grouped_compile(gen):
    a, b, offs = case(gen, "cpu", torch.float32)
    f = torch.compile(lambda a, b, offs: smelt.gemm_grouped(a, b, offs, activation="relu"), fullgraph=True)
    assert rel(f(a, b, offs), ref(a, b, offs).clamp_min(0)) < 1e-6


def test_gemm_grouped_backward_raises(gen):
    a, b, offs = case(gen, "cpu", torch.float32)
    a.requires_grad_()
    d = st.gemm_grouped(a, b, offs)
    with pytest.raises(NotImplementedError, match="no backward"):
        d.sum().backward()


def test_gemm_grouped_fake_checks():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        a, b = torch.empty(8, 4), torch.empty(3, 4, 5)
        with pytest.raises(RuntimeError, match="int32 or int64"):
            torch.ops.smelt.gemm_grouped(a, b, torch.empty(3), None, None, 1.0, 0.0, "identity", 0.01, "default")
        with pytest.raises(RuntimeError, match="offs.shape"):
            torch.ops.smelt.gemm_grouped(a, b, torch.empty(2, dtype=torch.int32), None, None, 1.0, 0.0, "identity",
                                         0.01, "default")


@needs_cuda
def test_gemm_grouped_stream_needs_out(gen):
    a, b, offs = case(gen, "cuda", torch.bfloat16)
    s = torch.cuda.Stream()
    with pytest.raises(smelt.ArgumentError, match="pass out="):
        smelt.gemm_grouped(a, b, offs, stream=s)
    out = torch.zeros(40, 24, device="cuda", dtype=torch.bfloat16)
    s.wait_stream(torch.cuda.current_stream())
    assert smelt.gemm_grouped(a, b, offs, out=out, stream=s) is out
    s.synchronize()
    assert rel(out, ref(a, b, offs)) < 1e-2
