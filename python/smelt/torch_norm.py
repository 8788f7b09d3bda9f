"""The norms, the residual add and rotary as torch custom ops (imported by
smelt.torch, which registers everything under ``torch.ops.smelt``):

    smelt::norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, int kind, float eps)
        -> (Tensor y, Tensor h, Tensor mean, Tensor rstd)
        (kind 0 RMSNorm, 1 LayerNorm; h is empty without a residual, mean
        empty for RMSNorm)
    smelt::norm_backward(Tensor dy, Tensor x, Tensor? weight, Tensor? mean, Tensor rstd, Tensor? dh,
                         int kind, bool need_dweight, bool need_dbias) -> (Tensor dx, Tensor dweight, Tensor dbias)
        (empty where not asked for)
    smelt::residual_add(Tensor x, Tensor residual) -> Tensor
    smelt::rotary(Tensor x, Tensor cos, Tensor sin, Tensor? positions, int layout, bool inverse) -> Tensor

Each has a fake implementation (torch.compile traces it without graph
breaks). Autograd: the norm's backward is smelt::norm_backward (x, the
residual, weight and bias; the statistics carry no gradient, as the
logsumexp of smelt::softmax); the residual add passes its gradient to both
inputs; rotary's backward is smelt::rotary with the inverse rotation (the
tables and positions carry none). Row tensors need unit stride along the
last dim: others are made contiguous first.
"""

from typing import Optional

import torch

from smelt import _smelt as _C

__all__ = ["norm", "norm_backward", "residual_add", "rotary"]

Tensor = torch.Tensor
_LAYOUTS = {"neox": 0, "gptj": 1}


def _rows(t):
    """t with unit stride along its last dim (a copy only when it has not)."""
    return t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def _empty(like):
    return like.new_empty((0,))


# ---- norm


@torch.library.custom_op("smelt::norm", mutates_args=())
def _norm_op(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor], bias: Optional[Tensor], kind: int,
             eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    x, residual = _rows(x), _rows(residual)
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else None
    stats = x.shape[:-1]
    mean = torch.empty(stats, dtype=torch.float32, device=x.device) if kind == 1 else None
    rstd = torch.empty(stats, dtype=torch.float32, device=x.device)
    w = None if weight is None else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    _C.norm(x, residual, w, b, y, h, mean, rstd, kind, eps, True, None, None)
    return y, _empty(x) if h is None else h, _empty(rstd) if mean is None else mean, rstd


@_norm_op.register_fake
def _norm_fake(x, residual, weight, bias, kind, eps):
    torch._check(x.dim() >= 1, lambda: "smelt.norm: x must have at least 1 dim")
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    h = torch.empty_like(x) if residual is not None else x.new_empty((0,))
    mean = x.new_empty(x.shape[:-1], dtype=torch.float32) if kind == 1 else x.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(x), h, mean, stats


def _norm_setup(ctx, inputs, output):
    x, residual, weight, bias, kind, eps = inputs
    _, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.kind = kind
    ctx.residual = residual is not None
    ctx.bias = bias is not None


def _norm_backward(ctx, dy, dh, dmean, drstd):
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None:
        dy = torch.zeros_like(h)
    need = ctx.needs_input_grad
    dx, dw, db = torch.ops.smelt.norm_backward(dy, h, weight, mean if ctx.kind == 1 else None, rstd,
                                               dh if ctx.residual else None, ctx.kind,
                                               weight is not None and need[2], ctx.bias and need[3])
    return (dx, dx if ctx.residual else None, dw if weight is not None and need[2] else None,
            db if ctx.bias and need[3] else None, None, None)


_norm_op.register_autograd(_norm_backward, setup_context=_norm_setup)


@torch.library.custom_op("smelt::norm_backward", mutates_args=())
def _norm_backward_op(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Optional[Tensor], rstd: Tensor,
                      dh: Optional[Tensor], kind: int, need_dweight: bool,
                      need_dbias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dy, x, dh = _rows(dy), _rows(x), _rows(dh)
    w = None if weight is None else weight.contiguous()
    pdt = dy.dtype if w is None else w.dtype
    dx = torch.empty_like(dy)
    dw = torch.empty(dy.shape[-1:], dtype=pdt, device=dy.device) if need_dweight else None
    db = torch.empty(dy.shape[-1:], dtype=pdt, device=dy.device) if need_dbias else None
    _C.norm_backward(dy, x, w, mean, rstd, dh, dx, dw, db, kind, need_dweight, need_dbias, None, None)
    return dx, _empty(dx) if dw is None else dw, _empty(dx) if db is None else db


@_norm_backward_op.register_fake
def _norm_backward_fake(dy, x, weight, mean, rstd, dh, kind, need_dweight, need_dbias):
    pdt = dy.dtype if weight is None else weight.dtype
    vec = dy.new_empty(dy.shape[-1:], dtype=pdt)
    return torch.empty_like(dy), vec if need_dweight else dy.new_empty((0,)), (
        dy.new_empty(dy.shape[-1:], dtype=pdt) if need_dbias else dy.new_empty((0,)))


# ---- residual add


@torch.library.custom_op("smelt::residual_add", mutates_args=())
def _residual_add_op(x: Tensor, residual: Tensor) -> Tensor:
    y = torch.empty_like(x)
    _C.residual_add(x, residual, y, None, None)
    return y


@_residual_add_op.register_fake
def _residual_add_fake(x, residual):
    return torch.empty_like(x)


def _residual_add_backward(ctx, dy):
    return dy, dy


_residual_add_op.register_autograd(_residual_add_backward)


# ---- rotary


@torch.library.custom_op("smelt::rotary", mutates_args=())
def _rotary_op(x: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor], layout: int,
               inverse: bool) -> Tensor:
    x = _rows(x)
    y = torch.empty_like(x)
    _C.rotary(x, _rows(cos), _rows(sin), positions, y, layout, 1 if inverse else 0, None, None)
    return y


@_rotary_op.register_fake
def _rotary_fake(x, cos, sin, positions, layout, inverse):
    torch._check(x.dim() == 4, lambda: "smelt.rotary: x must be [B, S, H, D]")
    return torch.empty_like(x)


def _rotary_setup(ctx, inputs, output):
    _, cos, sin, positions, layout, inverse = inputs
    ctx.save_for_backward(cos, sin, positions)
    ctx.layout = layout
    ctx.inverse = inverse


def _rotary_backward(ctx, dy):
    cos, sin, positions = ctx.saved_tensors
    return torch.ops.smelt.rotary(dy, cos, sin, positions, ctx.layout, not ctx.inverse), None, None, None, None, None


_rotary_op.register_autograd(_rotary_backward, setup_context=_rotary_setup)


# ---- what smelt's functions route to inside torch.compile


def norm(kind, x, weight=None, bias=None, eps=1e-5, residual=None, out=None, residual_out=None, return_stats=False):
    """torch.ops.smelt.norm; out and residual_out are filled by copy. See smelt.rms_norm."""
    k = 1 if kind == "layer" else 0
    y, h, mean, rstd = torch.ops.smelt.norm(x, residual, weight, bias, k, float(eps))
    if out is not None:
        out.copy_(y)
        y = out
    if residual is not None and residual_out is not None:
        residual_out.copy_(h)
        h = residual_out
    r = (y,) if residual is None else (y, h)
    if return_stats:
        r += (mean, rstd) if k == 1 else (rstd,)
    return r[0] if len(r) == 1 else r


def norm_backward(kind, dy, x, rstd, weight=None, mean=None, dh=None, need_dweight=None, need_dbias=False):
    """torch.ops.smelt.norm_backward, None where not asked for. See smelt.norm_backward."""
    need_dweight = weight is not None if need_dweight is None else bool(need_dweight)
    k = 1 if kind == "layer" else 0
    dx, dw, db = torch.ops.smelt.norm_backward(dy, x, weight, mean, rstd, dh, k, need_dweight, bool(need_dbias))
    return dx, dw if need_dweight else None, db if need_dbias else None


def residual_add(x, residual, out=None):
    """torch.ops.smelt.residual_add; out is filled by copy."""
    y = torch.ops.smelt.residual_add(x, residual)
    if out is not None:
        out.copy_(y)
        return out
    return y


def rotary(x, cos, sin, positions=None, layout="neox", inverse=False, out=None):
    """torch.ops.smelt.rotary; out is filled by copy. See smelt.rotary."""
    y = torch.ops.smelt.rotary(x, cos, sin, positions, _LAYOUTS[layout], bool(inverse))
    if out is not None:
        out.copy_(y)
        return out
    return y
