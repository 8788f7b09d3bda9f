"""The norms, the residual add and rotary embedding (include/smelt/norm.h,
include/smelt/rotary.h), re-exported by ``smelt``. A module of their own so
that smelt/__init__.py keeps one line for them; they follow its conventions:
outputs written into ``out=`` tensors or allocated by the input's framework,
the context and stream as for every op, torch.compile routed to the custom
ops of smelt.torch_norm.
"""

import sys as _sys

import smelt as _pkg  # the package, partly initialized: read at call time only

from . import _smelt as _C

__all__ = ["add_layer_norm", "add_rms_norm", "layer_norm", "norm_backward", "residual_add", "rms_norm", "rotary",
           "rotary_tables"]

_KINDS = {"rms": 0, "layer": 1}
_LAYOUTS = {"neox": 0, "gptj": 1}


def _compiling():
    return _pkg._is_compiling()


def _traced():
    """smelt.torch_norm, what the functions route to inside torch.compile
    (reached through smelt.torch, which imported it)."""
    return _pkg._torch_impl.torch_norm


def _numpy_of(x):
    """numpy when x is a numpy array (its outputs are made here: numpy has
    no allocator the C layer can call), else None."""
    return _sys.modules["numpy"] if type(x).__module__ == "numpy" else None


def _enum(table, name, what):
    if name not in table:
        raise _C.ArgumentError("smelt.%s=%r is not one of %r" % (what, name, tuple(table)))
    return table[name]


def _norm(kind, x, weight, bias, eps, residual, out, residual_out, return_stats, ctx, stream):
    if _compiling():
        return _traced().norm(kind, x, weight, bias, eps, residual, out, residual_out, return_stats)
    np = _numpy_of(x)
    mean = rstd = None
    if np is not None:
        out = np.empty_like(x) if out is None else out
        if residual is not None and residual_out is None:
            residual_out = np.empty_like(x)
        if return_stats:
            rstd = np.empty(x.shape[:-1], dtype=np.float32)
            mean = np.empty(x.shape[:-1], dtype=np.float32) if kind == "layer" else None
    y, h, mean, rstd = _C.norm(x, residual, weight, bias, out, residual_out, mean, rstd, _KINDS[kind], eps,
                               bool(return_stats), ctx, stream)
    r = (y,) if residual is None else (y, h)
    if return_stats:
        r += (mean, rstd) if kind == "layer" else (rstd,)
    return r[0] if len(r) == 1 else r


def rms_norm(x, weight=None, eps=1e-6, *, bias=None, residual=None, out=None, residual_out=None, return_stats=False,
             ctx=None, stream=None):
    """RMSNorm over the last dimension, after a residual add when given.

    h = x (+ residual, rounded to x's dtype); rstd = 1/sqrt(mean(h²) + eps);
    y = h · rstd · weight (+ bias).
    Shapes:  x, residual, y, h [..., C] (unit stride along C; rows at any
             strides); weight, bias [C]; rstd [...].
    Dtypes:  x f32, f16 or bf16; weight and bias x's dtype or f32; rstd f32.
    residual_out: where to write h (residual itself is allowed: in place).
    Returns y; (y, h) with a residual; with return_stats, rstd after them.
    """
    return _norm("rms", x, weight, bias, eps, residual, out, residual_out, return_stats, ctx, stream)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, out=None, residual_out=None,
               return_stats=False, ctx=None, stream=None):
    """LayerNorm over the last dimension, after a residual add when given.

    h as in rms_norm; mean, rstd = 1/sqrt(var(h) + eps) (biased variance);
    y = (h − mean) · rstd · weight + bias. Shapes and dtypes as rms_norm's.
    Returns y; (y, h) with a residual; with return_stats, (mean, rstd) after them.
    """
    return _norm("layer", x, weight, bias, eps, residual, out, residual_out, return_stats, ctx, stream)


def add_rms_norm(x, residual, weight=None, eps=1e-6, **kw):
    """The fused residual add + RMSNorm of a pre-norm block: (y, h) with
    h = x + residual and y = rms_norm(h). Keywords as rms_norm's."""
    return rms_norm(x, weight, eps, residual=residual, **kw)


def add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, **kw):
    """The fused residual add + LayerNorm: (y, h), h = x + residual, y = layer_norm(h)."""
    return layer_norm(x, weight, bias, eps, residual=residual, **kw)


def norm_backward(kind, dy, x, rstd, weight=None, mean=None, *, dh=None, need_dweight=None, need_dbias=False,
                  dx=None, dweight=None, dbias=None, ctx=None, stream=None):
    """The backward of rms_norm ('rms') or layer_norm ('layer').

    dy, x [..., C]: the output's gradient and the forward's h; rstd (and
    mean, LayerNorm) [...] f32 from the forward; dh: the gradient reaching h
    in the residual form, added to dx. need_dweight (default: weight given)
    and need_dbias ask for the parameter gradients, summed over the rows in
    a fixed order (repeatable bit for bit).
    Returns (dx, dweight, dbias), None where not asked for.
    """
    k = _enum(_KINDS, kind, "norm_backward: kind")
    need_dweight = weight is not None if need_dweight is None else bool(need_dweight)
    if _compiling():
        return _traced().norm_backward(kind, dy, x, rstd, weight, mean, dh, need_dweight, need_dbias)
    np = _numpy_of(dy)
    if np is not None:
        dx = np.empty_like(dy) if dx is None else dx
        pdt = weight.dtype if weight is not None else dy.dtype
        if need_dweight and dweight is None:
            dweight = np.empty(dy.shape[-1:], dtype=pdt)
        if need_dbias and dbias is None:
            dbias = np.empty(dy.shape[-1:], dtype=pdt)
    return _C.norm_backward(dy, x, weight, mean, rstd, dh, dx, dweight, dbias, k, need_dweight, bool(need_dbias), ctx,
                            stream)


def residual_add(x, residual, out=None, *, ctx=None, stream=None):
    """y = x + residual, elementwise (same shape and dtype, any strides);
    out may be residual itself (the residual stream updated in place)."""
    if _compiling():
        return _traced().residual_add(x, residual, out)
    np = _numpy_of(x)
    if np is not None and out is None:
        out = np.empty_like(x)
    return _C.residual_add(x, residual, out, ctx, stream)


def rotary(x, cos, sin, positions=None, *, layout="neox", inverse=False, out=None, ctx=None, stream=None):
    """Rotary position embedding.

    x [B, S, H, D] (unit stride along D; Q or K may be views into a packed
    QKV tensor); cos, sin [P, R/2] f32 tables (rotary_tables) whose width
    fixes the rotated part R <= D (elements R.. pass through); positions
    [B, S] int32/int64 or None (token s at position s; then S <= P; values
    outside [0, P) are clamped). layout 'neox' (pairs i, i + R/2) or 'gptj'
    (pairs 2i, 2i + 1). inverse: rotate by −angle, the backward.
    out may be x itself (in place). Returns y.
    """
    lay = _enum(_LAYOUTS, layout, "rotary: layout")
    if _compiling():
        return _traced().rotary(x, cos, sin, positions, layout, inverse, out)
    np = _numpy_of(x)
    if np is not None and out is None:
        out = np.empty_like(x)
    return _C.rotary(x, cos, sin, positions, out, lay, 1 if inverse else 0, ctx, stream)


def rotary_tables(positions, rot_dim, theta=10000.0):
    """The f32 tables (cos, sin), numpy [positions, rot_dim/2]:
    angle(p, i) = p · theta^(−2i/rot_dim), in double, rounded to f32 (as the C
    helper smelt_rotary_tables). Move them to the device yourself."""
    import numpy as np
    if rot_dim < 2 or rot_dim % 2 or positions < 0 or not theta > 0:
        raise _C.ArgumentError("smelt.rotary_tables: positions=%r must be >= 0, rot_dim=%r even and >= 2, theta=%r > 0"
                               % (positions, rot_dim, theta))
    freq = np.power(float(theta), -2.0 * np.arange(rot_dim // 2, dtype=np.float64) / rot_dim)
    a = np.arange(positions, dtype=np.float64)[:, None] * freq[None, :]
    return np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
