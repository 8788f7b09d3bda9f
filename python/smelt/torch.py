"""smelt's ops as torch custom ops: ``torch.ops.smelt.*``.

Importing this module (done automatically by ``import smelt`` when torch is
already imported, or on first use of a smelt op after torch is) registers:

    smelt::activation(Tensor x, str act="gelu", float slope=0.01) -> Tensor
    smelt::activation_out(Tensor x, Tensor(a!) out, str act="gelu", float slope=0.01) -> ()
    smelt::softmax(Tensor x) -> (Tensor y, Tensor lse)
    smelt::topk(Tensor x, SymInt k, bool int32_indices=False) -> (Tensor values, Tensor indices)

Each has a fake (meta) implementation, so torch.compile and torch.export
trace it without graph breaks, and the functional ones have autograd
formulas written in torch ops (activation: act'(x); softmax: the usual
y * (dy - sum(dy * y)) plus the logsumexp's gradient; topk: a scatter of the
values' gradient). The functional ops mutate nothing; activation_out declares
its one mutation. Kernels run on torch's current stream with no copies.

The functions of this module mirror smelt.activation / softmax / topk and
are what those route to inside torch.compile.
"""

import math
import sys

import torch

import smelt as _smelt
from smelt import _smelt as _C

__all__ = ["activation", "softmax", "topk"]

Tensor = torch.Tensor
_ACTS = frozenset(_smelt.ACTIVATIONS)


def _check_act(act):
    if act not in _ACTS:
        raise ValueError("smelt.activation: act=%r is not one of %r" % (act, _smelt.ACTIVATIONS))


# ---- activation


@torch.library.custom_op("smelt::activation", mutates_args=())
def _activation(x: Tensor, act: str = "gelu", slope: float = 0.01) -> Tensor:
    y = torch.empty_like(x)
    _C.activation(x, y, act, slope, None, None)
    return y


@_activation.register_fake
def _activation_fake(x, act="gelu", slope=0.01):
    _check_act(act)
    return torch.empty_like(x)


@torch.library.custom_op("smelt::activation_out", mutates_args=("out",))
def _activation_out(x: Tensor, out: Tensor, act: str = "gelu", slope: float = 0.01) -> None:
    _C.activation(x, out, act, slope, None, None)


@_activation_out.register_fake
def _activation_out_fake(x, out, act="gelu", slope=0.01):
    _check_act(act)


_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _act_grad(x, dy, act, slope):
    """dL/dx = dy * act'(x), computed in float32 (or x's dtype when wider)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(wide)
    g = dy.to(wide)
    if act == "identity":
        d = torch.ones_like(xf)
    elif act == "relu":
        d = (xf > 0).to(wide)
    elif act == "leaky_relu":
        d = torch.where(xf > 0, torch.ones_like(xf), torch.full_like(xf, slope))
    elif act == "tanh":
        t = torch.tanh(xf)
        d = 1 - t * t
    elif act == "sigmoid":
        s = torch.sigmoid(xf)
        d = s * (1 - s)
    elif act == "silu":
        s = torch.sigmoid(xf)
        d = s * (1 + xf * (1 - s))
    elif act == "hardswish":  # torch's convention at the kinks
        d = torch.where(xf < -3, torch.zeros_like(xf), torch.where(xf <= 3, xf / 3 + 0.5, torch.ones_like(xf)))
    elif act == "gelu":
        cdf = 0.5 * (1 + torch.erf(xf / _SQRT_2))
        pdf = torch.exp(-0.5 * xf * xf) * _INV_SQRT_2PI
        d = cdf + xf * pdf
    elif act == "gelu_tanh":
        inner = _GELU_K * (xf + _GELU_C * xf * xf * xf)
        t = torch.tanh(inner)
        d = 0.5 * (1 + t) + 0.5 * xf * (1 - t * t) * _GELU_K * (1 + 3 * _GELU_C * xf * xf)
    else:
        raise ValueError("smelt.activation: no gradient for act=%r" % (act,))
    return (g * d).to(x.dtype)


def _activation_setup(ctx, inputs, output):
    x, act, slope = inputs
    ctx.save_for_backward(x)
    ctx.act = act
    ctx.slope = slope


def _activation_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return _act_grad(x, dy, ctx.act, ctx.slope), None, None


_activation.register_autograd(_activation_backward, setup_context=_activation_setup)

# ---- softmax


@torch.library.custom_op("smelt::softmax", mutates_args=())
def _softmax(x: Tensor) -> tuple[Tensor, Tensor]:
    y = torch.empty_like(x)
    lse = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _C.softmax(x, y, lse, False, None, None)
    return y, lse


@_softmax.register_fake
def _softmax_fake(x):
    torch._check(x.dim() >= 1, lambda: "smelt.softmax: x must have at least 1 dim")
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _softmax_setup(ctx, inputs, output):
    y, _ = output
    ctx.save_for_backward(y)


def _softmax_backward(ctx, dy, dlse):
    (y,) = ctx.saved_tensors
    wide = torch.promote_types(y.dtype, torch.float32)
    yf = y.to(wide)
    inner = torch.zeros_like(yf) if dy is None else dy.to(wide)
    inner = inner - (inner * yf).sum(-1, keepdim=True)
    if dlse is not None:  # d lse / dx = softmax(x)
        inner = inner + dlse.to(wide).unsqueeze(-1)
    return (yf * inner).to(y.dtype)


_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)

# ---- topk


@torch.library.custom_op("smelt::topk", mutates_args=())
def _topk(x: Tensor, k: int, int32_indices: bool = False) -> tuple[Tensor, Tensor]:
    shape = tuple(x.shape[:-1]) + (k,)
    values = x.new_empty(shape)
    indices = x.new_empty(shape, dtype=torch.int32 if int32_indices else torch.int64)
    _C.topk(x, k, values, indices, "int32" if int32_indices else "int64", None, None)
    return values, indices


@_topk.register_fake
def _topk_fake(x, k, int32_indices=False):
    torch._check(x.dim() >= 1, lambda: "smelt.topk: x must have at least 1 dim")
    torch._check(1 <= k, lambda: "smelt.topk: k must be >= 1")
    torch._check(k <= x.shape[-1], lambda: "smelt.topk: k must be <= x.shape[-1]")
    shape = tuple(x.shape[:-1]) + (k,)
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.int32 if int32_indices else torch.int64)


def _topk_setup(ctx, inputs, output):
    x, k, _ = inputs
    _, indices = output
    ctx.save_for_backward(indices)
    ctx.x_shape = x.shape


def _topk_backward(ctx, dvalues, dindices):
    (indices,) = ctx.saved_tensors
    dx = dvalues.new_zeros(ctx.x_shape)
    return dx.scatter(-1, indices.to(torch.int64), dvalues), None, None


_topk.register_autograd(_topk_backward, setup_context=_topk_setup)

# ---- the Python-facing functions (what smelt.* routes to under torch.compile)


def activation(x, act="gelu", slope=0.01, out=None):
    """torch.ops.smelt.activation (or activation_out when out is given). See smelt.activation."""
    if out is None:
        return torch.ops.smelt.activation(x, act, slope)
    torch.ops.smelt.activation_out(x, out, act, slope)
    return out


def softmax(x, out=None, lse=None, return_lse=False):
    """torch.ops.smelt.softmax; out/lse are filled by copy. See smelt.softmax."""
    y, l = torch.ops.smelt.softmax(x)
    if out is not None:
        out.copy_(y)
        y = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return (y, l) if return_lse else y


def topk(x, k, values=None, indices=None, index_dtype="int64"):
    """torch.ops.smelt.topk; values/indices are filled by copy. See smelt.topk."""
    int32 = index_dtype in ("int32", "i32") or index_dtype is torch.int32
    v, i = torch.ops.smelt.topk(x, k, int32)
    if values is not None:
        values.copy_(v)
        v = values
    if indices is not None:
        indices.copy_(i)
        i = indices
    elif index_dtype is None:
        i = None
    return v, i


# Route smelt.* through these ops while torch.compile traces.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling
_smelt._torch_impl = sys.modules[__name__]
_smelt._is_compiling = _is_compiling
