"""smelt: fused GPU kernels for machine learning, from Python.

Tensors go in through DLPack: numpy arrays, torch tensors, cupy and jax
arrays, or anything else with ``__dlpack__`` and ``__dlpack_device__``. Nothing
is copied. Outputs are written into the ``out=`` tensors you pass, or
allocated by the inputs' own framework (numpy for numpy, torch for torch);
for other producers smelt allocates a :class:`smelt.Tensor`, which exports
DLPack itself (``torch.from_dlpack(t)``, ``numpy.from_dlpack(t)``).

Devices and streams. Each op runs on the context of its tensors' device
(``smelt.default_context("cuda:0")``) unless ``ctx=`` is given. On CUDA it is
queued on the producer's current stream (``torch.cuda.current_stream()`` for
torch tensors; the legacy default stream for producers that do not publish
one) or on ``stream=`` (an int CUstream, a ``torch.cuda.Stream``, ...). smelt
never synchronizes behind your back: the call returns once the work is queued.

Errors. smelt's statuses become exceptions that derive from both
:class:`smelt.Error` and the Python class you would expect: ``ValueError``
for shapes, layouts and arguments (:class:`ArgumentError`), ``TypeError`` for
dtypes (:class:`DTypeError`), ``RuntimeError`` for devices, drivers and
compilation (:class:`BackendError`, :class:`OutOfMemoryError`,
:class:`UnsupportedError`). The message is smelt's own: op, tensor,
constraint, value seen.

torch. ``smelt.torch`` registers every op as a ``torch.library.custom_op``
(``torch.ops.smelt.*``) with fake-tensor and autograd support, so
``torch.compile`` traces them without graph breaks; it is imported
automatically when torch is. Inside ``torch.compile`` the functions below
route to those custom ops.
"""

import sys as _sys

from . import _smelt as _C
from ._smelt import (  # noqa: F401
    ACTIVATIONS,
    ArgumentError,
    BackendError,
    Context,
    DTypeError,
    Error,
    OutOfMemoryError,
    Tensor,
    UnsupportedError,
    default_context,
    info,
)

__version__ = _C.__version__
__all__ = [
    "ACTIVATIONS", "ArgumentError", "BackendError", "Context", "DTypeError", "Error", "OutOfMemoryError",
    "Tensor", "UnsupportedError", "activation", "attention", "attention_backward", "attention_varlen",
    "default_context", "empty", "gemm", "info", "softmax", "topk",
]

_c_activation = _C.activation
_c_softmax = _C.softmax
_c_topk = _C.topk
_c_gemm = _C.gemm
_c_attention = _C.attention
_c_attention_backward = _C.attention_backward


def _probe_torch():
    """True while torch.compile traces. Until torch is imported this is a
    cheap check; once it is, smelt.torch registers the custom ops and
    replaces this function with torch.compiler.is_compiling."""
    if "torch" in _sys.modules:
        try:
            from . import torch as _smelt_torch  # noqa: F401  (sets _is_compiling)
        except Exception:  # a torch too old for custom ops: stay eager
            globals()["_is_compiling"] = _never
            return False
        return _is_compiling()
    return False


def _never():
    return False


_is_compiling = _probe_torch
_torch_impl = None  # smelt.torch, once imported


def empty(shape, dtype="f32", device="cpu", ctx=None):
    """Uninitialized contiguous :class:`smelt.Tensor` of ``shape`` and smelt
    dtype name ``dtype`` ('f32', 'bf16', 'e4m3', ...) on ``device`` or in
    ``ctx``'s memory (the context's pool on CUDA)."""
    return Tensor(shape, dtype, device=device, ctx=ctx)


def activation(x, act="gelu", slope=0.01, out=None, *, ctx=None, stream=None):
    """y = act(x), elementwise.

    Shapes:  x [...] (any ndim <= 8, any strides)  ->  y [...] (same shape)
    Dtypes:  f32, f16, bf16; y has x's dtype.
    act:     one of smelt.ACTIVATIONS ('identity', 'relu', 'leaky_relu',
             'tanh', 'sigmoid', 'silu', 'hardswish', 'gelu', 'gelu_tanh');
             slope is leaky_relu's negative slope.
    out:     where to write y (any strides; may be x itself: in place).
             None allocates it with x's framework.
    Returns y.
    """
    if _is_compiling():
        return _torch_impl.activation(x, act, slope, out=out)
    if out is None and type(x).__module__ == "numpy":
        out = _sys.modules["numpy"].empty_like(x)
    return _c_activation(x, out, act, slope, ctx, stream)


def softmax(x, out=None, lse=None, return_lse=False, *, ctx=None, stream=None):
    """Softmax over the last dimension.

    Shapes:  x [..., C] (C >= 1, any strides)  ->  y [..., C], lse [...]
    Dtypes:  x and y f32, f16 or bf16 (same); lse f32 (logsumexp of each row).
    A row holding NaN gives NaN (y and lse); a row of all -inf gives y = 0 and
    lse = -inf.
    out, lse: where to write y and the logsumexp (None allocates y; lse is
             only computed when given or when return_lse is true).
    Returns y, or (y, lse) when return_lse is true.
    """
    if _is_compiling():
        return _torch_impl.softmax(x, out=out, lse=lse, return_lse=return_lse)
    want = bool(return_lse)
    if type(x).__module__ == "numpy":
        np = _sys.modules["numpy"]
        if out is None:
            out = np.empty_like(x)
        if lse is None and want:
            lse = np.empty(x.shape[:-1], dtype=np.float32)
    return _c_softmax(x, out, lse, want, ctx, stream)


def _norm_index_dtype(d):
    s = str(d)  # torch.int32 -> 'torch.int32'; numpy.int32 -> "<class 'numpy.int32'>"; dtype('int32') -> 'int32'
    for name in ("int64", "int32"):
        if s.endswith(name) or s.endswith(name + "'>"):
            return name
    return d  # the C layer names what it accepts


def topk(x, k, values=None, indices=None, index_dtype="int64", *, ctx=None, stream=None):
    """The k largest entries of each row (last dimension), largest first.

    Shapes:  x [..., C] (1 <= k <= C, any strides)  ->  values [..., k],
             indices [..., k]
    Dtypes:  x and values f32, f16 or bf16 (same); indices int64 or int32.
    Order:   descending; ties by ascending index; NaN above +inf (as
             torch.topk); -0.0 equals +0.0.
    index_dtype: dtype of allocated indices ('int64', 'int32', torch/numpy
             int dtypes) or None to compute values only (indices is None).
    Returns (values, indices).
    """
    if _is_compiling():
        return _torch_impl.topk(x, k, values=values, indices=indices, index_dtype=index_dtype)
    if index_dtype is not None and index_dtype.__class__ is not str:
        index_dtype = _norm_index_dtype(index_dtype)
    if type(x).__module__ == "numpy":
        np = _sys.modules["numpy"]
        shape = x.shape[:-1] + (k,)
        if values is None:
            values = np.empty(shape, dtype=x.dtype)
        if indices is None and index_dtype is not None:
            indices = np.empty(shape, dtype=np.int32 if index_dtype in ("int32", "i32") else np.int64)
    return _c_topk(x, k, values, indices, index_dtype, ctx, stream)


# numpy dtype names -> smelt dtype names (for gemm's out_dtype).
_DTYPE_NAMES = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "int8": "i8",
                "int32": "i32", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _norm_dtype(d):
    """A smelt dtype name for d: a smelt name, or a torch/numpy dtype."""
    if d is None or d.__class__ is str and d not in _DTYPE_NAMES:
        return d
    s = str(d)  # 'torch.bfloat16', 'float32', "<class 'numpy.float32'>"
    for name, short in _DTYPE_NAMES.items():
        if s == name or s.endswith("." + name) or s.endswith("." + name + "'>"):
            return short
    return s  # the C layer names what it accepts


def gemm(a, b, c=None, bias=None, out=None, *, alpha=1.0, beta=None, activation="identity", slope=0.01,
         math="default", out_dtype=None, ctx=None, stream=None):
    """D = act(alpha · a @ b + beta · c + bias).

    Shapes:  a [M, K], b [K, N], c [M, N], bias [N]  ->  D [M, N]
             batched: a [L, M, K], b [L, K, N], c [L, M, N], bias [N]  ->  D [L, M, N]
             (any strides; row- or column-major operands; stride 0 broadcasts)
    Dtypes:  a, b: f32, f16, bf16, e4m3, e5m2 (any mix, f32 accumulation), f64,
             or i8 x i8 (i32 accumulation); CPU: the reference for all of them.
             D has a's dtype unless out_dtype ('f32', 'bf16', torch.float32, ...)
             or out says otherwise; bias f32/f16/bf16/f64/i32.
    beta:    defaults to 1 when c is given, else 0 (c is not read when beta is 0).
    activation: one of smelt.ACTIVATIONS, after alpha, beta and bias; slope
             is leaky_relu's.
    math:    for f32 operands: 'default' (exact f32), 'tf32' (~3e-4 rel) or
             '3xtf32' (~f32 accuracy on tensor cores).
    out:     where to write D (any strides; may be c exactly, for in place).
    Returns D.
    """
    if beta is None:
        beta = 0.0 if c is None else 1.0
    if _is_compiling():
        return _torch_impl.gemm(a, b, c, bias, out=out, alpha=alpha, beta=beta, activation=activation, slope=slope,
                                math=math, out_dtype=out_dtype)
    if out_dtype is not None:
        out_dtype = _norm_dtype(out_dtype)
    if out is None and type(a).__module__ == "numpy":
        np = _sys.modules["numpy"]
        dt = a.dtype if out_dtype is None else {v: k for k, v in _DTYPE_NAMES.items()}.get(out_dtype, out_dtype)
        out = np.empty(a.shape[:-1] + b.shape[-1:], dtype=dt)
    return _c_gemm(a, b, c, bias, out, float(alpha), float(beta), activation, float(slope), math, out_dtype, ctx,
                   stream)


def _window(window):
    wl, wr = window
    return int(wl), int(wr)


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), return_lse=False, out=None, lse=None,
              ctx=None, stream=None):
    """Scaled dot-product attention (FlashAttention-2 semantics).

    O = softmax(scale · q kᵀ, masked) v per (batch, head); query head h reads
    kv head h // (H // Hk) (GQA / MQA).

    Shapes:  q [B, Sq, H, D], k and v [B, Sk, Hk, D] (H a multiple of Hk; unit
             stride along D)  ->  o [B, Sq, H, D], lse [B, H, Sq] (f32, natural log)
    Dtypes:  f16, bf16 (CUDA; head dims 64, 96, 128, 256); f32, f64 too on the CPU.
    causal:  bottom-right aligned (the last query sees every key).
    scale:   softmax scale; None = 1/sqrt(D).
    window:  (left, right) keys a query sees around its diagonal; -1 = unbounded.
    A query that sees no key gets o = 0 and lse = +inf.
    Returns o, or (o, lse) when return_lse is true.
    """
    wl, wr = _window(window)
    if _is_compiling():
        return _torch_impl.attention(q, k, v, causal=causal, scale=scale, window=(wl, wr), return_lse=return_lse,
                                     out=out, lse=lse)
    want = bool(return_lse) or lse is not None
    if type(q).__module__ == "numpy":
        np = _sys.modules["numpy"]
        if out is None:
            out = np.empty(q.shape, dtype=q.dtype)
        if lse is None and want:
            lse = np.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=np.float32)
    r = _c_attention(q, k, v, out, lse, want, None, None, 0.0 if scale is None else float(scale), bool(causal), wl,
                     wr, 0, 0, ctx, stream)
    return r if return_lse or not want else r[0]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window=(-1, -1), return_lse=False, out=None, lse=None, ctx=None, stream=None):
    """Attention over packed sequences of different lengths.

    Shapes:  q [Tq, H, D], k and v [Tk, Hk, D]; cu_seqlens_q, cu_seqlens_k
             int32 [B + 1] on the tensors' device (start at 0, non-decreasing,
             end at Tq / Tk; sequence b is rows cu[b] .. cu[b+1]-1; lengths may
             be 0)  ->  o [Tq, H, D], lse [H, Tq] (f32)
    max_seqlen_q / max_seqlen_k: at least the longest sequence (sizes the GPU grid).
    Masking, dtypes and the rest as smelt.attention, per sequence.
    Returns o, or (o, lse) when return_lse is true.
    """
    wl, wr = _window(window)
    want = bool(return_lse) or lse is not None
    if type(q).__module__ == "numpy":
        np = _sys.modules["numpy"]
        if out is None:
            out = np.empty(q.shape, dtype=q.dtype)
        if lse is None and want:
            lse = np.empty((q.shape[1], q.shape[0]), dtype=np.float32)
    r = _c_attention(q, k, v, out, lse, want, cu_seqlens_q, cu_seqlens_k, 0.0 if scale is None else float(scale),
                     bool(causal), wl, wr, int(max_seqlen_q), int(max_seqlen_k), ctx, stream)
    return r if return_lse or not want else r[0]


def attention_backward(q, k, v, o, d_o, lse, *, causal=False, scale=None, window=(-1, -1), cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, dq=None, dk=None, dv=None, ctx=None,
                       stream=None):
    """Gradients of attention: (dq, dk, dv) from q, k, v, the forward's o and
    lse, and d_o = dL/do, with the forward's causal/scale/window.

    Shapes:  as smelt.attention (batched) or smelt.attention_varlen (when
             cu_seqlens_q/_k are given); dq like q, dk like k, dv like v
             (dk, dv summed over each kv head's query heads).
    Dtypes:  f16, bf16 (CUDA; head dims 64, 96, 128); f32, f64 too on the CPU.
    The context's deterministic mode makes the result bitwise repeatable.
    Returns (dq, dk, dv).
    """
    wl, wr = _window(window)
    if type(q).__module__ == "numpy":
        np = _sys.modules["numpy"]
        dq = np.empty(q.shape, q.dtype) if dq is None else dq
        dk = np.empty(k.shape, q.dtype) if dk is None else dk
        dv = np.empty(v.shape, q.dtype) if dv is None else dv
    return _c_attention_backward(q, k, v, o, d_o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                 0.0 if scale is None else float(scale), bool(causal), wl, wr, int(max_seqlen_q),
                                 int(max_seqlen_k), ctx, stream)


def __getattr__(name):
    # `smelt.torch` without an explicit import (imports torch).
    if name == "torch":
        import importlib

        return importlib.import_module(__name__ + ".torch")
    raise AttributeError("module 'smelt' has no attribute %r" % name)


if "torch" in _sys.modules:
    _probe_torch()
