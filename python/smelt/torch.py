"""smelt's ops as torch custom ops: ``torch.ops.smelt.*``.

Importing this module (done automatically by ``import smelt`` when torch is
already imported, or on first use of a smelt op after torch is) registers:

    smelt::activation(Tensor x, str act="gelu", float slope=0.01) -> Tensor
    smelt::activation_out(Tensor x, Tensor(a!) out, str act="gelu", float slope=0.01) -> ()
    smelt::softmax(Tensor x) -> (Tensor y, Tensor lse)
    smelt::topk(Tensor x, SymInt k, bool int32_indices=False) -> (Tensor values, Tensor indices)
    smelt::gemm(Tensor a, Tensor b, Tensor? c, Tensor? bias, float alpha, float beta, str activation,
                float slope, str math, ScalarType? out_dtype) -> Tensor
    smelt::attention(Tensor q, Tensor k, Tensor v, bool causal, float? scale, int window_left,
                     int window_right) -> (Tensor o, Tensor lse)
    smelt::attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor d_o, Tensor lse, bool causal,
                              float? scale, int window_left, int window_right) -> (Tensor dq, Tensor dk, Tensor dv)

Each has a fake (meta) implementation, so torch.compile and torch.export
trace it without graph breaks, and the functional ones have autograd
formulas written in torch ops (activation: act'(x); softmax: the usual
y * (dy - sum(dy * y)) plus the logsumexp's gradient; topk: a scatter of the
values' gradient; gemm: the matmul formulas through act'(pre-activation),
recomputed with smelt; attention: smelt's own backward kernel, with the
convention of FlashAttention that lse carries no gradient). The functional ops mutate nothing; activation_out declares
its one mutation. Kernels run on torch's current stream with no copies.

The functions of this module mirror smelt.activation / softmax / topk and
are what those route to inside torch.compile.
"""

import math
import sys
from typing import Optional

import torch

import smelt as _smelt
from smelt import _smelt as _C

__all__ = ["activation", "attention", "gemm", "softmax", "topk"]

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

# ---- gemm


def _out_dtype_name(dt):
    return None if dt is None else _smelt._norm_dtype(dt)


@torch.library.custom_op("smelt::gemm", mutates_args=())
def _gemm(a: Tensor, b: Tensor, c: Optional[Tensor], bias: Optional[Tensor], alpha: float, beta: float,
          activation: str, slope: float, math: str, out_dtype: Optional[torch.dtype]) -> Tensor:
    d = a.new_empty(tuple(a.shape[:-1]) + tuple(b.shape[-1:]), dtype=out_dtype or a.dtype)
    _C.gemm(a, b, c, bias, d, alpha, beta, activation, slope, math, None, None, None)
    return d


@_gemm.register_fake
def _gemm_fake(a, b, c, bias, alpha, beta, activation, slope, math, out_dtype):
    torch._check(a.dim() in (2, 3) and b.dim() == a.dim(), lambda: "smelt.gemm: a, b must both be 2-D or 3-D")
    torch._check(a.shape[-1] == b.shape[-2], lambda: "smelt.gemm: a.shape[-1] must equal b.shape[-2]")
    _check_act(activation)
    return a.new_empty(tuple(a.shape[:-1]) + tuple(b.shape[-1:]), dtype=out_dtype or a.dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, c, bias, alpha, beta, act, slope, math, out_dtype = inputs
    ctx.save_for_backward(a, b, c, bias)
    ctx.params = (alpha, beta, act, slope, math)


def _gemm_backward(ctx, dd):
    a, b, c, bias = ctx.saved_tensors
    alpha, beta, act, slope, math = ctx.params
    if act == "identity":
        dz = dd
    else:  # recompute the pre-activation in f32 and apply act'(z)
        z = torch.ops.smelt.gemm(a, b, c, bias, alpha, beta, "identity", slope, math, torch.float32)
        dz = _act_grad(z, dd, act, slope)
    wide = torch.promote_types(a.dtype, torch.float32)
    g = dz.to(wide)
    da = db = dc = dbias = None
    if ctx.needs_input_grad[0]:
        da = (alpha * (g @ b.to(wide).transpose(-1, -2))).to(a.dtype)
    if ctx.needs_input_grad[1]:
        db = (alpha * (a.to(wide).transpose(-1, -2) @ g)).to(b.dtype)
    if c is not None and ctx.needs_input_grad[2]:
        dc = (beta * g).to(c.dtype)
    if bias is not None and ctx.needs_input_grad[3]:
        dbias = g.reshape(-1, g.shape[-1]).sum(0).to(bias.dtype)
    return da, db, dc, dbias, None, None, None, None, None, None


_gemm.register_autograd(_gemm_backward, setup_context=_gemm_setup)

# ---- attention


def _lse_shape(q):
    return (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("smelt::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], window_left: int,
               window_right: int) -> tuple[Tensor, Tensor]:
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32)
    _C.attention(q, k, v, o, lse, True, None, None, 0.0 if scale is None else scale, causal, window_left,
                 window_right, 0, 0, None, None)
    return o, lse


@_attention.register_fake
def _attention_fake(q, k, v, causal, scale, window_left, window_right):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "smelt.attention: q [B, Sq, H, D], k, v [B, Sk, Hk, D] must be 4-D")
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(_lse_shape(q), dtype=torch.float32)


@torch.library.custom_op("smelt::attention_backward", mutates_args=())
def _attention_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, d_o: Tensor, lse: Tensor, causal: bool,
                           scale: Optional[float], window_left: int,
                           window_right: int) -> tuple[Tensor, Tensor, Tensor]:
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    _C.attention_backward(q, k, v, o, d_o, lse, dq, dk, dv, None, None, 0.0 if scale is None else scale, causal,
                          window_left, window_right, 0, 0, None, None)
    return dq, dk, dv


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, o, d_o, lse, causal, scale, window_left, window_right):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format))


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, wl, wr = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.params = (causal, scale, wl, wr)


def _attention_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:  # only lse was used; lse carries no gradient (FlashAttention's convention)
        do = torch.zeros_like(o)
    do = do.contiguous()
    dq, dk, dv = torch.ops.smelt.attention_backward(q, k, v, o, do, lse, *ctx.params)
    return dq, dk, dv, None, None, None, None


_attention.register_autograd(_attention_backward, setup_context=_attention_setup)

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


def gemm(a, b, c=None, bias=None, out=None, alpha=1.0, beta=None, activation="identity", slope=0.01,
         math="default", out_dtype=None):
    """torch.ops.smelt.gemm; out is filled by copy. See smelt.gemm."""
    if beta is None:
        beta = 0.0 if c is None else 1.0
    if isinstance(out_dtype, str):
        out_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}[out_dtype]
    d = torch.ops.smelt.gemm(a, b, c, bias, float(alpha), float(beta), activation, float(slope), math, out_dtype)
    if out is not None:
        out.copy_(d)
        d = out
    return d


def attention(q, k, v, causal=False, scale=None, window=(-1, -1), return_lse=False, out=None, lse=None):
    """torch.ops.smelt.attention (differentiable); out/lse are filled by copy. See smelt.attention."""
    o, l = torch.ops.smelt.attention(q, k, v, bool(causal), None if scale is None else float(scale),
                                     int(window[0]), int(window[1]))
    if out is not None:
        out.copy_(o)
        o = out
    if lse is not None:
        lse.copy_(l)
        l = lse
    return (o, l) if return_lse else o


# Route smelt.* through these ops while torch.compile traces.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling
_smelt._torch_impl = sys.modules[__name__]
_smelt._is_compiling = _is_compiling
