"""BEM, the generated low-rank update of a frozen linear layer
(include/smelt/bem.h), re-exported by ``smelt``: the update, its backward,
and the validation and benchmark functions of the C API. A module of its
own so that smelt/__init__.py keeps one line for it; it follows that
module's conventions: outputs written into ``out=`` tensors or allocated by
the input's framework, the context and stream as for every op,
torch.compile routed to the custom ops of smelt.torch.
"""

import sys as _sys

import smelt as _pkg  # the package, partly initialized: read at call time only

from . import _smelt as _C

__all__ = ["bem_backward", "bem_benchmark", "bem_update", "bem_validate"]

GRADS = ("dx", "dv", "du", "dcodes")
_UPDATE, _BACKWARD, _VALIDATE, _BENCHMARK = range(4)


def _numpy_of(x):
    """numpy when x is a numpy array (its outputs are made here: numpy has
    no allocator the C layer can call), else None."""
    return _sys.modules["numpy"] if type(x).__module__ == "numpy" else None


def _dim(t, i):
    """t.shape[i], or 0 where t has too few dims (the C layer names the
    shape that is wrong)."""
    s = getattr(t, "shape", ())
    return int(s[i]) if -len(s) <= i < len(s) else 0


def _y_shape(x, u, u_transposed):
    return (_dim(x, 0), _dim(u, -1 if u_transposed else -2))


def _out(x, u, u_transposed, out, accumulate, op):
    """The y slot of _C.bem: out, True (allocate), or a numpy array made here."""
    if out is not None:
        return out
    if accumulate:
        raise _C.ArgumentError("%s: accumulate=True adds the update into out, which is None" % op)
    np = _numpy_of(x)
    return np.empty(_y_shape(x, u, u_transposed), dtype=x.dtype) if np is not None else True


def _ins(x, v, codes, u, offsets, scales):
    return (x, v, codes, u, offsets, scales)


def bem_update(x, v, codes, u, *, scale=1.0, offsets=None, scales=None, accumulate=False, u_transposed=False,
               out=None, ctx=None, stream=None):
    """The BEM update (LoRA whose rank channels are gated per token by
    codes), in one fused kernel:

        ΔY = s_a · ((x·V_a) ∘ codes) · U_aᵀ,   s_a = scale · (scales[a] if scales is not None else 1)
        out = ΔY, or out += ΔY with accumulate=True (out required)

    Shapes:  x [M, d_in], codes [M, r] (rank r in 1..128), out [M, d_out];
             one adapter: v [d_in, r], u [d_out, r];
             segments: v [A, d_in, r], u [A, d_out, r] and offsets [A + 1]
             int32/int64 on the device: rows [o_a, o_{a+1}) use adapter a
             (ends clamped to a running maximum within [0, M]; rows in no
             segment get ΔY = 0); scales [A] f32 (optional, [1] for one
             adapter).
    u_transposed: u given as [r, d_out] ([A, r, d_out]), the seed's
             pre-transposed layout, read through strides without a copy.
    Dtypes:  x, v, codes, u and out all f32, f16 or bf16. On CUDA x, codes
             and out need a unit column stride; v and u take any strides.
    Returns out.
    """
    op = "smelt.bem_update"
    if _pkg._is_compiling():
        return _pkg._torch_impl.bem_update(x, v, codes, u, scale=scale, offsets=offsets, scales=scales,
                                           accumulate=accumulate, u_transposed=u_transposed, out=out)
    y = _out(x, u, u_transposed, out, accumulate, op)
    return _C.bem(_UPDATE, float(scale), int(bool(accumulate)), bool(u_transposed), _ins(x, v, codes, u, offsets,
                                                                                          scales), (), (y,), ctx,
                  stream)[0]


def bem_backward(dy, x, v, codes, u, *, scale=1.0, offsets=None, scales=None, u_transposed=False, needs=None,
                 out=None, ctx=None, stream=None):
    """Gradients of sum(ΔY ∘ dy) for smelt.bem_update with the same
    arguments (A = x·V, H = A ∘ codes):

        dH = s·dy·U;  du = s·dyᵀ·H;  dcodes = dH ∘ A;  dA = dH ∘ codes;
        dv = xᵀ·dA;   dx = dA·Vᵀ

    dy:      [M, d_out], dL/dΔY (accumulate does not change the gradients).
    needs:   which gradients, among 'dx', 'dv', 'du', 'dcodes'; None = all.
    out:     dict of the same names to tensors to write (overwritten).
    Rows in no segment get zero dx and dcodes. On CUDA the backward of one
    adapter runs (composed of GEMMs and Hadamard passes); with offsets it
    is the CPU backend's only (UnsupportedError on CUDA).
    Returns a dict name -> gradient, each shaped like what it
    differentiates (du like u as given, transposed or not).
    """
    op = "smelt.bem_backward"
    out = dict(out or {})
    # A gradient given an out tensor is asked for, on every path.
    needs = list(GRADS) if needs is None else list(needs) + [n for n in out if n not in needs]
    for n in needs:
        if n not in GRADS:
            raise _C.ArgumentError("%s: no gradient named %r (known: %s)" % (op, n, ", ".join(GRADS)))
    if _pkg._is_compiling():
        got = _pkg._torch_impl.bem_backward(dy, x, v, codes, u, scale=scale, offsets=offsets, scales=scales,
                                            u_transposed=u_transposed, needs=needs)
        return {n: _pkg._torch_impl._into(got[n], out.get(n)) for n in got}
    np = _numpy_of(x)
    like = dict(zip(GRADS, (x, v, u, codes)))

    def slot(n):
        if out.get(n) is not None:
            return out[n]
        if n not in needs:
            return None
        return np.empty(like[n].shape, like[n].dtype) if np is not None else True

    r = _C.bem(_BACKWARD, float(scale), 0, bool(u_transposed), _ins(x, v, codes, u, offsets, scales), (dy,),
               tuple(slot(n) for n in GRADS), ctx, stream)
    return {n: t for n, t in zip(GRADS, r) if t is not None}


def bem_validate(x, v, codes, u, *, scale=1.0, offsets=None, scales=None, accumulate=False, u_transposed=False,
                 out=None, tolerance=0.0, ctx=None, stream=None):
    """Runs smelt.bem_update (same arguments) into out, then the CPU
    reference on host copies of the inputs (and of out before the run, with
    accumulate), and compares: a dict of max_abs (max |got − ref|),
    max_rel (max_abs / max |ref|), rel_l2 (‖got − ref‖ / ‖ref‖), worst (the
    row-major index of the max_abs element), tolerance (applied to max_rel;
    tolerance <= 0 takes the library's bound for the dtype and device, the
    tests' own), passed (max_rel <= tolerance, NaN/Inf only where the
    reference has them), and out (holding the update's result). Waits for
    the device."""
    y = _out(x, u, u_transposed, out, accumulate, "smelt.bem_validate")
    y, check = _C.bem(_VALIDATE, float(scale), int(bool(accumulate)), bool(u_transposed),
                      _ins(x, v, codes, u, offsets, scales), (float(tolerance),), (y,), ctx, stream)
    check["out"] = y
    return check


def bem_benchmark(x, v, codes, u, *, scale=1.0, scales=None, accumulate=False, u_transposed=False, out=None,
                  warmup=10, iters=50, ctx=None, stream=None):
    """Times, with the caller's tensors (out is overwritten; one adapter,
    no offsets), the fused update, its unfused execution as torch eager
    runs it (A = x·V, H = s·A∘codes, y = H·Uᵀ: three launches with A and H
    in memory) and the frozen base layer x·Wᵀ (a GEMM with a W [d_out, d_in]
    of its own): warmup untimed runs, then the median of iters. Returns a
    dict of fused_ms, unfused_ms, speedup (unfused / fused), base_ms,
    overhead_pct (100 · fused / base: what the update adds to the base
    layer run before it) and fused_gbps (bytes of x, codes, v, u and out /
    fused time). On the CPU backend the times are the references'."""
    y = _out(x, u, u_transposed, out, accumulate, "smelt.bem_benchmark")
    return _C.bem(_BENCHMARK, float(scale), int(bool(accumulate)), bool(u_transposed),
                  _ins(x, v, codes, u, None, scales), (int(warmup), int(iters)), (y,), ctx, stream)
