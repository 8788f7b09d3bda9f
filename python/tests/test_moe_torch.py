"""smelt.torch.MoE and torch.ops.smelt.moe: the forward and every gradient
against a torch reference written here (softmax top-k routing with
renormalization, SwiGLU experts, autograd through both, the aux losses in
the objective), opcheck of the custom ops, torch.compile without graph
breaks. CPU cases (float64, the reference backend) run wherever torch is
installed; bf16 cases need a GPU."""

import pytest

torch = pytest.importorskip("torch")
import smelt  # noqa: E402
import smelt.torch as st  # noqa: E402
from torch_common import DEVICES, needs_cuda, randn, rel  # noqa: E402

F = torch.nn.functional


def ref_moe(x, wr, w1, w2, w3, k, aux_coeff=0.0, z_coeff=0.0):
    """The layer in torch ops, differentiable by autograd: y and the
    objective's aux part (load balance through the full softmax, counts
    constant; z-loss)."""
    T, E = x.shape[0], wr.shape[1]
    logits = (x.double() @ wr.double())
    p = torch.softmax(logits, -1)
    w, sel = torch.topk(p, k, -1)
    w = w / w.sum(-1, keepdim=True)
    y = torch.zeros_like(x, dtype=torch.float64)
    for e in range(E):
        t, i = (sel == e).nonzero(as_tuple=True)
        if t.numel():
            xe = x[t].double()
            h = F.silu(xe @ w1[e].double()) * (xe @ w3[e].double())
            y = y.index_add(0, t, w[t, i].unsqueeze(1) * (h @ w2[e].double()))
    count = torch.bincount(sel.flatten(), minlength=E).double()
    lb = aux_coeff * E / (k * T * T) * (count * p.sum(0)).sum()
    z = z_coeff * (torch.logsumexp(logits, -1) ** 2).mean()
    return y, lb + z


def params(gen, T, d, E, F_, dtype, device):
    x = randn(gen, (T, d), dtype, device)
    wr = randn(gen, (d, E), dtype, device, d ** -0.5)
    w1 = randn(gen, (E, d, F_), dtype, device, d ** -0.5)
    w3 = randn(gen, (E, d, F_), dtype, device, d ** -0.5)
    w2 = randn(gen, (E, F_, d), dtype, device, F_ ** -0.5)
    return [t.requires_grad_() for t in (x, wr, w1, w2, w3)]


def check(gen, dtype, device, T, bound):
    x, wr, w1, w2, w3 = params(gen, T, 16, 6, 12, dtype, device)
    dy = randn(gen, (T, 16), dtype, device)
    y, r = smelt.torch.moe(x, wr, w1, w2, w3, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001, return_routing=True)
    wide = torch.promote_types(dtype, torch.float32)  # f64 stays f64: dy rounded to f32 would be 3e-8 off
    (y.to(wide) * dy.to(wide)).sum().backward()
    got = [t.grad.clone() for t in (x, wr, w1, w2, w3)]
    for t in (x, wr, w1, w2, w3):
        t.grad = None
    ry, raux = ref_moe(x, wr, w1, w2, w3, 2, 0.01, 0.001)
    assert rel(y, ry) < bound
    assert rel(r["aux"].sum(), raux) < 1e-5
    ((ry * dy.double()).sum() + raux).backward()
    for t, g, n in zip((x, wr, w1, w2, w3), got, ("dx", "dwr", "dw1", "dw2", "dw3")):
        assert rel(g, t.grad) < bound, n


def test_moe_cpu_f64(gen):
    check(gen, torch.float64, "cpu", 11, 1e-10)


@needs_cuda
def test_moe_cuda_bf16(gen):
    check(gen, torch.bfloat16, "cuda", 37, 4e-2)


@needs_cuda
def test_moe_cuda_backward_repeats(gen):
    x, wr, w1, w2, w3 = params(gen, 33, 64, 8, 32, torch.bfloat16, "cuda")
    grads = []
    for _ in range(2):
        for t in (x, wr, w1, w2, w3):
            t.grad = None
        smelt.torch.moe(x, wr, w1, w2, w3, top_k=2, aux_loss_coeff=0.01).float().sum().backward()
        grads.append([t.grad.clone() for t in (x, wr, w1, w2, w3)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_moe_module(gen):
    m = st.MoE(8, 6, num_experts=4, top_k=2, dtype=torch.float64, aux_loss_coeff=0.01)
    x = randn(gen, (2, 5, 8), torch.float64).requires_grad_()
    y, aux, counts = m(x, return_aux=True)
    assert y.shape == x.shape and aux.shape == (2,) and int(counts.sum()) == 2 * 5 * 2
    y.sum().backward()
    assert all(p.grad is not None for p in (m.wr, m.w1, m.w2, m.w3)) and x.grad is not None
    assert "num_experts=4" in repr(m)


def test_moe_opcheck(gen):
    """The four ops' schemas and fakes: smelt::moe and its recomputing
    backward, smelt::moe_train and the backward from its saved state."""
    x, wr, w1, w2, w3 = (t.detach() for t in params(gen, 7, 8, 4, 6, torch.float64, "cpu"))
    cfg = smelt._moe_cfg(x, wr, w1, w3, 2, {"aux_loss_coeff": 0.01}, "test")
    icfg, fcfg = st._moe_cfg_split(cfg)
    ws = (wr, None, None, w1, w3, w2, None)
    dy, needs = torch.ones_like(x), [True] * 6 + [False]
    _, _, _, saved = torch.ops.smelt.moe_train(x, *ws, icfg, fcfg)
    assert saved.dtype == torch.uint8 and saved.numel() == 0  # the CPU keeps nothing
    for op, args in ((torch.ops.smelt.moe, (x, *ws, icfg, fcfg)), (torch.ops.smelt.moe_train, (x, *ws, icfg, fcfg)),
                     (torch.ops.smelt.moe_backward, (x, dy, *ws, icfg, fcfg, needs)),
                     (torch.ops.smelt.moe_backward_saved, (x, dy, saved, *ws, icfg, fcfg, needs))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("device", DEVICES)
def test_moe_train_matches_recompute(gen, device):
    """smelt.torch.moe with gradients runs smelt::moe_train (the forward
    keeps its state) and its backward from that state: the same y, aux and
    gradients, bit for bit, as smelt::moe's recomputing backward."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    x, wr, w1, w2, w3 = params(gen, 29, 32, 8, 48, dtype, device)
    dy = randn(gen, (29, 32), dtype, device)
    cfg = smelt._moe_cfg(x, wr, w1, w3, 2, {"aux_loss_coeff": 0.01, "z_loss_coeff": 0.001}, "test")
    icfg, fcfg = st._moe_cfg_split(cfg)
    y1, aux1, _ = torch.ops.smelt.moe(x, wr, None, None, w1, w3, w2, None, icfg, fcfg)
    g1 = torch.autograd.grad(y1, (x, wr, w1, w2, w3), dy)
    y2, r = smelt.torch.moe(x, wr, w1, w2, w3, top_k=2, aux_loss_coeff=0.01, z_loss_coeff=0.001,
                            return_routing=True)
    assert y2.grad_fn is not None and "moe_train" in type(y2.grad_fn).__name__
    g2 = torch.autograd.grad(y2, (x, wr, w1, w2, w3), dy)
    assert torch.equal(y1, y2) and torch.equal(aux1, r["aux"])
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


def test_moe_compile(gen):
    x, wr, w1, w2, w3 = (t.detach() for t in params(gen, 9, 8, 4, 6, torch.float64, "cpu"))

    def f(x):
        return smelt.moe(x, wr, w1, w2, w3, top_k=2) * 2

    want = f(x)
    got = torch.compile(f, fullgraph=True, backend="eager")(x)
    assert torch.equal(got, want)
