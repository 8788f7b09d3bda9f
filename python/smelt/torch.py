"""smelt's ops as torch custom ops: ``torch.ops.smelt.*``.

Importing this module (done automatically by ``import smelt`` when torch is
already imported, or on first use of a smelt op after torch is) registers:

    smelt::activation(Tensor x, str act="gelu", float slope=0.01) -> Tensor
    smelt::activation_out(Tensor x, Tensor(a!) out, str act="gelu", float slope=0.01) -> ()
    smelt::softmax(Tensor x) -> (Tensor y, Tensor lse)
    smelt::topk(Tensor x, SymInt k, bool int32_indices=False) -> (Tensor values, Tensor indices)
    smelt::gemm(Tensor a, Tensor b, Tensor? c, Tensor? bias, float alpha, float beta, str activation,
                float slope, str math, ScalarType? out_dtype) -> Tensor
    smelt::gemm_grouped(Tensor a, Tensor b, Tensor offs, Tensor? c, Tensor? bias, float alpha, float beta,
                        str activation, float slope, str math) -> Tensor   (no backward: see below)
    smelt::conv2d(Tensor x, Tensor w, Tensor? bias, Tensor? c, SymInt[] geometry, float alpha, float beta,
                  str activation, float slope, str math, ScalarType? out_dtype) -> Tensor      (NHWC)
    smelt::conv2d_dgrad(Tensor dy, Tensor b, Tensor? c, SymInt[] shape, SymInt[] geometry, float alpha,
                        float beta, str math, ScalarType? out_dtype) -> Tensor      (b: w; shape: x's)
    smelt::conv2d_wgrad(<the same>) -> Tensor                                        (b: x; shape: w's)
                  (geometry: pad_top, pad_bottom, pad_left, pad_right, stride_h, stride_w, dilation_h,
                  dilation_w)
    smelt::attention(Tensor q, Tensor k, Tensor v, bool causal, float? scale, int window_left,
                     int window_right, float softcap=0., Tensor? alibi_slopes=None, Tensor? sinks=None,
                     bool deterministic=False) -> (Tensor o, Tensor lse)
    smelt::attention_backward(Tensor q, Tensor k, Tensor v, Tensor o, Tensor d_o, Tensor lse, bool causal,
                              float? scale, int window_left, int window_right, float softcap=0.,
                              Tensor? alibi_slopes=None, Tensor? sinks=None, bool deterministic=False)
                              -> (Tensor dq, Tensor dk, Tensor dv, Tensor dsinks)   (dsinks [0] without sinks)
    smelt::attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k,
                            int max_seqlen_q, int max_seqlen_k, bool causal, float? scale, int window_left,
                            int window_right, <the modifiers and deterministic, as smelt::attention>)
                            -> (Tensor o, Tensor lse)
    smelt::attention_varlen_backward(q, k, v, o, d_o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, causal, scale, window_left, window_right, <the same>)
                                     -> (dq, dk, dv, dsinks)
    smelt::peer(Tensor x, Tensor wq, Tensor? bq, Tensor? norm_weight, Tensor? norm_bias, Tensor? bn_mean,
                Tensor? bn_var, Tensor sk0, Tensor sk1, Tensor? sk2, Tensor? sk3, Tensor u, Tensor v, int k,
                str activation, str query_norm, float norm_eps, float l2_eps, bool key_l2_norm,
                str gate, bool sparse_grad=False) -> (Tensor y, Tensor ids, Tensor scores)
    smelt::peer_backward(Tensor x, Tensor ids, Tensor dy, <the weights and options of smelt::peer>,
                         bool[] needs) -> (dx, dwq, dbq, dnorm_weight, dnorm_bias, dsk0..3, du, dv,
                                           grad_ids, grad_count, du_rows, dv_rows)
                         (one needs entry per output; empty tensors where it is false; the sparse
                         expert gradients untrimmed, [T·h·k, ...], du_rows and dv_rows zero from
                         row grad_count on, as the kernels write them)
    smelt::moe(Tensor x, Tensor wr, Tensor? expert_bias, Tensor? wnoise, Tensor w1, Tensor? w3, Tensor w2,
               Tensor? b1, int[] icfg, float[] fcfg) -> (Tensor y, Tensor aux, Tensor counts)
               (icfg, fcfg: smelt.moe's options as smelt.torch._moe_cfg_split packs them; aux [2] f32 the
               load-balance and z losses, counts [E] int64 the tokens each expert kept)
    smelt::moe_backward(Tensor x, Tensor dy, <the weights and cfg of smelt::moe>, bool[] needs)
                        -> (dx, dwr, dwnoise, dw1, dw3, dw2, db1)   (empty tensors where needs is false;
                        the forward recomputed from x)
    smelt::moe_train(<smelt::moe's arguments>) -> (y, aux, counts, Tensor saved)
               (smelt::moe that keeps the backward's state, saved [smelt_moe_saved_bytes] uint8: what
               smelt.torch.moe runs when a gradient will be asked for)
    smelt::moe_backward_saved(Tensor x, Tensor dy, Tensor saved, <the weights and cfg>, bool[] needs)
                        -> (dx, dwr, dwnoise, dw1, dw3, dw2, db1)   (from moe_train's state: no recomputation)
    smelt::bem_update, smelt::bem_backward: BEM's update and its gradients (see their block at the end),
               and the module smelt.torch.BEMLinear (a frozen nn.Linear plus a trainable BEM update)

the norms, the residual add and rotary of smelt.torch_norm (smelt::norm,
norm_backward, residual_add, rotary; see that module), and the modules
smelt.torch.PEER and smelt.torch.MoE, whose parameters train through
smelt's backward kernels.

Each has a fake (meta) implementation, so torch.compile and torch.export
trace it without graph breaks, and the functional ones have autograd
formulas written in torch ops (activation: act'(x); softmax: the usual
y * (dy - sum(dy * y)) plus the logsumexp's gradient; topk: a scatter of the
values' gradient; gemm: the matmul formulas through act'(pre-activation),
recomputed with smelt; conv2d: smelt's dgrad and wgrad of act'(pre-activation)
times the gradient, the pre-activation recomputed with smelt as gemm's,
bias and c by sums (gemm_grouped has none: its backward raises, since
the weights' gradient A_gᵀ·dD_g per group is not a grouped GEMM by row
offsets, issue 4); attention: smelt's own backward kernel, with the
convention of FlashAttention that lse carries no gradient, sinks getting
theirs (the ALiBi slopes none), deterministic=True asking for the bitwise
repeatable backward; peer: smelt's
PEER backward, the selection itself not differentiated, u and v's gradients
sparse COO tensors with sparse_grad, as torch.embedding's sparse=True). The
functional ops mutate nothing; activation_out declares its one mutation.
Kernels run on torch's current stream with no copies.

The functions of this module mirror smelt.activation / softmax / topk and
are what those route to inside torch.compile.
"""

import math
import sys
from typing import Optional

import torch

import smelt as _smelt
from smelt import _smelt as _C

__all__ = ["MoE", "PEER", "activation", "attention", "attention_varlen", "conv2d", "conv2d_dgrad", "conv2d_wgrad",
           "gemm", "gemm_grouped", "moe", "peer", "softmax", "topk"]

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
    _C.gemm(a, b, c, bias, d, alpha, beta, activation, slope, math, None, None, None, None, None, 0)
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

# ---- gemm_grouped


@torch.library.custom_op("smelt::gemm_grouped", mutates_args=())
def _gemm_grouped(a: Tensor, b: Tensor, offs: Tensor, c: Optional[Tensor], bias: Optional[Tensor], alpha: float,
                  beta: float, activation: str, slope: float, math: str) -> Tensor:
    # Zero-filled: rows at or past offs[-1] are not written by the kernel.
    d = a.new_zeros((a.shape[0], b.shape[-1]))
    _C.gemm_grouped(a, b, offs, c, bias, d, alpha, beta, activation, slope, math, None, None, None, None, 0)
    return d


@_gemm_grouped.register_fake
def _gemm_grouped_fake(a, b, offs, c, bias, alpha, beta, activation, slope, math):
    torch._check(a.dim() == 2 and b.dim() == 3 and offs.dim() == 1,
                 lambda: "smelt.gemm_grouped: a must be 2-D [T, K], b 3-D [G, K, N], offs 1-D [G]")
    torch._check(a.shape[1] == b.shape[1], lambda: "smelt.gemm_grouped: a.shape[1] must equal b.shape[1]")
    torch._check(offs.shape[0] == b.shape[0], lambda: "smelt.gemm_grouped: offs.shape[0] must equal b.shape[0]")
    torch._check(offs.dtype in (torch.int32, torch.int64), lambda: "smelt.gemm_grouped: offs must be int32 or int64")
    _check_act(activation)
    return a.new_empty((a.shape[0], b.shape[-1]))


def _gemm_grouped_setup(ctx, inputs, output):
    pass


def _gemm_grouped_backward(ctx, dd):
    raise NotImplementedError(
        "smelt.gemm_grouped has no backward: the gradient of b (A_g^T dD_g per group) is not a grouped GEMM by "
        "row offsets (issue 4); use torch._grouped_mm or a per-group loop to train through it")


_gemm_grouped.register_autograd(_gemm_grouped_backward, setup_context=_gemm_grouped_setup)

# ---- conv2d (NHWC; the functions below take NCHW through views)


def _conv_out_shape(x, w, geometry):
    """[N, P, Q, K] of fprop (smelt/conv2d.h); smelt checks the rest."""
    ph0, ph1, pw0, pw1, sh, sw, dh, dw = geometry
    p = (x.shape[1] + ph0 + ph1 - dh * (w.shape[1] - 1) - 1) // sh + 1
    q = (x.shape[2] + pw0 + pw1 - dw * (w.shape[2] - 1) - 1) // sw + 1
    return (x.shape[0], p, q, w.shape[0])


@torch.library.custom_op("smelt::conv2d", mutates_args=())
def _conv2d(x: Tensor, w: Tensor, bias: Optional[Tensor], c: Optional[Tensor], geometry: list[int], alpha: float,
            beta: float, activation: str, slope: float, math: str, out_dtype: Optional[torch.dtype]) -> Tensor:
    # A shape torch cannot allocate is smelt's error to name.
    n, p, q, k = _conv_out_shape(x, w, geometry) if x.dim() == 4 and w.dim() == 4 else (0, 0, 0, 0)
    y = x.new_empty((max(n, 0), max(p, 0), max(q, 0), max(k, 0)), dtype=out_dtype or x.dtype)
    _C.conv2d(0, x, w, c, bias, y, None, tuple(geometry), alpha, beta, activation, slope, math, None, None, None)
    return y


@_conv2d.register_fake
def _conv2d_fake(x, w, bias, c, geometry, alpha, beta, activation, slope, math, out_dtype):
    torch._check(x.dim() == 4 and w.dim() == 4, lambda: "smelt.conv2d: x [N, H, W, C] and w [K, R, S, C] must be 4-D")
    torch._check(x.shape[3] == w.shape[3], lambda: "smelt.conv2d: x.shape[3] (C) must equal w.shape[3]")
    _check_act(activation)
    n, p, q, k = _conv_out_shape(x, w, geometry)
    torch._check(p >= 1 and q >= 1, lambda: "smelt.conv2d: the dilated filter is larger than the padded input")
    return x.new_empty((n, p, q, k), dtype=out_dtype or x.dtype)


def _conv_grad_custom_op(kind, name):
    """smelt::conv2d_dgrad (kind 1: b is w, shape x's) or smelt::conv2d_wgrad
    (kind 2: b is x, shape w's), with its fake kernel."""

    @torch.library.custom_op("smelt::" + name, mutates_args=())
    def op(dy: Tensor, b: Tensor, c: Optional[Tensor], shape: list[int], geometry: list[int], alpha: float,
           beta: float, math: str, out_dtype: Optional[torch.dtype]) -> Tensor:
        d = dy.new_empty(tuple(shape), dtype=out_dtype or dy.dtype)
        _C.conv2d(kind, dy, b, c, None, d, None, tuple(geometry), alpha, beta, "identity", 0.01, math, None, None,
                  None)
        return d

    @op.register_fake
    def _fake(dy, b, c, shape, geometry, alpha, beta, math, out_dtype):
        torch._check(dy.dim() == 4 and b.dim() == 4 and len(shape) == 4,
                     lambda: "smelt.%s: dy, b and the shape must be 4-D" % name)
        return dy.new_empty(tuple(shape), dtype=out_dtype or dy.dtype)

    return op


_conv2d_dgrad = _conv_grad_custom_op(1, "conv2d_dgrad")
_conv2d_wgrad = _conv_grad_custom_op(2, "conv2d_wgrad")


def _conv2d_setup(ctx, inputs, output):
    x, w, bias, c, geometry, alpha, beta, act, slope, math, out_dtype = inputs
    ctx.save_for_backward(x, w, bias, c)
    ctx.params = (list(geometry), alpha, beta, act, slope, math)


def _conv2d_backward(ctx, dy):
    x, w, bias, c = ctx.saved_tensors
    geometry, alpha, beta, act, slope, math = ctx.params
    if act == "identity":
        dz = dy
    else:  # recompute the pre-activation in f32 (or f64) and apply act'(z), as gemm's backward
        # conv2d takes c of the output's dtype only.
        wide = torch.promote_types(x.dtype, torch.float32)
        cw = None if c is None else c.to(wide)
        z = torch.ops.smelt.conv2d(x, w, bias, cw, geometry, alpha, beta, "identity", slope, math, wide)
        dz = _act_grad(z, dy, act, slope)
    # dgrad and wgrad read dz with the other operand's dtype (A and B of one dtype).
    g = dz.to(x.dtype)
    dx = dw = dbias = dc = None
    if ctx.needs_input_grad[0]:
        dx = torch.ops.smelt.conv2d_dgrad(g, w, None, list(x.shape), geometry, alpha, 0.0, math, x.dtype)
    if ctx.needs_input_grad[1]:
        dw = torch.ops.smelt.conv2d_wgrad(g, x, None, list(w.shape), geometry, alpha, 0.0, math, w.dtype)
    wide = torch.promote_types(dz.dtype, torch.float32)
    if bias is not None and ctx.needs_input_grad[2]:
        dbias = dz.to(wide).sum((0, 1, 2)).to(bias.dtype)
    if c is not None and ctx.needs_input_grad[3]:
        dc = (beta * dz.to(wide)).to(c.dtype)
    return dx, dw, dbias, dc, None, None, None, None, None, None, None


_conv2d.register_autograd(_conv2d_backward, setup_context=_conv2d_setup)

# ---- attention


def _lse_shape(q):
    return (q.shape[0], q.shape[2], q.shape[1])


@torch.library.custom_op("smelt::attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float], window_left: int,
               window_right: int, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
               sinks: Optional[Tensor] = None, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty(_lse_shape(q), dtype=torch.float32)
    _C.attention(q, k, v, o, lse, True, None, None, 0.0 if scale is None else scale, causal, window_left,
                 window_right, 0, 0, None, None, softcap, alibi_slopes, sinks)
    return o, lse


@_attention.register_fake
def _attention_fake(q, k, v, causal, scale, window_left, window_right, softcap=0.0, alibi_slopes=None, sinks=None,
                    deterministic=False):
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4,
                 lambda: "smelt.attention: q [B, Sq, H, D], k, v [B, Sk, Hk, D] must be 4-D")
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(_lse_shape(q), dtype=torch.float32)


def _grads_like(q, k, v, sinks):
    """dq, dk, dv (contiguous) and dsinks ([0] without sinks)."""
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format),
            q.new_empty(sinks.shape if sinks is not None else (0,), dtype=torch.float32))


@torch.library.custom_op("smelt::attention_backward", mutates_args=())
def _attention_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, d_o: Tensor, lse: Tensor, causal: bool,
                           scale: Optional[float], window_left: int, window_right: int, softcap: float = 0.0,
                           alibi_slopes: Optional[Tensor] = None, sinks: Optional[Tensor] = None,
                           deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, ds = _grads_like(q, k, v, sinks)
    _C.attention_backward(q, k, v, o, d_o, lse, dq, dk, dv, None, None, 0.0 if scale is None else scale, causal,
                          window_left, window_right, 0, 0, None, None, softcap, deterministic, alibi_slopes, sinks,
                          ds if sinks is not None else None)
    return dq, dk, dv, ds


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, o, d_o, lse, causal, scale, window_left, window_right, softcap=0.0,
                             alibi_slopes=None, sinks=None, deterministic=False):
    return _grads_like(q, k, v, sinks)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale, wl, wr, softcap, alibi, sinks, det = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, alibi, sinks)
    ctx.params = (causal, scale, wl, wr, softcap)
    ctx.det = det


def _attention_backward(ctx, do, dlse):
    q, k, v, o, lse, alibi, sinks = ctx.saved_tensors
    if do is None:  # only lse was used; lse carries no gradient (FlashAttention's convention)
        do = torch.zeros_like(o)
    do = do.contiguous()
    dq, dk, dv, ds = torch.ops.smelt.attention_backward(q, k, v, o, do, lse, *ctx.params, alibi, sinks, ctx.det)
    return dq, dk, dv, None, None, None, None, None, None, ds if sinks is not None else None, None


_attention.register_autograd(_attention_backward, setup_context=_attention_setup)

# ---- attention over packed sequences


@torch.library.custom_op("smelt::attention_varlen", mutates_args=())
def _attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, causal: bool, scale: Optional[float], window_left: int,
                      window_right: int, softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                      sinks: Optional[Tensor] = None, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    _C.attention(q, k, v, o, lse, True, cu_seqlens_q, cu_seqlens_k, 0.0 if scale is None else scale, causal,
                 window_left, window_right, max_seqlen_q, max_seqlen_k, None, None, softcap, alibi_slopes, sinks)
    return o, lse


@_attention_varlen.register_fake
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                           window_left, window_right, softcap=0.0, alibi_slopes=None, sinks=None,
                           deterministic=False):
    torch._check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3,
                 lambda: "smelt.attention_varlen: q [Tq, H, D], k, v [Tk, Hk, D] must be 3-D")
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


@torch.library.custom_op("smelt::attention_varlen_backward", mutates_args=())
def _attention_varlen_backward_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, d_o: Tensor, lse: Tensor,
                                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                  causal: bool, scale: Optional[float], window_left: int, window_right: int,
                                  softcap: float = 0.0, alibi_slopes: Optional[Tensor] = None,
                                  sinks: Optional[Tensor] = None,
                                  deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dq, dk, dv, ds = _grads_like(q, k, v, sinks)
    _C.attention_backward(q, k, v, o, d_o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                          0.0 if scale is None else scale, causal, window_left, window_right, max_seqlen_q,
                          max_seqlen_k, None, None, softcap, deterministic, alibi_slopes, sinks,
                          ds if sinks is not None else None)
    return dq, dk, dv, ds


@_attention_varlen_backward_op.register_fake
def _attention_varlen_backward_fake(q, k, v, o, d_o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                    causal, scale, window_left, window_right, softcap=0.0, alibi_slopes=None,
                                    sinks=None, deterministic=False):
    return _grads_like(q, k, v, sinks)


def _attention_varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, softcap, alibi, sinks, det = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k, alibi, sinks)
    ctx.params = (max_q, max_k, causal, scale, wl, wr, softcap)
    ctx.det = det


def _attention_varlen_backward(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k, alibi, sinks = ctx.saved_tensors
    if do is None:  # only lse was used; lse carries no gradient (FlashAttention's convention)
        do = torch.zeros_like(o)
    do = do.contiguous()
    dq, dk, dv, ds = torch.ops.smelt.attention_varlen_backward(q, k, v, o, do, lse, cu_q, cu_k, *ctx.params, alibi,
                                                               sinks, ctx.det)
    return (dq, dk, dv, None, None, None, None, None, None, None, None, None, None, ds if sinks is not None else None,
            None)


_attention_varlen.register_autograd(_attention_varlen_backward, setup_context=_attention_varlen_setup)

# ---- PEER


def _sub_keys(sk0, sk1, sk2, sk3):
    return tuple(t for t in (sk0, sk1, sk2, sk3) if t is not None)


def _peer_heads(wq, sub_keys):
    dq = len(sub_keys) * sub_keys[0].shape[-1]
    return sub_keys[0].shape[0] if sub_keys[0].dim() == 3 else wq.shape[1] // dq


@torch.library.custom_op("smelt::peer", mutates_args=())
def _peer(x: Tensor, wq: Tensor, bq: Optional[Tensor], norm_weight: Optional[Tensor], norm_bias: Optional[Tensor],
          bn_mean: Optional[Tensor], bn_var: Optional[Tensor], sk0: Tensor, sk1: Tensor, sk2: Optional[Tensor],
          sk3: Optional[Tensor], u: Tensor, v: Tensor, k: int, activation: str, query_norm: str, norm_eps: float,
          l2_eps: float, key_l2_norm: bool, gate: str, sparse_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    # sparse_grad only shapes the backward (as torch.embedding's sparse does).
    sub_keys = _sub_keys(sk0, sk1, sk2, sk3)
    cfg = _smelt._peer_cfg(x, wq, sub_keys, u, v, k, activation, query_norm, gate, key_l2_norm, norm_eps, l2_eps)
    sel = (x.shape[0], cfg["num_heads"], k)
    y = x.new_empty((x.shape[0], v.shape[-1]))
    ids = x.new_empty(sel, dtype=torch.int64)
    scores = x.new_empty(sel, dtype=torch.float32)
    w = _smelt._peer_weights(wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_keys, u, v)
    _C.peer(1, cfg, x, w, (), (y, ids, scores), None, None)
    return y, ids, scores


@_peer.register_fake
def _peer_fake(x, wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sk0, sk1, sk2, sk3, u, v, k, activation,
               query_norm, norm_eps, l2_eps, key_l2_norm, gate, sparse_grad=False):
    torch._check(x.dim() == 2, lambda: "smelt.peer: x must be 2-D [T, input_dim]")
    sel = (x.shape[0], _peer_heads(wq, _sub_keys(sk0, sk1, sk2, sk3)), k)
    return (x.new_empty((x.shape[0], v.shape[-1])), x.new_empty(sel, dtype=torch.int64),
            x.new_empty(sel, dtype=torch.float32))


# Gradient order of smelt::peer_backward and the smelt::peer input each belongs to.
_PEER_GRAD_INPUTS = (0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12)


@torch.library.custom_op("smelt::peer_backward", mutates_args=())
def _peer_backward_op(x: Tensor, ids: Tensor, dy: Tensor, wq: Tensor, bq: Optional[Tensor],
                      norm_weight: Optional[Tensor], norm_bias: Optional[Tensor], bn_mean: Optional[Tensor],
                      bn_var: Optional[Tensor], sk0: Tensor, sk1: Tensor, sk2: Optional[Tensor], sk3: Optional[Tensor],
                      u: Tensor, v: Tensor, k: int, activation: str, query_norm: str, norm_eps: float, l2_eps: float,
                      key_l2_norm: bool, gate: str, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                               Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                               Tensor, Tensor, Tensor, Tensor, Tensor]:
    sub_keys = _sub_keys(sk0, sk1, sk2, sk3)
    cfg = _smelt._peer_cfg(x, wq, sub_keys, u, v, k, activation, query_norm, gate, key_l2_norm, norm_eps, l2_eps)
    outs = _peer_backward_outs(x, ids, wq, bq, norm_weight, norm_bias, sk0, sk1, sk2, sk3, u, v, needs)
    w = _smelt._peer_weights(wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_keys, u, v)
    _C.peer(2, cfg, x, w, (ids, dy), tuple(outs), None, None)
    return tuple(x.new_empty(0) if o is None else o for o in outs)


def _peer_backward_outs(x, ids, wq, bq, norm_weight, norm_bias, sk0, sk1, sk2, sk3, u, v, needs):
    """smelt::peer_backward's outputs (None where not needed): the dense
    gradients like what they differentiate, then the sparse expert
    gradients with one entry or row per use of an expert, untrimmed so that
    every shape is static (the kernels write zeros from row grad_count on,
    so the op gives the same result every time)."""
    torch._check(len(needs) == 15, lambda: "smelt.peer_backward: needs must have one entry per output (15)")
    like = (x, wq, bq, norm_weight, norm_bias, sk0, sk1, sk2, sk3, u, v)
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) if need and t is not None else None
            for t, need in zip(like, needs)]
    n = ids.numel()
    return outs + [ids.new_empty(n) if needs[11] else None, ids.new_empty(1) if needs[12] else None,
                   u.new_empty((n,) + tuple(u.shape[1:])) if needs[13] else None,
                   v.new_empty((n,) + tuple(v.shape[1:])) if needs[14] else None]


@_peer_backward_op.register_fake
def _peer_backward_fake(x, ids, dy, wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sk0, sk1, sk2, sk3, u, v, k,
                        activation, query_norm, norm_eps, l2_eps, key_l2_norm, gate, needs):
    outs = _peer_backward_outs(x, ids, wq, bq, norm_weight, norm_bias, sk0, sk1, sk2, sk3, u, v, needs)
    return tuple(x.new_empty(0) if o is None else o for o in outs)


def _peer_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:13], output[1])
    ctx.params = tuple(inputs[13:20])
    ctx.sparse_grad = inputs[20]


def _peer_backward(ctx, dy, dids, dscores):
    *saved, ids = ctx.saved_tensors
    x, wq, bq, nw, nb, bm, bv, sk0, sk1, sk2, sk3, u, v = saved
    needs = [bool(ctx.needs_input_grad[i]) and saved[i] is not None for i in _PEER_GRAD_INPUTS]
    grads = [None] * 21
    if not any(needs):
        return tuple(grads)
    rows = [ctx.sparse_grad and need for need in needs[9:]]  # u's and v's as rows instead of dense tables
    if ctx.sparse_grad:
        needs[9:] = [False, False]
    dy = torch.zeros((x.shape[0], v.shape[-1]), dtype=x.dtype, device=x.device) if dy is None else dy.contiguous()
    got = torch.ops.smelt.peer_backward(x, ids, dy, wq, bq, nw, nb, bm, bv, sk0, sk1, sk2, sk3, u, v, *ctx.params,
                                        needs + [any(rows)] * 2 + rows)
    for j, i in enumerate(_PEER_GRAD_INPUTS):
        if needs[j]:
            grads[i] = got[j]
    if any(rows):
        # The op's outputs are dense and untrimmed, shaped by its inputs
        # alone as fake tensors need (a sparse output would have a
        # data-dependent nnz), so the sparse COO gradients are made here
        # from the first M rows. Reading M waits for the device (under
        # torch.compile it is an unbacked size). The ids are valid, distinct
        # and ascending: coalesced as made, nothing to check.
        m = got[12].item()
        torch._check(m >= 0)  # a size within the rows: what torch.compile needs to slice by it
        torch._check(m <= ids.numel())
        index = got[11][:m].unsqueeze(0)
        for j, i, t, need in ((13, 11, u, rows[0]), (14, 12, v, rows[1])):
            if need:
                grads[i] = torch.sparse_coo_tensor(index, got[j][:m], t.shape, is_coalesced=True,
                                                   check_invariants=False)
    return tuple(grads)


_peer.register_autograd(_peer_backward, setup_context=_peer_setup)


class PEER(torch.nn.Module):
    """A PEER layer (He 2024, "Mixture of A Million Experts") on smelt's
    fused kernels: y = Σ_h Σ_{e ∈ top-k} g_e · act(x · u[e]) · v[e], with the
    experts of each head retrieved by product keys.

    Parameters (all trained through smelt's backward):
        wq [input_dim, num_heads · query_dim], bq [num_heads · query_dim] (query_bias)
        sub_keys[i] [n_i, query_dim / p], or [num_heads, n_i, query_dim / p] with per_head_keys
        u [num_experts, input_dim, expert_hidden_size], v [num_experts, expert_hidden_size, output_dim]
        norm_weight, norm_bias [query_dim] (query_norm 'layernorm' or 'batchnorm')
    Buffers: bn_mean, bn_var [query_dim] (query_norm 'batchnorm': inference-
    style normalization with these running statistics, which the layer does
    not update).

    sub_key_sizes defaults to num_experts^(1/p) each (a whole number). x is
    [..., input_dim]; the result [..., output_dim] has x's dtype. u and v
    get dense gradients (rows of unused experts are zero), or with
    sparse_grad sparse COO ones holding only the rows of the experts used,
    as torch.nn.Embedding(sparse=True): train them with an optimizer that
    takes sparse gradients (torch.optim.SGD, SparseAdam, Adagrad). Each row
    is bit-identical to the dense gradient's; making them waits for the
    device once per backward (to read how many experts were used).
    """

    def __init__(self, input_dim, output_dim, num_experts, num_experts_per_tok=16, num_heads=8,
                 expert_hidden_size=1, query_dim=256, product_key_dims=2, sub_key_sizes=None, activation="gelu",
                 query_norm="none", norm_eps=1e-5, l2_eps=1e-12, key_l2_norm=False, per_head_keys=False,
                 gate="softmax", query_bias=True, sparse_grad=False, device=None, dtype=None):
        super().__init__()
        p = int(product_key_dims)
        if not 2 <= p <= 4 or query_dim % p:
            raise ValueError("smelt.torch.PEER: product_key_dims=%r must be 2..4 and divide query_dim=%r"
                             % (product_key_dims, query_dim))
        if sub_key_sizes is None:
            n = round(num_experts ** (1.0 / p))
            if n ** p != num_experts:
                raise ValueError("smelt.torch.PEER: num_experts=%d is not a whole number to the power %d; give "
                                 "sub_key_sizes" % (num_experts, p))
            sub_key_sizes = [n] * p
        if len(sub_key_sizes) != p or math.prod(sub_key_sizes) != num_experts:
            raise ValueError("smelt.torch.PEER: sub_key_sizes=%r must be %d sizes whose product is num_experts=%d"
                             % (sub_key_sizes, p, num_experts))
        if query_norm not in ("none", "layernorm", "batchnorm", "l2"):
            raise ValueError("smelt.torch.PEER: query_norm=%r is not 'none', 'layernorm', 'batchnorm' or 'l2'"
                             % (query_norm,))
        f = {"device": device, "dtype": dtype}
        self.input_dim, self.output_dim, self.num_experts = input_dim, output_dim, num_experts
        self.k, self.num_heads, self.query_dim = num_experts_per_tok, num_heads, query_dim
        self.activation, self.query_norm, self.gate = activation, query_norm, gate
        self.norm_eps, self.l2_eps, self.key_l2_norm = float(norm_eps), float(l2_eps), bool(key_l2_norm)
        self.sparse_grad = bool(sparse_grad)
        self.wq = torch.nn.Parameter(torch.empty(input_dim, num_heads * query_dim, **f))
        self.bq = torch.nn.Parameter(torch.empty(num_heads * query_dim, **f)) if query_bias else None
        lead = (num_heads,) if per_head_keys else ()
        self.sub_keys = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.empty(*lead, n, query_dim // p, **f)) for n in sub_key_sizes])
        self.u = torch.nn.Parameter(torch.empty(num_experts, input_dim, expert_hidden_size, **f))
        self.v = torch.nn.Parameter(torch.empty(num_experts, expert_hidden_size, output_dim, **f))
        affine = query_norm in ("layernorm", "batchnorm")
        self.norm_weight = torch.nn.Parameter(torch.empty(query_dim, **f)) if affine else None
        self.norm_bias = torch.nn.Parameter(torch.empty(query_dim, **f)) if affine else None
        if query_norm == "batchnorm":
            self.register_buffer("bn_mean", torch.zeros(query_dim, **f))
            self.register_buffer("bn_var", torch.ones(query_dim, **f))
        else:
            self.bn_mean = self.bn_var = None
        self.reset_parameters()

    def reset_parameters(self):
        """wq and bq as torch.nn.Linear initializes them; sub-keys N(0, 1);
        u ~ N(0, 1/input_dim) and v ~ N(0, 1/expert_hidden_size), so an
        expert's output starts at unit scale; norm affine 1 and 0."""
        bound = 1.0 / math.sqrt(self.input_dim)
        torch.nn.init.uniform_(self.wq, -bound, bound)
        if self.bq is not None:
            torch.nn.init.uniform_(self.bq, -bound, bound)
        for t in self.sub_keys:
            torch.nn.init.normal_(t)
        torch.nn.init.normal_(self.u, std=1.0 / math.sqrt(self.input_dim))
        torch.nn.init.normal_(self.v, std=1.0 / math.sqrt(self.u.shape[-1]))
        if self.norm_weight is not None:
            torch.nn.init.ones_(self.norm_weight)
            torch.nn.init.zeros_(self.norm_bias)

    def forward(self, x):
        lead = x.shape[:-1]
        sk = list(self.sub_keys) + [None] * (4 - len(self.sub_keys))
        y, _, _ = torch.ops.smelt.peer(x.reshape(-1, x.shape[-1]), self.wq, self.bq, self.norm_weight,
                                       self.norm_bias, self.bn_mean, self.bn_var, sk[0], sk[1], sk[2], sk[3], self.u,
                                       self.v, self.k, self.activation, self.query_norm, self.norm_eps, self.l2_eps,
                                       self.key_l2_norm, self.gate, self.sparse_grad)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self):
        return ("input_dim=%d, output_dim=%d, num_experts=%d, k=%d, heads=%d, query_dim=%d, p=%d, activation=%s, "
                "query_norm=%s, gate=%s%s" % (self.input_dim, self.output_dim, self.num_experts, self.k,
                                              self.num_heads, self.query_dim, len(self.sub_keys), self.activation,
                                              self.query_norm, self.gate, ", sparse_grad=True" if self.sparse_grad
                                              else ""))


# ---- MoE

# Positions in smelt's cfg tuple (smelt._moe_cfg) of its int and float fields.
_MOE_ICFG = (0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 12, 15, 16)
_MOE_FCFG = (6, 11, 13, 14)


def _moe_cfg_split(cfg):
    """smelt's cfg tuple as the (int list, float list) the ops' schemas take
    (noise_seed as the int64 of the same 64 bits)."""
    ints = [int(cfg[i]) for i in _MOE_ICFG]
    ints[8] = ints[8] - (1 << 64) if ints[8] >= 1 << 63 else ints[8]
    return ints, [float(cfg[i]) for i in _MOE_FCFG]


def _moe_cfg_join(icfg, fcfg):
    cfg = [0] * 17
    for i, v in zip(_MOE_ICFG, icfg):
        cfg[i] = int(v)
    for i, v in zip(_MOE_FCFG, fcfg):
        cfg[i] = float(v)
    cfg[5] = bool(cfg[5])
    cfg[9] &= (1 << 64) - 1
    return tuple(cfg)


def _moe_routing_dtype(x):
    # The routing (logits, weights, aux) is f32, or f64 for f64 inputs (the
    # CPU backend), as smelt.moe's own outputs.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@torch.library.custom_op("smelt::moe", mutates_args=())
def _moe(x: Tensor, wr: Tensor, expert_bias: Optional[Tensor], wnoise: Optional[Tensor], w1: Tensor,
         w3: Optional[Tensor], w2: Tensor, b1: Optional[Tensor], icfg: list[int],
         fcfg: list[float]) -> tuple[Tensor, Tensor, Tensor]:
    T, E, k = x.shape[0], wr.shape[1], icfg[1]
    f32, i64 = _moe_routing_dtype(x), torch.int64
    y, aux = x.new_empty((T, x.shape[1])), x.new_empty(2, dtype=f32)
    counts, offsets = x.new_empty(E, dtype=i64), x.new_empty(E + 1, dtype=i64)
    routing = (x.new_empty((T, E), dtype=f32), x.new_empty((T, k), dtype=torch.int32), x.new_empty((T, k), dtype=f32))
    _C.moe(0, _moe_cfg_join(icfg, fcfg), x, (wr, expert_bias, wnoise, w1, w3, w2, b1), (),
           (y,) + routing + (counts, offsets, None, aux), None, None)
    return y, aux, counts


@_moe.register_fake
def _moe_fake(x, wr, expert_bias, wnoise, w1, w3, w2, b1, icfg, fcfg):
    torch._check(x.dim() == 2, lambda: "smelt.moe: x must be 2-D [T, d_model]")
    return (x.new_empty((x.shape[0], x.shape[1])), x.new_empty(2, dtype=_moe_routing_dtype(x)),
            x.new_empty(wr.shape[1], dtype=torch.int64))


# The smelt::moe input each gradient of smelt::moe_backward belongs to
# (dx, dwr, dwnoise, dw1, dw3, dw2, db1; expert_bias, selection only, has none).
_MOE_GRAD_INPUTS = (0, 1, 3, 4, 5, 6, 7)


def _moe_backward_outs(x, wr, wnoise, w1, w3, w2, b1, needs):
    torch._check(len(needs) == 7, lambda: "smelt.moe_backward: needs must have one entry per output (7)")
    like = (x, wr, wnoise, w1, w3, w2, b1)
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if need and t is not None else None
            for t, need in zip(like, needs)]


@torch.library.custom_op("smelt::moe_backward", mutates_args=())
def _moe_backward_op(x: Tensor, dy: Tensor, wr: Tensor, expert_bias: Optional[Tensor], wnoise: Optional[Tensor],
                     w1: Tensor, w3: Optional[Tensor], w2: Tensor, b1: Optional[Tensor], icfg: list[int],
                     fcfg: list[float], needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                   Tensor]:
    outs = _moe_backward_outs(x, wr, wnoise, w1, w3, w2, b1, needs)
    _C.moe(1, _moe_cfg_join(icfg, fcfg), x, (wr, expert_bias, wnoise, w1, w3, w2, b1), (dy,), tuple(outs), None,
           None)
    return tuple(x.new_empty(0) if o is None else o for o in outs)


@_moe_backward_op.register_fake
def _moe_backward_fake(x, dy, wr, expert_bias, wnoise, w1, w3, w2, b1, icfg, fcfg, needs):
    outs = _moe_backward_outs(x, wr, wnoise, w1, w3, w2, b1, needs)
    return tuple(x.new_empty(0) if o is None else o for o in outs)


def _moe_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8])
    ctx.cfg = (inputs[8], inputs[9])


def _moe_grads(ctx, dy, weights, backward):
    """The inputs' gradients from smelt's backward: backward(x, dy, needs)
    runs smelt::moe_backward or smelt::moe_backward_saved. The aux losses'
    gradient is always part of it (Megatron's convention), whatever became
    of the aux output: its incoming gradient is not read."""
    x = weights[0]
    needs = [bool(ctx.needs_input_grad[i]) and weights[i] is not None for i in _MOE_GRAD_INPUTS]
    grads = [None] * 10
    if not any(needs):
        return tuple(grads)
    dy = torch.zeros_like(x) if dy is None else dy.contiguous()
    got = backward(x, dy, needs)
    for j, i in enumerate(_MOE_GRAD_INPUTS):
        if needs[j]:
            grads[i] = got[j]
    return tuple(grads)


def _moe_backward(ctx, dy, daux, dcounts):
    w = ctx.saved_tensors
    return _moe_grads(ctx, dy, w, lambda x, d, needs: torch.ops.smelt.moe_backward(x, d, *w[1:], *ctx.cfg, needs))


_moe.register_autograd(_moe_backward, setup_context=_moe_setup)


# ---- MoE for training: the forward keeps the backward's state (smelt_moe_forward_save_run),
# so the backward does not run the forward again.

def _moe_saved_bytes(x, icfg, fcfg):
    name = _smelt._DTYPE_NAMES.get(str(x.dtype).split(".")[-1], "f32")
    return _C.moe_saved_bytes(_moe_cfg_join(icfg, fcfg), int(x.shape[0]), name, x.device.type == "cuda")


@torch.library.custom_op("smelt::moe_train", mutates_args=())
def _moe_train(x: Tensor, wr: Tensor, expert_bias: Optional[Tensor], wnoise: Optional[Tensor], w1: Tensor,
               w3: Optional[Tensor], w2: Tensor, b1: Optional[Tensor], icfg: list[int],
               fcfg: list[float]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    E = wr.shape[1]
    y, aux = x.new_empty((x.shape[0], x.shape[1])), x.new_empty(2, dtype=_moe_routing_dtype(x))
    counts, saved = x.new_empty(E, dtype=torch.int64), x.new_empty(_moe_saved_bytes(x, icfg, fcfg), dtype=torch.uint8)
    _C.moe(2, _moe_cfg_join(icfg, fcfg), x, (wr, expert_bias, wnoise, w1, w3, w2, b1), (),
           (y, None, None, None, counts, None, None, aux, saved), None, None)
    return y, aux, counts, saved


@_moe_train.register_fake
def _moe_train_fake(x, wr, expert_bias, wnoise, w1, w3, w2, b1, icfg, fcfg):
    y, aux, counts = _moe_fake(x, wr, expert_bias, wnoise, w1, w3, w2, b1, icfg, fcfg)
    return y, aux, counts, x.new_empty(_moe_saved_bytes(x, icfg, fcfg), dtype=torch.uint8)


@torch.library.custom_op("smelt::moe_backward_saved", mutates_args=())
def _moe_backward_saved_op(x: Tensor, dy: Tensor, saved: Tensor, wr: Tensor, expert_bias: Optional[Tensor],
                           wnoise: Optional[Tensor], w1: Tensor, w3: Optional[Tensor], w2: Tensor,
                           b1: Optional[Tensor], icfg: list[int], fcfg: list[float],
                           needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    outs = _moe_backward_outs(x, wr, wnoise, w1, w3, w2, b1, needs)
    _C.moe(3, _moe_cfg_join(icfg, fcfg), x, (wr, expert_bias, wnoise, w1, w3, w2, b1), (dy, saved), tuple(outs),
           None, None)
    return tuple(x.new_empty(0) if o is None else o for o in outs)


@_moe_backward_saved_op.register_fake
def _moe_backward_saved_fake(x, dy, saved, wr, expert_bias, wnoise, w1, w3, w2, b1, icfg, fcfg, needs):
    return _moe_backward_fake(x, dy, wr, expert_bias, wnoise, w1, w3, w2, b1, icfg, fcfg, needs)


def _moe_train_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], output[3])
    ctx.cfg = (inputs[8], inputs[9])


def _moe_train_backward(ctx, dy, daux, dcounts, dsaved):
    *w, saved = ctx.saved_tensors
    return _moe_grads(ctx, dy, w, lambda x, d, needs: torch.ops.smelt.moe_backward_saved(x, d, saved, *w[1:], *ctx.cfg,
                                                                                         needs))


_moe_train.register_autograd(_moe_train_backward, setup_context=_moe_train_setup)


class MoE(torch.nn.Module):
    """A Mixture-of-Experts layer (Megatron-LM / Mixtral conventions) on
    smelt's kernels: a router wr [d_model, E] picks top_k experts per token,
    each a SwiGLU FFN (w1, w3 [E, d_model, ffn_dim], w2 [E, ffn_dim,
    d_model]) or, with ffn='mlp', act(x·w1 + b1)·w2. Every parameter trains
    through smelt's backward (deterministic); the aux losses' gradients
    (aux_loss_coeff, z_loss_coeff) are always added, and forward(x,
    return_aux=True) also returns their values (aux [2] f32) and the tokens
    each expert kept (counts [E]). expert_bias (selection only) is a buffer.
    Other keywords: smelt.moe's options (score, renormalize,
    scaling_factor, num_groups, topk_groups, capacity_factor, drop_policy,
    activation, noise_seed with noisy=True)."""

    def __init__(self, d_model, ffn_dim, num_experts, top_k=2, ffn="swiglu", bias=False, noisy=False,
                 expert_bias=False, device=None, dtype=None, **opts):
        super().__init__()
        f = {"device": device, "dtype": dtype}
        self.top_k, self.ffn = int(top_k), ffn
        self.opts = _smelt._moe_opts(dict(opts, ffn=ffn), "smelt.torch.MoE")
        self.wr = torch.nn.Parameter(torch.empty(d_model, num_experts, **f))
        self.wnoise = torch.nn.Parameter(torch.empty(d_model, num_experts, **f)) if noisy else None
        self.w1 = torch.nn.Parameter(torch.empty(num_experts, d_model, ffn_dim, **f))
        self.w3 = torch.nn.Parameter(torch.empty(num_experts, d_model, ffn_dim, **f)) if ffn == "swiglu" else None
        self.w2 = torch.nn.Parameter(torch.empty(num_experts, ffn_dim, d_model, **f))
        self.b1 = torch.nn.Parameter(torch.empty(num_experts, ffn_dim, **f)) if bias and ffn == "mlp" else None
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.reset_parameters()

    def reset_parameters(self):
        """The router and the up projections ~ N(0, 1/d_model), the down
        projection ~ N(0, 1/ffn_dim), b1 zero."""
        d, F = self.w1.shape[1], self.w1.shape[2]
        for t in (self.wr, self.wnoise, self.w1, self.w3):
            if t is not None:
                torch.nn.init.normal_(t, std=1.0 / math.sqrt(d))
        torch.nn.init.normal_(self.w2, std=1.0 / math.sqrt(F))
        if self.b1 is not None:
            torch.nn.init.zeros_(self.b1)

    def forward(self, x, return_aux=False):
        lead = x.shape[:-1]
        y, aux, counts = moe(x.reshape(-1, x.shape[-1]), self.wr, self.w1, self.w2, self.w3, top_k=self.top_k,
                             b1=self.b1, expert_bias=self.expert_bias, wnoise=self.wnoise, _stats=True, **self.opts)
        y = y.reshape(*lead, y.shape[-1])
        return (y, aux, counts) if return_aux else y

    def extra_repr(self):
        E, d, F = self.w1.shape
        return "d_model=%d, ffn_dim=%d, num_experts=%d, top_k=%d, ffn=%s" % (d, F, E, self.top_k, self.ffn)


# ---- the Python-facing functions (what smelt.* routes to under torch.compile)


def _into(result, given):
    """result, or the caller's given tensor filled with it by copy (the ops
    allocate their outputs, so out= arguments are honoured this way)."""
    if given is None:
        return result
    given.copy_(result)
    return given


def _out_lse(o, l, return_lse, out, lse):
    """The results of ops with an optional LSE: o and l copied into out and
    lse when given; (o, l) when the LSE is asked for, else o."""
    o, l = _into(o, out), _into(l, lse)
    return (o, l) if return_lse else o


def activation(x, act="gelu", slope=0.01, out=None):
    """torch.ops.smelt.activation (or activation_out when out is given). See smelt.activation."""
    if out is None:
        return torch.ops.smelt.activation(x, act, slope)
    torch.ops.smelt.activation_out(x, out, act, slope)
    return out


def softmax(x, out=None, lse=None, return_lse=False):
    """torch.ops.smelt.softmax; out/lse are filled by copy. See smelt.softmax."""
    y, l = torch.ops.smelt.softmax(x)
    return _out_lse(y, l, return_lse, out, lse)


def topk(x, k, values=None, indices=None, index_dtype="int64"):
    """torch.ops.smelt.topk; values/indices are filled by copy. See smelt.topk."""
    int32 = index_dtype in ("int32", "i32") or index_dtype is torch.int32
    v, i = torch.ops.smelt.topk(x, k, int32)
    if indices is None and index_dtype is None:
        return _into(v, values), None
    return _into(v, values), _into(i, indices)


def gemm(a, b, c=None, bias=None, out=None, alpha=1.0, beta=None, activation="identity", slope=0.01,
         math="default", out_dtype=None):
    """torch.ops.smelt.gemm; out is filled by copy. See smelt.gemm."""
    if beta is None:
        beta = 0.0 if c is None else 1.0
    if isinstance(out_dtype, str):
        out_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64}[out_dtype]
    d = torch.ops.smelt.gemm(a, b, c, bias, float(alpha), float(beta), activation, float(slope), math, out_dtype)
    return _into(d, out)


def gemm_grouped(a, b, offs, c=None, bias=None, out=None, alpha=1.0, beta=None, activation="identity", slope=0.01,
                 math="default"):
    """torch.ops.smelt.gemm_grouped (rows at or past offs[-1] are 0); out is
    filled by copy of the grouped rows only, as smelt.gemm_grouped leaves the
    rest. See smelt.gemm_grouped."""
    if beta is None:
        beta = 0.0 if c is None else 1.0
    d = torch.ops.smelt.gemm_grouped(a, b, offs, c, bias, float(alpha), float(beta), activation, float(slope), math)
    if out is not None:
        # The clamped last end, computed on the device (no sync): min(T, max(0, offs...)).
        end = offs.max().clamp(0, a.shape[0]) if offs.numel() else 0
        grouped = torch.arange(a.shape[0], device=d.device) < end
        out.copy_(torch.where(grouped[:, None], d, out))
        d = out
    return d


def _conv_in(t, name, op, layout):
    """t in NHWC (layout 'nchw': the NHWC view of an NCHW tensor), after
    smelt.conv2d's checks."""
    return _smelt._conv_view(t, name, op, layout)


def _torch_dtype(dt):
    """A torch dtype for out_dtype=: None, a torch dtype, or a smelt name
    of the conv2d output dtypes."""
    if dt is None or isinstance(dt, torch.dtype):
        return dt
    names = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
    name = _smelt._norm_dtype(dt)
    if name not in names:
        raise _smelt.DTypeError("smelt.conv2d: out_dtype=%r is not one of f32, f16, bf16 (or a torch dtype)" % (dt,))
    return names[name]


def _conv_back(y, layout):
    return y if layout == "nhwc" else y.permute(0, 3, 1, 2)


def conv2d(x, w, bias=None, c=None, out=None, stride=1, padding=0, dilation=1, alpha=1.0, beta=None,
           activation="identity", slope=0.01, math="default", out_dtype=None, layout="nhwc"):
    """torch.ops.smelt.conv2d (differentiable in x, w, bias and c); out is
    filled by copy. layout 'nchw' takes and gives torch's NCHW tensors
    through views (channels_last ones are dense NHWC, so nothing is
    copied). See smelt.conv2d."""
    op = "smelt.conv2d"
    _smelt._conv_layout(layout, op)
    geometry = list(_smelt._conv_geometry(stride, padding, dilation, op))
    x, w = _conv_in(x, "x", op, layout), _conv_in(w, "w", op, layout)
    c = None if c is None else _conv_in(c, "c", op, layout)
    _smelt._conv_y_shape(x, w, geometry, op)  # an output of at least 1x1, named before the op runs
    if beta is None:
        beta = 0.0 if c is None else 1.0
    y = torch.ops.smelt.conv2d(x, w, bias, c, geometry, float(alpha), float(beta), activation, float(slope), math,
                               _torch_dtype(out_dtype))
    return _into(_conv_back(y, layout), out)


def _conv_grad(kind, dy, b, shape, geometry, c, out, alpha, beta, math, out_dtype, layout):
    _, geom, dy, b, c, shape = _smelt._conv_grad_args(kind, dy, b, shape, geometry, c, out, layout)
    if beta is None:
        beta = 0.0 if c is None else 1.0
    f = torch.ops.smelt.conv2d_dgrad if kind == 1 else torch.ops.smelt.conv2d_wgrad
    d = f(dy, b, c, list(shape), list(geom), float(alpha), float(beta), math, _torch_dtype(out_dtype))
    return _into(_conv_back(d, layout), out)


def conv2d_dgrad(dy, w, x_shape=None, stride=1, padding=0, dilation=1, c=None, out=None, alpha=1.0, beta=None,
                 math="default", out_dtype=None, layout="nhwc"):
    """torch.ops.smelt.conv2d_dgrad; out is filled by copy. See smelt.conv2d_dgrad."""
    return _conv_grad(1, dy, w, x_shape, (stride, padding, dilation), c, out, alpha, beta, math, out_dtype, layout)


def conv2d_wgrad(dy, x, w_shape=None, stride=1, padding=0, dilation=1, c=None, out=None, alpha=1.0, beta=None,
                 math="default", out_dtype=None, layout="nhwc"):
    """torch.ops.smelt.conv2d_wgrad; out is filled by copy. See smelt.conv2d_wgrad."""
    return _conv_grad(2, dy, x, w_shape, (stride, padding, dilation), c, out, alpha, beta, math, out_dtype, layout)


def attention(q, k, v, causal=False, scale=None, window=(-1, -1), return_lse=False, out=None, lse=None, softcap=0.0,
              alibi_slopes=None, sinks=None, deterministic=False):
    """torch.ops.smelt.attention (differentiable in q, k, v and sinks); out/lse
    are filled by copy; deterministic=True makes the backward bitwise
    repeatable. See smelt.attention."""
    o, l = torch.ops.smelt.attention(q, k, v, bool(causal), None if scale is None else float(scale),
                                     int(window[0]), int(window[1]), float(softcap), alibi_slopes, sinks,
                                     bool(deterministic))
    return _out_lse(o, l, return_lse, out, lse)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, scale=None,
                     window=(-1, -1), return_lse=False, out=None, lse=None, softcap=0.0, alibi_slopes=None,
                     sinks=None, deterministic=False):
    """torch.ops.smelt.attention_varlen (differentiable in q, k, v and sinks);
    out/lse are filled by copy. See smelt.attention_varlen."""
    o, l = torch.ops.smelt.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                            int(max_seqlen_k), bool(causal), None if scale is None else float(scale),
                                            int(window[0]), int(window[1]), float(softcap), alibi_slopes, sinks,
                                            bool(deterministic))
    return _out_lse(o, l, return_lse, out, lse)


def peer(x, wq, sub_keys, u, v, k=16, bq=None, norm_weight=None, norm_bias=None, bn_mean=None, bn_var=None,
         activation="gelu", query_norm="none", norm_eps=1e-5, l2_eps=1e-12, key_l2_norm=False, gate="softmax",
         return_ids=False, out=None, ids=None, scores=None, sparse_grad=False):
    """torch.ops.smelt.peer (differentiable in x and every parameter; ids
    and scores carry no gradient); out/ids/scores are filled by copy;
    sparse_grad makes u's and v's gradients sparse COO tensors (see
    smelt.torch.PEER). See smelt.peer."""
    sk = list(sub_keys) + [None] * (4 - len(sub_keys))
    y, i, s = torch.ops.smelt.peer(x, wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sk[0], sk[1], sk[2], sk[3], u,
                                   v, int(k), activation, query_norm, float(norm_eps), float(l2_eps),
                                   bool(key_l2_norm), gate, bool(sparse_grad))
    y, i, s = _into(y, out), _into(i, ids), _into(s, scores)
    return (y, i, s) if return_ids else y


def moe(x, wr, w1, w2, w3=None, *, top_k, b1=None, expert_bias=None, wnoise=None, return_routing=False, _stats=False,
        **opts):
    """torch.ops.smelt.moe, differentiable in x, wr, wnoise, w1, w3, w2 and
    b1 (the aux losses' gradients always included). return_routing gives
    (y, {'aux': aux, 'counts': counts}) here, not smelt.moe's full routing.
    See smelt.moe."""
    cfg = _smelt._moe_cfg(x, wr, w1, w3, top_k, _smelt._moe_opts(opts, "smelt.moe"), "smelt.moe")
    args = (x, wr, expert_bias, wnoise, w1, w3, w2, b1, *_moe_cfg_split(cfg))
    # With a gradient to come, the forward keeps the backward's state (as
    # autograd keeps activations); without, nothing is kept.
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args[:8]):
        y, aux, counts, _ = torch.ops.smelt.moe_train(*args)
    else:
        y, aux, counts = torch.ops.smelt.moe(*args)
    if _stats:
        return y, aux, counts
    return (y, {"aux": aux, "counts": counts}) if return_routing else y


# Route smelt.* through these ops while torch.compile traces.
_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling
from . import torch_norm  # noqa: E402,F401  (smelt::norm, norm_backward, residual_add, rotary)

_smelt._torch_impl = sys.modules[__name__]
_smelt._is_compiling = _is_compiling

# ---- BEM: the generated low-rank update (smelt/_bem.py)
#
#     smelt::bem_update(Tensor x, Tensor v, Tensor codes, Tensor u, Tensor? offsets, Tensor? scales, Tensor? y,
#                       float scale) -> Tensor        (ΔY; y + ΔY in a new tensor when y is given)
#     smelt::bem_backward(Tensor x, Tensor v, Tensor codes, Tensor u, Tensor? offsets, Tensor? scales, Tensor dy,
#                         float scale, bool[] needs) -> (dx, dv, du, dcodes)   (empty tensors where needs is false)
#
# u is [.., d_out, r] here; the seed's pre-transposed U goes in as its
# transposed view (autograd takes du back through the view). offsets and
# scales carry no gradient; y's is dy itself.

_BEM_GRADS = ("dx", "dv", "du", "dcodes")
# The smelt::bem_update input each gradient of smelt::bem_backward belongs to.
_BEM_GRAD_INPUTS = (0, 1, 3, 2)


def _bem_y_shape(x, u):
    torch._check(x.dim() == 2 and u.dim() >= 2, lambda: "smelt.bem_update: x must be [M, d_in] and u [.., d_out, r]")
    return (x.shape[0], u.shape[-2])


@torch.library.custom_op("smelt::bem_update", mutates_args=())
def _bem_update(x: Tensor, v: Tensor, codes: Tensor, u: Tensor, offsets: Optional[Tensor], scales: Optional[Tensor],
                y: Optional[Tensor], scale: float) -> Tensor:
    # With y the op adds into a copy of it: a functional op leaves its
    # inputs as they are.
    out = x.new_empty(_bem_y_shape(x, u)) if y is None else y.clone(memory_format=torch.contiguous_format)
    _C.bem(0, scale, int(y is not None), False, (x, v, codes, u, offsets, scales), (), (out,), None, None)
    return out


@_bem_update.register_fake
def _bem_update_fake(x, v, codes, u, offsets, scales, y, scale):
    return x.new_empty(_bem_y_shape(x, u))


def _bem_backward_outs(x, v, codes, u, needs):
    torch._check(len(needs) == 4, lambda: "smelt.bem_backward: needs must have one entry per output (4)")
    return [torch.empty_like(t, memory_format=torch.contiguous_format) if need else None
            for t, need in zip((x, v, u, codes), needs)]


@torch.library.custom_op("smelt::bem_backward", mutates_args=())
def _bem_backward_op(x: Tensor, v: Tensor, codes: Tensor, u: Tensor, offsets: Optional[Tensor],
                     scales: Optional[Tensor], dy: Tensor, scale: float,
                     needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    outs = _bem_backward_outs(x, v, codes, u, needs)
    _C.bem(1, scale, 0, False, (x, v, codes, u, offsets, scales), (dy,), tuple(outs), None, None)
    return tuple(x.new_empty(0) if o is None else o for o in outs)


@_bem_backward_op.register_fake
def _bem_backward_fake(x, v, codes, u, offsets, scales, dy, scale, needs):
    return tuple(x.new_empty(0) if o is None else o for o in _bem_backward_outs(x, v, codes, u, needs))


def _bem_setup(ctx, inputs, output):
    x, v, codes, u, offsets, scales, y, scale = inputs
    ctx.save_for_backward(x, v, codes, u, offsets, scales)
    ctx.scale = scale


def _bem_backward(ctx, dy):
    x, v, codes, u, offsets, scales = ctx.saved_tensors
    needs = [bool(ctx.needs_input_grad[i]) for i in _BEM_GRAD_INPUTS]
    grads = [None] * 8
    if ctx.needs_input_grad[6]:
        grads[6] = dy
    if any(needs):
        got = torch.ops.smelt.bem_backward(x, v, codes, u, offsets, scales, dy.contiguous(), ctx.scale, needs)
        for j, i in enumerate(_BEM_GRAD_INPUTS):
            if needs[j]:
                grads[i] = got[j]
    return tuple(grads)


_bem_update.register_autograd(_bem_backward, setup_context=_bem_setup)


def bem_update(x, v, codes, u, scale=1.0, offsets=None, scales=None, accumulate=False, u_transposed=False, out=None):
    """torch.ops.smelt.bem_update, differentiable in x, v, codes and u (and
    out with accumulate: its gradient is dy); accumulate adds into out by
    copy. See smelt.bem_update."""
    if accumulate and out is None:
        raise _C.ArgumentError("smelt.bem_update: accumulate=True adds the update into out, which is None")
    u = u.transpose(-2, -1) if u_transposed else u
    y = torch.ops.smelt.bem_update(x, v, codes, u, offsets, scales, out if accumulate else None, float(scale))
    return _into(y, out)


def bem_backward(dy, x, v, codes, u, scale=1.0, offsets=None, scales=None, u_transposed=False, needs=None):
    """torch.ops.smelt.bem_backward as a dict name -> gradient (du shaped
    like u as given). See smelt.bem_backward."""
    needs = _BEM_GRADS if needs is None else needs
    got = torch.ops.smelt.bem_backward(x, v, codes, u.transpose(-2, -1) if u_transposed else u, offsets, scales, dy,
                                       float(scale), [n in needs for n in _BEM_GRADS])
    r = {n: g for n, g in zip(_BEM_GRADS, got) if n in needs}
    if u_transposed and "du" in r:
        r["du"] = r["du"].transpose(-2, -1)
    return r


class BEMLinear(torch.nn.Module):
    """A frozen nn.Linear with a trainable BEM update (LoRA whose rank
    channels are gated per token by codes):

        forward(x, codes) = base(x) + scale · ((x·V) ∘ codes) · Uᵀ,   scale = alpha / rank

    x [..., in_features], codes [..., rank] (given per call; cast to x's
    dtype). V [in_features, rank] starts as LoRA's A does (uniform within
    ±1/sqrt(in_features)), U [out_features, rank] at zero, so the layer
    starts as the base. The base's parameters are frozen here
    (requires_grad False); x, codes, V and U get gradients through smelt's
    backward. The parameters take the base weight's dtype and device."""

    def __init__(self, base, rank, alpha=16.0):
        super().__init__()
        if not isinstance(base, torch.nn.Linear):
            raise TypeError("smelt.torch.BEMLinear: base must be a torch.nn.Linear, got %s" % type(base).__name__)
        if not 1 <= int(rank) <= 128:
            raise _C.ArgumentError("smelt.torch.BEMLinear: rank=%r must be in [1, 128]" % (rank,))
        self.base = base.requires_grad_(False)
        self.rank, self.alpha = int(rank), float(alpha)
        self.scale = self.alpha / self.rank
        f = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.v = torch.nn.Parameter(torch.empty(base.in_features, self.rank, **f))
        self.u = torch.nn.Parameter(torch.empty(base.out_features, self.rank, **f))
        self.reset_parameters()

    def reset_parameters(self):
        """V uniform within ±1/sqrt(in_features) (LoRA's kaiming_uniform(a=√5)
        of A), U zero."""
        bound = 1.0 / math.sqrt(self.base.in_features)
        torch.nn.init.uniform_(self.v, -bound, bound)
        torch.nn.init.zeros_(self.u)

    def forward(self, x, codes):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        c2 = codes.reshape(-1, codes.shape[-1]).to(x.dtype)
        y = torch.ops.smelt.bem_update(x2, self.v, c2, self.u, None, None, self.base(x2), self.scale)
        return y.reshape(*lead, y.shape[-1])

    def extra_repr(self):
        return "in_features=%d, out_features=%d, rank=%d, alpha=%g" % (self.base.in_features, self.base.out_features,
                                                                       self.rank, self.alpha)


__all__ += ["BEMLinear", "bem_backward", "bem_update"]
