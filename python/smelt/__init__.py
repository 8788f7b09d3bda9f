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
one) or on ``stream=`` (an int CUstream, a ``torch.cuda.Stream``, ...; a CPU
context has no streams and refuses one, as the C API does). smelt
never synchronizes behind your back: the call returns once the work is queued
(the one wait is asked for by name: peer_backward's trimmed sparse expert
gradients read their row count back).

Errors. smelt's statuses become exceptions that derive from both
:class:`smelt.Error` and the Python class you would expect: ``ValueError``
for shapes, layouts and arguments (:class:`ArgumentError`), ``TypeError`` for
dtypes and for what is not a tensor (:class:`DTypeError`, naming the
argument), ``RuntimeError`` for devices, drivers and
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

from . import _nvrtc

# NVRTC from this environment's nvidia-cuda-nvrtc wheel, named before the
# extension loads libsmelt.
_nvrtc.name_wheel_library()

from . import _smelt as _C  # noqa: E402
from ._smelt import (  # noqa: F401,E402
    ACTIVATIONS,
    ArgumentError,
    BackendError,
    Context,
    DTypeError,
    Error,
    OutOfMemoryError,
    PeerStore,
    Tensor,
    UnsupportedError,
    default_context,
    info,
)

from .epilogue import Epilogue  # noqa: E402

__version__ = _C.__version__
__all__ = [
    "ACTIVATIONS", "ArgumentError", "BackendError", "Context", "DTypeError", "Epilogue", "Error", "OutOfMemoryError",
    "PeerStore", "Tensor", "UnsupportedError", "activation", "attention", "attention_backward", "attention_decode",
    "attention_varlen", "conv2d", "conv2d_dgrad", "conv2d_wgrad", "default_context", "empty", "gemm", "gemm_grouped",
    "info", "kv_cache_append", "moe", "moe_backward", "peer", "peer_backward", "peer_retrieve", "qgemm", "softmax",
    "topk",
]

_c_activation = _C.activation
_c_softmax = _C.softmax
_c_topk = _C.topk
_c_gemm = _C.gemm
_c_gemm_grouped = _C.gemm_grouped
_c_qgemm = _C.qgemm
_c_attention = _C.attention
_c_attention_backward = _C.attention_backward
_c_attention_decode = _C.attention_decode
_c_kv_cache_append = _C.kv_cache_append
_c_conv2d = _C.conv2d
_c_peer = _C.peer
_c_moe = _C.moe


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


_ML_DTYPES = {"bf16": ("bfloat16", "uint16"), "e4m3": ("float8_e4m3fn", "uint8"), "e5m2": ("float8_e5m2", "uint8")}


def _tensor_numpy(self):
    """This CPU tensor as a numpy array sharing its memory (bf16 and fp8
    need the ml_dtypes package: numpy has no such dtypes, and its from_dlpack
    refuses them). The array keeps the tensor alive."""
    import numpy as np
    if self.device != "cpu":
        raise ArgumentError("smelt.Tensor.numpy: the tensor is on %s; numpy reads host memory only" % self.device)
    if self.dtype not in _ML_DTYPES:
        return np.from_dlpack(self)
    name, raw = _ML_DTYPES[self.dtype]
    try:
        import ml_dtypes
    except ImportError:
        raise DTypeError("smelt.Tensor.numpy: numpy has no %s without the ml_dtypes package: pip install ml_dtypes"
                         % name) from None
    import ctypes
    itemsize = np.dtype(raw).itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.strides)) if all(self.shape) else 0
    buf = (ctypes.c_uint8 * (span * itemsize)).from_address(self.data_ptr) if span else bytearray()
    if span:
        buf._smelt_tensor = self  # the array's buffer keeps the tensor's memory alive
    flat = np.frombuffer(buf, dtype=raw)
    view = np.lib.stride_tricks.as_strided(flat, self.shape, [s * itemsize for s in self.strides])
    return view.view(getattr(ml_dtypes, name))


def _tensor_array(self, dtype=None, copy=None):
    """numpy's protocol: a view when it can be one, unless copy=True."""
    a = _tensor_numpy(self)
    if dtype is not None:
        return a.astype(dtype, copy=bool(copy))
    return a.copy() if copy else a


# smelt.Tensor is a C type; its numpy conversions live here with the rest of
# the numpy handling. np.asarray(t) goes through __array__.
Tensor.numpy = _tensor_numpy
Tensor.__array__ = _tensor_array


def empty(shape, dtype="f32", device=None, ctx=None):
    """Uninitialized contiguous :class:`smelt.Tensor` of ``shape`` and smelt
    dtype name ``dtype`` ('f32', 'bf16', 'e4m3', ...) on ``device`` or in
    ``ctx``'s memory (the context's pool on CUDA). ``device=None`` is
    ``SMELT_DEVICE`` when set, else 'cuda' when a GPU is present, else 'cpu'
    (the smelt command's rule)."""
    return Tensor(shape, dtype, device=device, ctx=ctx)


def _shape(t, name, op):
    """t's shape, where the Python layer reads one before the C layer sees
    t: what has none raises as the C layer would for a non-tensor, naming
    the argument (the C layer checks the rest)."""
    if not hasattr(t, "shape"):
        raise DTypeError("%s: %s must be a DLPack tensor (numpy, torch, cupy, jax, ... with __dlpack__ and "
                         "__dlpack_device__), got %s" % (op, name, type(t).__name__))
    return tuple(t.shape)


def activation(x, act="gelu", slope=0.01, out=None, *, ctx=None, stream=None):
    """y = act(x), elementwise.

    Shapes:  x [...] (any ndim <= 8, any non-negative strides)  ->  y [...] (same shape)
    Dtypes:  f32, f16, bf16; y has x's dtype.
    act:     one of smelt.ACTIVATIONS ('identity', 'relu', 'leaky_relu',
             'tanh', 'sigmoid', 'silu', 'hardswish', 'gelu', 'gelu_tanh');
             slope is leaky_relu's negative slope.
    out:     where to write y (any non-negative strides; may be x itself: in place).
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

    Shapes:  x [..., C] (C >= 1, any non-negative strides)  ->  y [..., C], lse [...]
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

    Shapes:  x [..., C] (1 <= k <= C, any non-negative strides)  ->  values [..., k],
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
        k = _int(k, "k", "smelt.topk", 1, x.shape[-1] if x.ndim else 0, " (x.shape[-1])")
        shape = x.shape[:-1] + (k,)
        if values is None:
            values = np.empty(shape, dtype=x.dtype)
        if indices is None and index_dtype is not None:
            indices = np.empty(shape, dtype=np.int32 if index_dtype in ("int32", "i32") else np.int64)
    return _c_topk(x, k, values, indices, index_dtype, ctx, stream)


# numpy dtype names -> smelt dtype names (for gemm's out_dtype).
_DTYPE_NAMES = {"float64": "f64", "float32": "f32", "float16": "f16", "bfloat16": "bf16", "int8": "i8",
                "int32": "i32", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _numpy_empty(shape, dtype, op):
    """np.empty of a numpy dtype or a smelt name; bf16 and fp8 come from
    ml_dtypes, which numpy needs for them."""
    np = _sys.modules["numpy"]
    if dtype.__class__ is str:
        name = {v: k for k, v in _DTYPE_NAMES.items()}[dtype]
        if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            try:
                import ml_dtypes
            except ImportError:
                raise DTypeError("%s: numpy has no %s without the ml_dtypes package: pip install ml_dtypes, or "
                                 "pass out=" % (op, name)) from None
            dtype = getattr(ml_dtypes, name)
        else:
            dtype = name
    return np.empty(shape, dtype=dtype)


def _norm_dtype(d):
    """A smelt dtype name for d: a smelt name, or a torch/numpy dtype."""
    if d is None or d.__class__ is str and d not in _DTYPE_NAMES:
        return d
    s = str(d)  # 'torch.bfloat16', 'float32', "<class 'numpy.float32'>"
    for name, short in _DTYPE_NAMES.items():
        if s == name or s.endswith("." + name) or s.endswith("." + name + "'>"):
            return short
    return s  # the C layer names what it accepts


_SCALE_FORMATS = {None: 0, "fp8-block": 1}


def gemm(a, b, c=None, bias=None, out=None, *, alpha=1.0, beta=None, activation="identity", slope=0.01,
         math="default", out_dtype=None, scale_a=None, scale_b=None, format=None, epilogue=None, ctx=None, stream=None):
    """D = act(alpha · scale_a[m] · scale_b[n] · (a @ b)[m, n] + beta · c + bias).

    Shapes:  a [M, K], b [K, N], c [M, N], bias [N]  ->  D [M, N]
             batched: a [L, M, K], b [L, K, N], c [L, M, N], bias [N]  ->  D [L, M, N]
             (any non-negative strides; row- or column-major operands; stride 0 broadcasts)
    Dtypes:  a, b: f32, f16, bf16, e4m3, e5m2 (any mix, f32 accumulation), f64,
             or i8 x i8 (i32 accumulation); CPU: the reference for all of them.
             D has a's dtype unless out_dtype ('f32', 'bf16', torch.float32, ...)
             or out says otherwise; bias f32/f16/bf16/f64/i32.
    beta:    defaults to 1 when c is given, else 0 (c is not read when beta is 0).
    activation: one of smelt.ACTIVATIONS, after alpha, beta and bias; slope
             is leaky_relu's.
    math:    for f32 operands: 'default' (exact f32), 'tf32' (~3e-4 rel) or
             '3xtf32' (~f32 accuracy on tensor cores).
    scale_a, scale_b: optional f32 row scales of a ([M] or [M, 1]) and
             column scales of b ([N] or [1, N]), torch._scaled_mm's row-wise
             form (shared by every batch entry); they scale the product
             only, before c and bias are added. Not under torch.compile.
    format:  None (the row and column scales above) or 'fp8-block', DeepGEMM's
             block-scaled fp8 as smelt.quantize writes it: a e4m3/e5m2 [M, K]
             with scale_a [M, ceil(K/128)] ('fp8-1x128'), b the [K, N] view of a
             [N, K] tensor with scale_b [ceil(N/128), ceil(K/128)]
             ('fp8-128x128'); each 128 of K is summed apart and scaled by its
             blocks' scales (batched: scales [L, ...]). CUDA: Hopper only.
    epilogue: a smelt.Epilogue (an epilogue graph: its own stores and
             row/column reductions; see smelt.epilogue) for 2-D a and b;
             activation must then be 'identity' and the scales None. Eager
             only (not under torch.compile).
    out:     where to write D (any non-negative strides; may be c exactly, for in place).
    Returns D.
    """
    if format not in _SCALE_FORMATS:
        raise ArgumentError("smelt.gemm: format=%r is not one of %s" % (format, ", ".join(map(repr, _SCALE_FORMATS))))
    if beta is None:
        beta = 0.0 if c is None else 1.0
    if epilogue is not None:
        if format is not None:
            raise ArgumentError("smelt.gemm: format=%r takes the fixed epilogue, not epilogue=" % (format,))
        return _gemm_epilogue(a, b, c, bias, out, alpha, beta, activation, math, out_dtype, scale_a, scale_b,
                              epilogue, ctx, stream)
    if (scale_a is not None or scale_b is not None) and _is_compiling():
        raise ArgumentError("smelt.gemm: scale_a and scale_b are not supported under torch.compile")
    if _is_compiling():
        return _torch_impl.gemm(a, b, c, bias, out=out, alpha=alpha, beta=beta, activation=activation, slope=slope,
                                math=math, out_dtype=out_dtype)
    if out_dtype is not None:
        out_dtype = _norm_dtype(out_dtype)
        if out_dtype not in _DTYPE_NAMES.values():
            raise DTypeError("smelt.gemm: out_dtype=%r is not one of %s (or a torch/numpy dtype of those)"
                             % (out_dtype, ", ".join(_DTYPE_NAMES.values())))
    if out is None and type(a).__module__ == "numpy":
        out = _numpy_empty(a.shape[:-1] + b.shape[-1:], a.dtype if out_dtype is None else out_dtype, "smelt.gemm")
    return _c_gemm(a, b, c, bias, out, float(alpha), float(beta), activation, float(slope), math, out_dtype, ctx,
                   stream, scale_a, scale_b, _SCALE_FORMATS[format])


def qgemm(x, w_q, w_scales, w_tensor_scale, bias=None, out=None, *, format="nvfp4", alpha=1.0,
          activation="identity", slope=0.01, out_dtype=None, ctx=None, stream=None):
    """D = act(alpha · x @ dequant(W)ᵀ + bias), W given quantized (W4A16).

    The quantized GEMM manager: the weights' format name picks the kernel.
    Shapes:  x [M, K]; W [N, K] as an nn.Linear's weight [out, in] stores it,
             quantized as smelt's quantizer writes it (format 'nvfp4'):
             w_q [N, K/2] uint8 (E2M1 pairs, element 2j in the low nibble),
             w_scales [N, K/16] e4m3 (float8_e4m3fn, or its bytes as uint8),
             w_tensor_scale [1] f32; bias [N]  ->  D [M, N].
             K must be a multiple of 16.
    dequant: W[n, k] = e2m1(w_q) · e4m3(w_scales[n, k // 16]) · w_tensor_scale,
             exactly. x bf16 or f16 (the implemented pair: nvfp4 weights with
             16-bit activations; other formats raise UnsupportedError).
    D has x's dtype unless out_dtype ('f32', 'f16', 'bf16') or out says
    otherwise. activation: one of smelt.ACTIVATIONS, applied last.
    Returns D.
    """
    if out_dtype is not None:
        out_dtype = _norm_dtype(out_dtype)
    if out is None and type(x).__module__ == "numpy":
        out = _numpy_empty((x.shape[0], w_q.shape[0]), x.dtype if out_dtype is None else out_dtype, "smelt.qgemm")
    return _c_qgemm(x, w_q, w_scales, w_tensor_scale, bias, out, format, float(alpha), activation, float(slope),
                    out_dtype, ctx, stream)


def _gemm_epilogue(a, b, c, bias, out, alpha, beta, activation, math, out_dtype, scale_a, scale_b, epilogue, ctx,
                   stream):
    """smelt.gemm with an epilogue graph (smelt/epilogue.h) through _smelt.gemm_epi."""
    if not isinstance(epilogue, Epilogue):
        raise ArgumentError("smelt.gemm: epilogue must be a smelt.Epilogue, got %r" % (type(epilogue).__name__,))
    if activation != "identity" or scale_a is not None or scale_b is not None or _is_compiling():
        raise ArgumentError("smelt.gemm: an epilogue graph takes no activation or scales (write them as nodes) "
                            "and does not run under torch.compile")
    if out is None:
        shape = tuple(a.shape[:-1]) + tuple(b.shape[-1:])
        if type(a).__module__ == "numpy":
            out = _numpy_empty(shape, a.dtype if out_dtype is None else _norm_dtype(out_dtype), "smelt.gemm")
        elif type(a).__module__.startswith("torch") and out_dtype is None:
            out = a.new_empty(shape)
        else:
            raise ArgumentError("smelt.gemm: with an epilogue graph, pass out= (or numpy inputs, or torch ones "
                                "without out_dtype)")
    nodes, out_node, slots = epilogue._args()
    return _C.gemm_epi(a, b, c, bias, out, float(alpha), float(beta), math, ctx, stream, nodes, out_node, slots)


def gemm_grouped(a, b, offs, c=None, bias=None, out=None, *, alpha=1.0, beta=None, activation="identity",
                 slope=0.01, math="default", scale_a=None, scale_b=None, format=None, ctx=None, stream=None):
    """Grouped GEMM by device offsets (the MoE form, torch._grouped_mm's).

    Group g owns rows [offs[g-1], offs[g]) of a (offs[-1] = 0) and computes
    D[r] = act(alpha · a[r] @ b[g] + beta · c[r] + bias[g]) there.

    Shapes:  a [T, K], b [G, K, N] (any non-negative strides; the transposed view of a
             [G, N, K] tensor is the tensor cores' fast layout), c [T, N],
             bias [G, N], offs [G]  ->  D [T, N]
    Dtypes:  a, b, c, bias as smelt.gemm's; offs int32 or int64, in the
             context's memory (host memory on the CPU backend).
    offs:    cumulative row ends, read only on the device when the GEMM runs
             (no host sync; it may be written by earlier work on the stream).
             Not validated: each end is clamped to the running maximum and
             to T, so a decreasing offset gives an empty group and nothing
             outside D is written.
    beta, activation, slope, math: as smelt.gemm's.
    scale_a, scale_b: optional f32 row scales of the stacked a ([T] or
             [T, 1]) and column scales of each group's b ([G, N]): D[r] =
             act(alpha · scale_a[r] · scale_b[g] · (a[r] @ b[g]) + ...). Not
             under torch.compile.
    format:  None (the scales above) or 'fp8-block' (as smelt.gemm's): a
             e4m3/e5m2 [T, K] with scale_a [T, ceil(K/128)], b the [G, K, N]
             view of [G, N, K] with scale_b [G, ceil(N/128), ceil(K/128)].
    out:     where to write D (may be c exactly, for in place). Rows at or
             past offs[-1] are not written: a new D (out=None) is
             zero-filled, so they read 0; a given out keeps its values there.
             out=None needs numpy or torch inputs (others, and torch on a GPU
             with stream=: pass out).
    Returns D.
    """
    if format not in _SCALE_FORMATS:
        raise ArgumentError("smelt.gemm_grouped: format=%r is not one of %s"
                            % (format, ", ".join(map(repr, _SCALE_FORMATS))))
    if beta is None:
        beta = 0.0 if c is None else 1.0
    if (scale_a is not None or scale_b is not None) and _is_compiling():
        raise ArgumentError("smelt.gemm_grouped: scale_a and scale_b are not supported under torch.compile")
    if _is_compiling():
        return _torch_impl.gemm_grouped(a, b, offs, c, bias, out=out, alpha=alpha, beta=beta, activation=activation,
                                        slope=slope, math=math)
    if out is None:
        shape, b_shape = _shape(a, "a", "smelt.gemm_grouped"), _shape(b, "b", "smelt.gemm_grouped")
        if len(shape) != 2 or len(b_shape) != 3:
            raise ArgumentError("smelt.gemm_grouped: a must be 2-D [T, K] and b 3-D [G, K, N], got %d-D and %d-D"
                                % (len(shape), len(b_shape)))
        shape = (shape[0], b_shape[2])
        mod = type(a).__module__
        if mod == "numpy":
            out = _sys.modules["numpy"].zeros(shape, dtype=a.dtype)
        elif mod.startswith("torch"):
            if stream is not None and a.device.type != "cpu":
                # torch would zero it on its current stream, unordered with stream=.
                raise ArgumentError("smelt.gemm_grouped: with stream= on a GPU, pass out= (a [T, N] tensor zeroed "
                                    "on that stream, or one whose rows past offs[-1] may keep their values)")
            out = _sys.modules["torch"].zeros(shape, dtype=a.dtype, device=a.device)
        else:
            raise ArgumentError("smelt.gemm_grouped: out=None makes D only for numpy or torch inputs; pass out= "
                                "(a [T, N] tensor; rows at or past offs[-1] are not written)")
    return _c_gemm_grouped(a, b, offs, c, bias, out, float(alpha), float(beta), activation, float(slope), math, ctx,
                           stream, scale_a, scale_b, _SCALE_FORMATS[format])


def _int(v, name, op, lo, hi=None, what=""):
    """v as an int in [lo, hi], else smelt.ArgumentError naming the argument:
    checked here because numpy outputs are sized from it before C sees it."""
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise DTypeError("%s: %s=%r must be an int" % (op, name, v))
    v = int(v.__index__())
    if v < lo or (hi is not None and v > hi):
        raise ArgumentError("%s: %s=%d must be in [%d, %s]%s" % (op, name, v, lo, "inf" if hi is None else hi, what))
    return v


def _window(window, op):
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ArgumentError("%s: window=%r must be (left, right), each -1 (unbounded) or >= 0" % (op, window))
    return tuple(_int(w, "window[%d]" % i, op, -1, what=" (-1 = unbounded)") for i, w in enumerate(window))


def _softcap(softcap, op):
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise DTypeError("%s: softcap=%r must be a number (0 = none)" % (op, softcap))
    return float(softcap)


def _numpy_out_lse(q, out, lse, want, lse_shape):
    """The outputs of an attention call on numpy arrays, made here when not
    given: o like q, lse of lse_shape() in f32 when wanted. Other frameworks'
    outputs are made in C."""
    if type(q).__module__ == "numpy":
        np = _sys.modules["numpy"]
        if out is None:
            out = np.empty(q.shape, dtype=q.dtype)
        if lse is None and want:
            lse = np.empty(lse_shape(), dtype=np.float32)
    return out, lse


def _attention_call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window, return_lse, out, lse, ctx, stream,
                    lse_shape, softcap, alibi_slopes, sinks):
    """The forward call of attention and attention_varlen: numpy outputs made
    here (lse of lse_shape()), the rest in C."""
    want = bool(return_lse) or lse is not None
    out, lse = _numpy_out_lse(q, out, lse, want, lse_shape)
    r = _c_attention(q, k, v, out, lse, want, cu_q, cu_k, 0.0 if scale is None else float(scale), bool(causal),
                     window[0], window[1], max_q, max_k, ctx, stream, softcap, alibi_slopes, sinks)
    return r if return_lse or not want else r[0]


def attention(q, k, v, *, causal=False, scale=None, window=(-1, -1), return_lse=False, out=None, lse=None,
              ctx=None, stream=None, softcap=0.0, alibi_slopes=None, sinks=None, deterministic=None):
    """Scaled dot-product attention (FlashAttention-2 semantics).

    O = softmax(scale · q kᵀ, masked) v per (batch, head); query head h reads
    kv head h // (H // Hk) (GQA / MQA).

    Shapes:  q [B, Sq, H, D], k and v [B, Sk, Hk, D] (H a multiple of Hk; unit
             stride along D)  ->  o [B, Sq, H, D], lse [B, H, Sq] (f32, natural log)
    Dtypes:  f16, bf16 (CUDA; head dims 64, 96, 128, 256); f32, f64 too on the CPU.
    causal:  bottom-right aligned (the last query sees every key); with a
             window, the intersection of both masks.
    scale:   softmax scale; None = 1/sqrt(D).
    window:  (left, right) keys a query sees around its diagonal; -1 = unbounded.
    softcap: > 0: each scaled score s becomes softcap · tanh(s / softcap).
    alibi_slopes: f32 [H] or None: s - slope[h] · |i + Sk - Sq - j| (FlashAttention's).
    sinks:   f32 [H] or None: a logit per head added to the softmax's
             denominator (lse includes it; its rows' weights sum below 1).
    deterministic: the backward's mode where one follows (torch autograd
             inside torch.compile); the forward is always deterministic.
    A query that sees no key gets o = 0 and lse = +inf.
    Returns o, or (o, lse) when return_lse is true.
    """
    wl, wr = _window(window, "smelt.attention")
    softcap = _softcap(softcap, "smelt.attention")
    if _is_compiling():
        return _torch_impl.attention(q, k, v, causal=causal, scale=scale, window=(wl, wr), return_lse=return_lse,
                                     out=out, lse=lse, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                                     deterministic=deterministic)
    return _attention_call(q, k, v, None, None, 0, 0, causal, scale, (wl, wr), return_lse, out, lse, ctx, stream,
                           lambda: (q.shape[0], q.shape[2], q.shape[1]), softcap, alibi_slopes, sinks)


def attention_decode(q, k_cache, v_cache, block_table, cache_seqlens, *, causal=True, scale=None, return_lse=False,
                     out=None, lse=None, ctx=None, stream=None):
    """Attention of a few new queries per sequence over a paged KV cache
    (decode and chunked prefill; smelt/attention_decode.h).

    Shapes:  q [B, Sq, H, D] (Sq 1..64, the same for every sequence);
             k_cache, v_cache [num_pages, page_size, Hk, D] (H a multiple of Hk);
             block_table int32 [B, max_pages]: the pages of each sequence in order;
             cache_seqlens int32 [B]: tokens in the cache, the Sq new ones included
             (block_table and cache_seqlens on the tensors' device)
             ->  o [B, Sq, H, D], lse [B, H, Sq] (f32, natural log)
    causal:  query i sees positions <= cache_seqlens[b] - Sq + i (else all below cache_seqlens[b]).
    scale:   softmax scale; None = 1/sqrt(D).
    Dtypes:  f16, bf16 (CUDA: head dims 64, 128, any page size); f32, f64 too on the CPU.
    A query that sees nothing gets o = 0 and lse = +inf.
    Returns o, or (o, lse) when return_lse is true.
    """
    want = bool(return_lse) or lse is not None
    out, lse = _numpy_out_lse(q, out, lse, want, lambda: (q.shape[0], q.shape[2], q.shape[1]))
    r = _c_attention_decode(q, k_cache, v_cache, block_table, cache_seqlens, out, lse, want,
                            0.0 if scale is None else float(scale), bool(causal), ctx, stream)
    return r if return_lse or not want else r[0]


def kv_cache_append(k_new, v_new, block_table, cache_seqlens, k_cache, v_cache, *, ctx=None, stream=None):
    """Writes k_new and v_new [B, Snew, Hk, D] into their cache pages, in place:
    row j of sequence b goes to position cache_seqlens[b] + j (cache_seqlens:
    the lengths before the append; it is not changed). Layouts as
    smelt.attention_decode; any dtype (CUDA: rows of whole 16-byte chunks)."""
    _c_kv_cache_append(k_new, v_new, block_table, cache_seqlens, k_cache, v_cache, ctx, stream)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window=(-1, -1), return_lse=False, out=None, lse=None, ctx=None, stream=None, softcap=0.0,
                     alibi_slopes=None, sinks=None, deterministic=None):
    """Attention over packed sequences of different lengths.

    Shapes:  q [Tq, H, D], k and v [Tk, Hk, D]; cu_seqlens_q, cu_seqlens_k
             int32 [B + 1] on the tensors' device (start at 0, non-decreasing,
             end at Tq / Tk; sequence b is rows cu[b] .. cu[b+1]-1; lengths may
             be 0)  ->  o [Tq, H, D], lse [H, Tq] (f32)
    max_seqlen_q / max_seqlen_k: at least the longest sequence (sizes the GPU grid).
    Masking, modifiers, dtypes and the rest as smelt.attention, per sequence.
    Returns o, or (o, lse) when return_lse is true.
    """
    wl, wr = _window(window, "smelt.attention_varlen")
    softcap = _softcap(softcap, "smelt.attention_varlen")
    if _is_compiling():
        return _torch_impl.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            causal=causal, scale=scale, window=(wl, wr), return_lse=return_lse,
                                            out=out, lse=lse, softcap=softcap, alibi_slopes=alibi_slopes,
                                            sinks=sinks, deterministic=deterministic)
    return _attention_call(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), causal, scale,
                           (wl, wr), return_lse, out, lse, ctx, stream, lambda: (q.shape[1], q.shape[0]), softcap,
                           alibi_slopes, sinks)


def attention_backward(q, k, v, o, d_o, lse, *, causal=False, scale=None, window=(-1, -1), cu_seqlens_q=None,
                       cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, dq=None, dk=None, dv=None, ctx=None,
                       stream=None, softcap=0.0, alibi_slopes=None, sinks=None, dsinks=None, deterministic=None):
    """Gradients of attention: (dq, dk, dv) from q, k, v, the forward's o and
    lse, and d_o = dL/do, with the forward's causal/scale/window/modifiers.

    Shapes:  as smelt.attention (batched) or smelt.attention_varlen (when
             cu_seqlens_q/_k are given); dq like q, dk like k, dv like v
             (dk, dv summed over each kv head's query heads); dsinks f32 [H].
    Dtypes:  f16, bf16 (CUDA; head dims 64, 96, 128); f32, f64 too on the CPU.
    deterministic: True: bitwise repeatable gradients (a fixed order of
             additions, somewhat slower); None or False: the context's mode
             (smelt.Context(deterministic=True) makes every call repeatable).
    Returns (dq, dk, dv), and with sinks (dq, dk, dv, dsinks).
    """
    wl, wr = _window(window, "smelt.attention_backward")
    softcap = _softcap(softcap, "smelt.attention_backward")
    if type(q).__module__ == "numpy":
        np = _sys.modules["numpy"]
        dq = np.empty(q.shape, q.dtype) if dq is None else dq
        dk = np.empty(k.shape, q.dtype) if dk is None else dk
        dv = np.empty(v.shape, q.dtype) if dv is None else dv
        if sinks is not None and dsinks is None:
            dsinks = np.empty(sinks.shape, np.float32)
    return _c_attention_backward(q, k, v, o, d_o, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                 0.0 if scale is None else float(scale), bool(causal), wl, wr, int(max_seqlen_q),
                                 int(max_seqlen_k), ctx, stream, softcap, bool(deterministic), alibi_slopes, sinks,
                                 dsinks)


# ---- conv2d

_CONV_LAYOUTS = ("nhwc", "nchw")
# Each tensor argument's dims in layouts 'nhwc' and 'nchw', for messages.
_CONV_DIMS = {"x": ("[N, H, W, C]", "[N, C, H, W]"), "w": ("[K, R, S, C]", "[K, C, R, S]"),
              "dy": ("[N, P, Q, K]", "[N, K, P, Q]")}


def _conv_ints(v, name, op, n, lo):
    """v as n ints >= lo: one int for all, or a tuple or list of n."""
    if not isinstance(v, (tuple, list)):
        return (_int(v, name, op, lo),) * n
    if len(v) != n:
        raise ArgumentError("%s: %s=%r must be an int or %d ints" % (op, name, v, n))
    return tuple(_int(x, "%s[%d]" % (name, i), op, lo) for i, x in enumerate(v))


def _conv_geometry(stride, padding, dilation, op):
    """(pad_h0, pad_h1, pad_w0, pad_w1, stride_h, stride_w, dilation_h,
    dilation_w) of smelt_conv2d_desc: padding an int, (h, w) or (top,
    bottom, left, right); stride and dilation an int or (h, w)."""
    if isinstance(padding, (tuple, list)) and len(padding) == 2:
        ph, pw = _conv_ints(padding, "padding", op, 2, 0)
        pads = (ph, ph, pw, pw)
    elif isinstance(padding, (tuple, list)) and len(padding) == 4:
        pads = _conv_ints(padding, "padding", op, 4, 0)
    elif isinstance(padding, (tuple, list)):
        raise ArgumentError("%s: padding=%r must be an int, (h, w) or (top, bottom, left, right)" % (op, padding))
    else:
        pads = _conv_ints(padding, "padding", op, 4, 0)
    return pads + _conv_ints(stride, "stride", op, 2, 1) + _conv_ints(dilation, "dilation", op, 2, 1)


def _conv_extent(size, f, pad0, pad1, stride, dilation, axis, op):
    """P (axis 'H') or Q ('W'): smelt/conv2d.h's formula, >= 1 or an error."""
    span = dilation * (f - 1) + 1
    if size + pad0 + pad1 < span:
        raise ArgumentError("%s: the dilated filter (%d taps at dilation %d: %d) is larger than the padded input "
                            "(%s=%d, pads %d+%d): no output" % (op, f, dilation, span, axis, size, pad0, pad1))
    return (size + pad0 + pad1 - span) // stride + 1


def _conv_y_shape(x, w, geom, op):
    """fprop's [N, P, Q, K] from NHWC x and KRSC w (4-D)."""
    return (x.shape[0], _conv_extent(x.shape[1], w.shape[1], geom[0], geom[1], geom[4], geom[6], "H", op),
            _conv_extent(x.shape[2], w.shape[2], geom[2], geom[3], geom[5], geom[7], "W", op), w.shape[0])


def _is_torch(t):
    return type(t).__module__.startswith("torch")


def _conv_view(t, name, op, layout, to_nhwc=True):
    """t as smelt takes it: itself (layout 'nhwc'), or NCHW / KCRS seen as
    NHWC / KRSC without a copy (layout 'nchw'; to_nhwc=False: back), after
    checking it is a 4-D tensor. A torch tensor in NCHW with channels_last
    memory given as NHWC is refused: its dims would be taken in the wrong
    order."""
    shape = _shape(t, name, op)
    if len(shape) != 4:
        dims = _CONV_DIMS.get(name, ("", ""))[layout == "nchw"]
        raise ArgumentError("%s: %s must be 4-D%s (layout=%r), got shape %r"
                            % (op, name, " " + dims if dims else "", layout, shape))
    if layout == "nhwc":
        channels_last = _sys.modules["torch"].channels_last if _is_torch(t) else None
        if channels_last is not None and not t.is_contiguous() and t.is_contiguous(memory_format=channels_last):
            raise ArgumentError("%s: %s is an NCHW tensor in channels_last memory; pass layout='nchw' (it is then "
                                "read as NHWC without a copy) or an NHWC tensor" % (op, name))
        return t
    perm = (0, 2, 3, 1) if to_nhwc else (0, 3, 1, 2)
    if _is_torch(t):
        return t.permute(*perm)
    if _is_numpy(t):
        return t.transpose(*perm)
    raise ArgumentError("%s: layout='nchw' takes torch or numpy tensors (%s is %s); pass NHWC tensors"
                        % (op, name, type(t).__name__))


def _conv_shape4(shape, name, op, layout):
    """A 4-int shape argument (x_shape, w_shape) in smelt's order."""
    if not isinstance(shape, (tuple, list)) or len(shape) != 4:  # torch.Size is a tuple
        raise ArgumentError("%s: %s=%r must be 4 ints" % (op, name, shape))
    s = _conv_ints(shape, name, op, 4, 1)
    return s if layout == "nhwc" else (s[0], s[2], s[3], s[1])


def _conv2d_call(kind, op, a, b, c, bias, out, out_shape, geom, alpha, beta, activation, slope, math, out_dtype,
                 layout, ctx, stream):
    """The shared end of conv2d, conv2d_dgrad and conv2d_wgrad: a, b, c, out
    already in smelt's layout; out_shape the result's (NHWC order) for an
    allocated out."""
    if out_dtype is not None:
        out_dtype = _norm_dtype(out_dtype)
        if out_dtype not in _DTYPE_NAMES.values():
            raise DTypeError("%s: out_dtype=%r is not one of %s (or a torch/numpy dtype of those)"
                             % (op, out_dtype, ", ".join(_DTYPE_NAMES.values())))
    if beta is None:
        beta = 0.0 if c is None else 1.0
    given = out
    if out is None and _is_numpy(a):
        out = _numpy_empty(out_shape, a.dtype if out_dtype is None else out_dtype, op)
    elif out is not None:
        out = _conv_view(out, "out", op, layout)
    d = _c_conv2d(kind, a, b, c, bias, out, tuple(out_shape), geom, float(alpha), float(beta), activation,
                  float(slope), math, out_dtype, ctx, stream)
    if given is not None:
        return given
    return d if layout == "nhwc" else _conv_view(d, "out", op, layout, to_nhwc=False)


def _conv_layout(layout, op):
    if layout not in _CONV_LAYOUTS:
        raise ArgumentError("%s: layout=%r is not 'nhwc' or 'nchw'" % (op, layout))


# What conv2d_dgrad (kind 1) and conv2d_wgrad (2) call their operand B and
# the shape argument of their result.
_CONV_GRAD_NAMES = {1: ("smelt.conv2d_dgrad", "w", "x_shape"), 2: ("smelt.conv2d_wgrad", "x", "w_shape")}


def _conv_grad_args(kind, dy, b, shape, geometry, c, out, layout):
    """The checked arguments of conv2d_dgrad or conv2d_wgrad (geometry:
    stride, padding, dilation as given): the op's name, the geometry tuple,
    dy, b and c in smelt's layout and the result's shape in NHWC order."""
    op, b_name, shape_name = _CONV_GRAD_NAMES[kind]
    _conv_layout(layout, op)
    geom = _conv_geometry(*geometry, op)
    dy, b = _conv_view(dy, "dy", op, layout), _conv_view(b, b_name, op, layout)
    if shape is None and out is None:
        raise ArgumentError("%s: give %s (the shape of the result) or out" % (op, shape_name))
    shape = _conv_shape4(shape if shape is not None else _shape(out, "out", op), shape_name, op, layout)
    return op, geom, dy, b, None if c is None else _conv_view(c, "c", op, layout), shape


def _conv_grad(kind, dy, b, shape, geometry, c, out, alpha, beta, math, out_dtype, layout, ctx, stream):
    """conv2d_dgrad (kind 1) or conv2d_wgrad (2); torch's op under torch.compile."""
    if _is_compiling():
        return _torch_impl._conv_grad(kind, dy, b, shape, geometry, c, out, alpha, beta, math, out_dtype, layout)
    op, geom, dy, b, c, shape = _conv_grad_args(kind, dy, b, shape, geometry, c, out, layout)
    return _conv2d_call(kind, op, dy, b, c, None, out, shape, geom, alpha, beta, "identity", 0.01, math, out_dtype,
                        layout, ctx, stream)


def conv2d(x, w, bias=None, c=None, out=None, *, stride=1, padding=0, dilation=1, alpha=1.0, beta=None,
           activation="identity", slope=0.01, math="default", out_dtype=None, layout="nhwc", ctx=None, stream=None):
    """Conv2d forward (fprop) as an implicit GEMM with GEMM's epilogue:

        y[n,p,q,k] = act(alpha · Σ_{r,s,ch} x[n, p·sh − pad_top + r·dh, q·sw − pad_left + s·dw, ch] · w[k,r,s,ch]
                         + beta · c[n,p,q,k] + bias[k])

    (cross-correlation, as torch.nn.functional.conv2d; taps in the padding read 0).

    Shapes:  layout 'nhwc' (the default): x [N, H, W, C], w [K, R, S, C],
             c and y [N, P, Q, K]; layout 'nchw': x [N, C, H, W], w [K, C,
             R, S], c and y [N, K, P, Q] as torch lays them out, read as
             NHWC views without a copy (channels_last tensors are dense
             there; y comes back channels_last). bias [K]. Any non-negative
             strides. P = (H + pad_top + pad_bottom − dh·(R − 1) − 1) // sh + 1,
             Q likewise.
    Dtypes:  x and w f32, f16 or bf16 (one dtype, f32 accumulation); y has
             x's dtype unless out_dtype or out says otherwise; c y's dtype;
             bias f32/f16/bf16.
    stride, dilation: an int or (h, w). padding: an int, (h, w), or (top,
             bottom, left, right).
    beta:    defaults to 1 when c is given, else 0 (c is not read when beta is 0).
    activation: one of smelt.ACTIVATIONS, after alpha, beta and bias; slope
             is leaky_relu's.
    math:    'default' or, for f32 x and w, 'tf32'.
    out:     where to write y (in the call's layout; may be c exactly, for in place).
    Returns y. For autograd use smelt.torch.conv2d (dgrad and wgrad as its backward).
    """
    op = "smelt.conv2d"
    _conv_layout(layout, op)
    if _is_compiling():
        return _torch_impl.conv2d(x, w, bias, c, out=out, stride=stride, padding=padding, dilation=dilation,
                                  alpha=alpha, beta=beta, activation=activation, slope=slope, math=math,
                                  out_dtype=out_dtype, layout=layout)
    geom = _conv_geometry(stride, padding, dilation, op)
    x, w = _conv_view(x, "x", op, layout), _conv_view(w, "w", op, layout)
    if c is not None:
        c = _conv_view(c, "c", op, layout)
    return _conv2d_call(0, op, x, w, c, bias, out, _conv_y_shape(x, w, geom, op), geom, alpha, beta, activation,
                        slope, math, out_dtype, layout, ctx, stream)


def conv2d_dgrad(dy, w, x_shape=None, *, stride=1, padding=0, dilation=1, c=None, out=None, alpha=1.0, beta=None,
                 math="default", out_dtype=None, layout="nhwc", ctx=None, stream=None):
    """Conv2d's input gradient: dx = alpha · (the adjoint of conv2d(·, w) applied
    to dy) + beta · c, for conv2d's stride, padding and dilation (as
    torch.nn.grad.conv2d_input).

    Shapes:  dy [N, P, Q, K], w [K, R, S, C], c and dx [N, H, W, C] (layout
             'nchw': dy [N, K, P, Q], w [K, C, R, S], dx [N, C, H, W]).
             x_shape: the forward input's shape, in the call's layout (H
             and W are not determined by P and Q when the stride is > 1);
             may be None when out is given.
    Dtypes:  dy and w one of f32, f16, bf16; dx dy's dtype unless
             out_dtype or out says otherwise.
    beta:    defaults to 1 when c is given (e.g. to add into a gradient), else 0.
    Returns dx.
    """
    return _conv_grad(1, dy, w, x_shape, (stride, padding, dilation), c, out, alpha, beta, math, out_dtype, layout,
                      ctx, stream)


def conv2d_wgrad(dy, x, w_shape=None, *, stride=1, padding=0, dilation=1, c=None, out=None, alpha=1.0, beta=None,
                 math="default", out_dtype=None, layout="nhwc", ctx=None, stream=None):
    """Conv2d's weight gradient: dw[k,r,s,ch] = alpha · Σ_{n,p,q} dy[n,p,q,k] ·
    x[n, p·sh − pad_top + r·dh, q·sw − pad_left + s·dw, ch] + beta · c, for
    conv2d's stride, padding and dilation (as torch.nn.grad.conv2d_weight).

    Shapes:  dy [N, P, Q, K], x [N, H, W, C], c and dw [K, R, S, C] (layout
             'nchw': dy [N, K, P, Q], x [N, C, H, W], dw [K, C, R, S]).
             w_shape: the filter's shape, in the call's layout; may be None
             when out is given.
    Dtypes:  dy and x one of f32, f16, bf16; dw dy's dtype unless out_dtype
             or out says otherwise.
    beta:    defaults to 1 when c is given (e.g. to accumulate), else 0.
    Returns dw.
    """
    return _conv_grad(2, dy, x, w_shape, (stride, padding, dilation), c, out, alpha, beta, math, out_dtype, layout,
                      ctx, stream)


# ---- PEER


def _is_numpy(x):
    return type(x).__module__ == "numpy"


def _peer_experts(u, v, store, op):
    """(N, h_e, d_out) of the experts: from u and v, or from the store."""
    if store is not None:
        if u is not None or v is not None:
            raise ArgumentError("%s: give either u and v or store=, not both" % op)
        if not isinstance(store, PeerStore):
            raise DTypeError("%s: store must be a smelt.PeerStore or None, got %s" % (op, type(store).__name__))
        return int(store.num_experts), int(store.expert_hidden_size), int(store.output_dim)
    if u is None or v is None:
        raise ArgumentError("%s: u and v are required without store=" % op)
    us, vs = _shape(u, "u", op), _shape(v, "v", op)
    if len(us) != 3 or len(vs) != 3:
        raise ArgumentError("%s: u must be [N, d_in, h_e] and v [N, h_e, d_out], got %d-D and %d-D"
                            % (op, len(us), len(vs)))
    return int(us[0]), int(us[-1]), int(vs[-1])


def _peer_cfg(x, wq, sub_keys, u, v, k, activation, query_norm, gate, key_l2_norm, norm_eps, l2_eps, store=None,
              op="smelt.peer", kernels=None):
    """The smelt_peer_config of these tensors: every size comes from a shape;
    kernels (a dict: route, expert_kernel, overlap, projection, head_groups)
    sets cfg.kernels."""
    n_exp, hidden, d_out = _peer_experts(u, v, store, op)
    if not isinstance(sub_keys, (list, tuple)):
        raise DTypeError("%s: sub_keys must be a list of 2..4 tensors, got %s" % (op, type(sub_keys).__name__))
    p = len(sub_keys)
    if not 2 <= p <= 4:
        raise ArgumentError("%s: sub_keys has %d tables; product_key_dims must be 2..4" % (op, p))
    sk = [_shape(t, "sub_keys[%d]" % i, op) for i, t in enumerate(sub_keys)]
    if len(sk[0]) < 2:
        raise ArgumentError("%s: sub_keys[0] must be [n_0, dq/p] or [h, n_0, dq/p], got %d-D" % (op, len(sk[0])))
    wq_shape, x_shape = _shape(wq, "wq", op), _shape(x, "x", op)
    if len(wq_shape) != 2 or not x_shape:
        raise ArgumentError("%s: wq must be 2-D [d_in, h*dq] and x [T, d_in], got %d-D and %d-D"
                            % (op, len(wq_shape), len(x_shape)))
    k = _int(k, "k", op, 1, n_exp, " (num_experts_per_tok <= num_experts)")
    per_head = len(sk[0]) == 3
    query_dim = p * int(sk[0][-1])
    heads = int(sk[0][0]) if per_head else int(wq_shape[1]) // max(query_dim, 1)
    return {
        "input_dim": int(x_shape[-1]), "output_dim": d_out, "num_experts": n_exp,
        "num_experts_per_tok": int(k), "num_heads": heads, "expert_hidden_size": hidden,
        "query_dim": query_dim, "product_key_dims": p,
        "sub_key_sizes": [int(t[-2]) for t in sk], "activation": activation,
        "query_norm": query_norm, "norm_eps": float(norm_eps), "l2_eps": float(l2_eps),
        "key_l2_norm": bool(key_l2_norm), "per_head_keys": per_head, "gate": gate, **(kernels or {}),
    }


def _peer_weights(wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_keys, u, v, store=None):
    sk = tuple(sub_keys) + (None,) * (4 - len(sub_keys))
    return (wq, bq, norm_weight, norm_bias, bn_mean, bn_var) + sk[:4] + (u, v, store)




def _peer_outs_numpy(x, cfg, names):
    np = _sys.modules["numpy"]
    sel = (x.shape[0], cfg["num_heads"], cfg["num_experts_per_tok"])
    made = {"y": lambda: np.empty((x.shape[0], cfg["output_dim"]), x.dtype),
            "ids": lambda: np.empty(sel, np.int64), "scores": lambda: np.empty(sel, np.float32)}
    return [made[n]() for n in names]


def peer_retrieve(x, wq, sub_keys, u=None, v=None, *, k=16, bq=None, norm_weight=None, norm_bias=None, bn_mean=None,
                  bn_var=None, activation="gelu", query_norm="none", norm_eps=1e-5, l2_eps=1e-12, key_l2_norm=False,
                  gate="softmax", ids=None, scores=None, store=None, kernels=None, ctx=None, stream=None):
    """PEER's retrieval alone: for each token and head, the k experts with
    the largest product-key score (ties to the lower id), best first.
    Arguments as smelt.peer.

    Returns (ids [T, h, k] int64, scores [T, h, k] float32: the score sums
    before gating).
    """
    cfg = _peer_cfg(x, wq, sub_keys, u, v, k, activation, query_norm, gate, key_l2_norm, norm_eps, l2_eps, store,
                    "smelt.peer_retrieve", kernels)
    if _is_numpy(x):
        mi, ms = _peer_outs_numpy(x, cfg, ("ids", "scores"))
        ids = mi if ids is None else ids
        scores = ms if scores is None else scores
    w = _peer_weights(wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_keys, u, v, store)
    return _c_peer(0, cfg, x, w, (), (True if ids is None else ids, True if scores is None else scores), ctx, stream)


def peer(x, wq, sub_keys, u=None, v=None, *, k=16, bq=None, norm_weight=None, norm_bias=None, bn_mean=None,
         bn_var=None, activation="gelu", query_norm="none", norm_eps=1e-5, l2_eps=1e-12, key_l2_norm=False,
         gate="softmax", return_ids=False, out=None, ids=None, scores=None, store=None, kernels=None, ctx=None,
         stream=None):
    """PEER (Mixture of A Million Experts): product-key retrieval of k
    singleton experts per token and head, gated and summed.

        y[t] = Σ_h Σ_{e ∈ top-k} g_e · act(x[t] · u[e]) · v[e]

    Shapes:  x [T, d_in] (unit column stride); wq [d_in, h·dq]; bq [h·dq];
             sub_keys: p = 2..4 tables [n_i, dq/p] (shared) or [h, n_i, dq/p]
             (per head); u [N, d_in, h_e], v [N, h_e, d_out] with N = Π n_i;
             norm_weight, norm_bias, bn_mean, bn_var [dq] or [h, dq].
             Every size (h, dq, p, n_i, N, h_e, d_out) is read from the shapes.
    Dtypes:  f32, f16, bf16 each (u and v alike), f64 too on the CPU; f32 math
             on the GPU, f64 on the CPU reference.
    k:       experts per token and head (num_experts_per_tok).
    activation: 'gelu' (erf) or 'relu', inside each expert.
    query_norm: 'none', 'layernorm' (norm_weight/norm_bias optional),
             'batchnorm' (inference: bn_mean, bn_var required) or 'l2';
             norm_eps for the first two, l2_eps the L2 floor.
    key_l2_norm: L2-normalize sub-key rows before scoring.
    gate:    'softmax' over a head's k scores, 'sigmoid' or 'relu' each.
    out:     where to write y [T, d_out] (x's dtype when allocated).
    return_ids: also return the selection (ids, scores), e.g. to keep ids
             for peer_backward; ids=/scores= given also computes them.
    store:   a smelt.PeerStore holding U and V in host memory behind an HBM
             cache, in place of u and v (which are then None); the call runs
             on the store's context. Every forward is one batch of its cache
             policy (smelt.PeerStore.stats()). Results are bit-identical to
             dense u and v with the same values.
    kernels: for comparing the CUDA kernels, a dict of route ('auto', 'reg',
             'wg'), expert_kernel ('auto', 'bulk', 'warp', 'rows'), overlap
             ('auto', 'beside', 'after'), projection ('auto', 'fused',
             'gemm') and head_groups (0 = auto, 1, 2): smelt/peer.h's
             cfg.kernels; a choice the device or the shapes cannot take is
             an error. The CPU ignores it.
    Returns y, or (y, ids, scores) when return_ids is true.
    """
    if _is_compiling() and store is None:
        return _torch_impl.peer(x, wq, sub_keys, u, v, k=k, bq=bq, norm_weight=norm_weight, norm_bias=norm_bias,
                                bn_mean=bn_mean, bn_var=bn_var, activation=activation, query_norm=query_norm,
                                norm_eps=norm_eps, l2_eps=l2_eps, key_l2_norm=key_l2_norm, gate=gate,
                                return_ids=return_ids, out=out, ids=ids, scores=scores)
    cfg = _peer_cfg(x, wq, sub_keys, u, v, k, activation, query_norm, gate, key_l2_norm, norm_eps, l2_eps, store,
                    kernels=kernels)
    want = bool(return_ids)
    if _is_numpy(x):
        my, mi, ms = _peer_outs_numpy(x, cfg, ("y", "ids", "scores"))
        out = my if out is None else out
        ids = mi if ids is None and want else ids
        scores = ms if scores is None and want else scores
    outs = (True if out is None else out, True if ids is None and want else ids,
            True if scores is None and want else scores)
    w = _peer_weights(wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_keys, u, v, store)
    y, i, s = _c_peer(1, cfg, x, w, (), outs, ctx, stream)
    return (y, i, s) if want else y


_PEER_GRADS = ("dx", "dwq", "dbq", "dnorm_weight", "dnorm_bias", "dsub_keys", "du", "dv")
_PEER_SPARSE = ("grad_ids", "grad_count", "du_rows", "dv_rows")


def peer_backward(x, ids, dy, wq, sub_keys, u=None, v=None, *, k=16, bq=None, norm_weight=None, norm_bias=None,
                  bn_mean=None, bn_var=None, activation="gelu", query_norm="none", norm_eps=1e-5, l2_eps=1e-12,
                  key_l2_norm=False, gate="softmax", needs=None, out=None, store=None, kernels=None, ctx=None,
                  stream=None):
    """Gradients of sum(y * dy) for PEER's forward with the experts in ids
    (its ids output: scores and gates are recomputed, the selection is not
    differentiated). Deterministic: every element is summed in a fixed order.
    Arguments as smelt.peer, and:

    ids:     [T, h, k] int64 from smelt.peer(..., return_ids=True).
    dy:      [T, d_out], dL/dy.
    needs:   which gradients to compute, among 'dx', 'dwq', 'dbq',
             'dnorm_weight', 'dnorm_bias' (layernorm/batchnorm), 'dsub_keys',
             'du', 'dv' (dense, like u and v); None = every one of those whose
             parameter is given (bn_mean and bn_var are statistics: no
             gradient). Sparse expert gradients, the rows of the M distinct
             experts of ids only (each bit-identical to the dense row):
             'du_rows' [M, d_in, h_e], 'dv_rows' [M, h_e, d_out], and
             'grad_ids' [M] int64, those experts in ascending order (always
             returned with the rows). Finding M reads it back to the host:
             this call waits for the device, and the results are sliced
             (t[:M]), which numpy, torch and cupy support but a smelt.Tensor
             does not.
             'grad_count' returns the untrimmed outputs instead, with no wait:
             grad_count [1] int64 (M, on the device), grad_ids [T·h·k] (-1
             after the M ids), du_rows and dv_rows [T·h·k, ...] (rows from M
             on zeros).
    out:     dict of the same names to tensors to write (dsub_keys a list;
             the sparse ones untrimmed, [T·h·k, ...]). A given sparse output
             is returned as a view of its first M rows unless 'grad_count'
             is asked for or given.
    store:   the smelt.PeerStore the forward read (u and v None): the
             experts are read through it, unchanged; 'du' and 'dv' do not
             exist then (the default needs has 'du_rows' and 'dv_rows').
    Returns a dict name -> gradient (dsub_keys a list, one per table).
    """
    cfg = _peer_cfg(x, wq, sub_keys, u, v, k, activation, query_norm, gate, key_l2_norm, norm_eps, l2_eps, store,
                    "smelt.peer_backward", kernels)
    sub_keys = tuple(sub_keys)
    p = len(sub_keys)
    affine = query_norm in ("layernorm", "batchnorm")
    like = {"dx": x, "dwq": wq, "dbq": bq, "dnorm_weight": norm_weight if affine else None,
            "dnorm_bias": norm_bias if affine else None, "dsub_keys": sub_keys, "du": u, "dv": v}
    for n in ("dbq", "dnorm_weight", "dnorm_bias"):  # the others' shapes were read by _peer_cfg
        if like[n] is not None:
            _shape(like[n], n[1:], "smelt.peer_backward")
    if needs is None:
        needs = [n for n in _PEER_GRADS if like[n] is not None] + (["du_rows", "dv_rows"] if store else [])
    out = dict(out or {})
    for n in list(needs) + list(out):
        if n not in like and n not in _PEER_SPARSE:
            raise ArgumentError("smelt.peer_backward: no gradient named %r (known: %s)"
                                % (n, ", ".join(_PEER_GRADS + _PEER_SPARSE)))
    npy = _is_numpy(x)
    np = _sys.modules["numpy"] if npy else None

    def slot(name, param, given):
        if given is not None:
            return given
        if name not in needs:
            return None
        if param is None:
            raise ArgumentError("smelt.peer_backward: %s is asked for but its parameter is absent" % name)
        return np.empty(param.shape, param.dtype) if npy else True

    flat = [slot(n, like[n], out.get(n)) for n in _PEER_GRADS[:5]]
    given_sk = list(out.get("dsub_keys") or [None] * p)
    flat += [slot("dsub_keys", sub_keys[i], given_sk[i]) for i in range(p)] + [None] * (4 - p)
    flat += [slot(n, like[n], out.get(n)) for n in ("du", "dv")]
    # Any sparse output brings grad_ids (which expert each row is) and
    # grad_count (where to trim); the rows only as asked.
    sparse = any(n in needs or n in out for n in _PEER_SPARSE)
    untrimmed = "grad_count" in needs or "grad_count" in out
    nuse = int(x.shape[0]) * cfg["num_heads"] * cfg["num_experts_per_tok"]
    if store is None:
        rows = {"du_rows": ((nuse,) + tuple(u.shape[1:]), u.dtype), "dv_rows": ((nuse,) + tuple(v.shape[1:]), v.dtype)}
    else:
        he, sdt = cfg["expert_hidden_size"], {s: n for n, s in _DTYPE_NAMES.items()}[store.dtype]
        rows = {"du_rows": ((nuse, cfg["input_dim"], he), sdt), "dv_rows": ((nuse, he, cfg["output_dim"]), sdt)}
        if npy and not hasattr(np, sdt):
            raise ArgumentError("smelt.peer_backward: numpy has no %s for the store's rows" % store.dtype)
    made = dict(grad_ids=((nuse,), "int64"), grad_count=((1,), "int64"), **rows)

    def sparse_slot(name):
        if out.get(name) is not None:
            return out[name]
        if not sparse or (name.endswith("_rows") and name not in needs):
            return None
        return np.empty(*made[name]) if npy else True

    flat += [sparse_slot(n) for n in _PEER_SPARSE]
    w = _peer_weights(wq, bq, norm_weight, norm_bias, bn_mean, bn_var, sub_keys, u, v, store)
    r = _c_peer(2, cfg, x, w, (ids, dy), tuple(flat), ctx, stream)
    grads = {n: r[i] for i, n in enumerate(_PEER_GRADS[:5]) if r[i] is not None}
    if r[5] is not None:
        grads["dsub_keys"] = list(r[5:5 + p])
    for i, n in ((9, "du"), (10, "dv")):
        if r[i] is not None:
            grads[n] = r[i]
    if sparse:
        m = None if untrimmed else int(r[12][0])  # the host sync
        grads.update((n, t if untrimmed else t[:m]) for n, t in zip(_PEER_SPARSE, r[11:])
                     if t is not None and (untrimmed or n != "grad_count"))
    return grads


_MOE_SCORES = ("softmax", "sigmoid")
_MOE_DROPS = ("none", "probs", "position")
_MOE_FFNS = ("swiglu", "mlp")
_MOE_ROUTING = ("logits", "ids", "weights", "counts", "offsets", "dropped", "aux")
_MOE_GRADS = ("dx", "dwr", "dwnoise", "dw1", "dw3", "dw2", "db1")


def _moe_choice(v, name, names, op):
    if v not in names:
        raise ArgumentError("%s: %s=%r is not one of %s" % (op, name, v, ", ".join(repr(n) for n in names)))
    return names.index(v)


def _moe_cfg(x, wr, w1, w3, top_k, opts, op):
    """The smelt_moe_config tuple _smelt.moe takes: the sizes from the
    shapes (x [T, d], wr [d, E], w1 [E, d, F]), the rest from opts (the
    keyword arguments of smelt.moe)."""
    xs, rs, s1 = _shape(x, "x", op), _shape(wr, "wr", op), _shape(w1, "w1", op)
    if len(xs) != 2 or len(rs) != 2 or len(s1) != 3:
        raise ArgumentError("%s: x must be [T, d], wr [d, E] and w1 [E, d, F], got %d-D, %d-D and %d-D"
                            % (op, len(xs), len(rs), len(s1)))
    E = int(rs[1])
    ffn = opts.get("ffn") or ("swiglu" if w3 is not None else "mlp")
    return (E, _int(top_k, "top_k", op, 1, E, " (top_k <= num_experts)"), int(rs[0]), int(s1[2]),
            _moe_choice(opts.get("score", "softmax"), "score", _MOE_SCORES, op), bool(opts.get("renormalize", True)),
            float(opts.get("scaling_factor", 1.0)), int(opts.get("num_groups", 0)), int(opts.get("topk_groups", 0)),
            int(opts.get("noise_seed", 0)), int(opts.get("noise_token_offset", 0)),
            float(opts.get("capacity_factor", 0.0)), _moe_choice(opts.get("drop_policy", "none"), "drop_policy",
                                                                 _MOE_DROPS, op),
            float(opts.get("aux_loss_coeff", 0.0)), float(opts.get("z_loss_coeff", 0.0)),
            _moe_choice(ffn, "ffn", _MOE_FFNS, op), _moe_choice(opts.get("activation", "gelu"), "activation",
                                                                ACTIVATIONS, op))


_MOE_OPTS = ("score", "renormalize", "scaling_factor", "num_groups", "topk_groups", "noise_seed",
             "noise_token_offset", "capacity_factor", "drop_policy", "aux_loss_coeff", "z_loss_coeff", "ffn",
             "activation")


def _moe_opts(opts, op):
    for n in opts:
        if n not in _MOE_OPTS:
            raise ArgumentError("%s: no option named %r (known: %s)" % (op, n, ", ".join(_MOE_OPTS)))
    return opts


def _moe_fwd_outs(cfg, x, outs):
    """The forward's outs for _smelt.moe (y, logits, ids, weights, counts,
    offsets, dropped, aux[, saved]): False as None, and for numpy x each
    True as a new array of the shape and dtype _smelt.moe would allocate
    for other tensors (it allocates through the inputs' framework)."""
    if _is_numpy(x):
        np = _sys.modules["numpy"]
        T, E, k = x.shape[0], cfg[0], cfg[1]
        rf = np.float64 if x.dtype == np.float64 else np.float32

        def made(i):
            if i == 8:
                return (_C.moe_saved_bytes(cfg, int(T), _DTYPE_NAMES.get(str(x.dtype), "f32"), False),), np.uint8
            return [(x.shape, x.dtype), ((T, E), rf), ((T, k), np.int32), ((T, k), rf), ((E,), np.int64),
                    ((E + 1,), np.int64), ((1,), np.int64), ((2,), rf)][i]
        outs = [np.empty(*made(i)) if o is True else o for i, o in enumerate(outs)]
    return tuple(None if o is False else o for o in outs)


def moe(x, wr, w1, w2, w3=None, *, top_k, b1=None, expert_bias=None, wnoise=None, return_routing=False, out=None,
        save=False, ctx=None, stream=None, **opts):
    """A Mixture-of-Experts layer (Megatron-LM / Mixtral conventions,
    smelt/moe.h): route each token to top_k experts, run their FFNs and sum
    the outputs weighted by the router.

        y[t] = Σ_i w_i · FFN_{e_i}(x[t]),  FFN_e = (silu(x·W1ₑ) ∘ (x·W3ₑ))·W2ₑ  (SwiGLU, w3 given)
                                                  or act(x·W1ₑ + b1ₑ)·W2ₑ      (MLP)

    Shapes:  x [T, d] (unit column stride); wr [d, E]; w1 and w3 [E, d, F];
             w2 [E, F, d]; b1 [E, F] (MLP); expert_bias [E] f32 (selection
             only); wnoise [d, E] (noisy top-k). Sizes come from the shapes.
    Dtypes:  f32, f16, bf16 (f64 too on the CPU); routing in f32 (f64 for f64 x).
    Options (keywords, smelt_moe_config's fields): score 'softmax' or
             'sigmoid'; renormalize (True); scaling_factor (1.0); num_groups
             and topk_groups (group-limited routing, 0: off); noise_seed and
             noise_token_offset; capacity_factor (0: none) with drop_policy
             'probs' or 'position'; aux_loss_coeff and z_loss_coeff; ffn
             'swiglu' or 'mlp' (default: swiglu when w3 is given); activation
             (the MLP's, one of smelt.ACTIVATIONS; 'gelu').
    return_routing: also return the routing, a dict of logits [T, E] f32,
             ids [T, k] int32 (-1: dropped), weights [T, k] f32, counts [E]
             and offsets [E+1] int64, dropped [1] int64 and aux [2] f32 (the
             load-balance and z losses); logits, weights and aux are f64
             for f64 x.
    save:    also return the backward's state (a uint8 tensor; on CUDA the
             routing, permuted rows and the FFN's pre-activations, on the
             CPU empty), for smelt.moe_backward(..., saved=) to skip the
             forward's recomputation; routing then holds aux, counts and
             dropped only (the rest is in the state).
    Returns y [T, d] (x's dtype), (y, routing), (y, saved) or
    (y, routing, saved).
    """
    op = "smelt.moe"
    if _is_compiling():
        if save:
            raise ArgumentError("smelt.moe: save=True is for eager calls; under torch.compile, smelt.torch.moe "
                                "keeps the state itself when a gradient will be asked for")
        return _torch_impl.moe(x, wr, w1, w2, w3, top_k=top_k, b1=b1, expert_bias=expert_bias, wnoise=wnoise,
                               return_routing=return_routing, **opts)
    cfg = _moe_cfg(x, wr, w1, w3, top_k, _moe_opts(opts, op), op)
    if save:
        return _moe_save(cfg, x, (wr, expert_bias, wnoise, w1, w3, w2, b1), out, return_routing, ctx, stream)
    outs = _moe_fwd_outs(cfg, x, [True if out is None else out] + [bool(return_routing)] * 7)
    r = _c_moe(0, cfg, x, (wr, expert_bias, wnoise, w1, w3, w2, b1), (), outs, ctx, stream)
    return (r[0], dict(zip(_MOE_ROUTING, r[1:]))) if return_routing else r[0]


def _moe_save(cfg, x, weights, out, return_routing, ctx, stream):
    """smelt.moe(..., save=True): the saved forward (_smelt.moe mode 2)."""
    rr = bool(return_routing)  # counts, dropped and aux; logits, ids, weights and offsets stay in the state
    outs = _moe_fwd_outs(cfg, x, [True if out is None else out, None, None, None, rr, None, rr, rr, True])
    r = _c_moe(2, cfg, x, weights, (), outs, ctx, stream)
    routing = {"counts": r[4], "dropped": r[6], "aux": r[7]}
    return (r[0], routing, r[8]) if return_routing else (r[0], r[8])


def moe_backward(dy, x, wr, w1, w2, w3=None, *, top_k, b1=None, expert_bias=None, wnoise=None, needs=None,
                 out=None, saved=None, ctx=None, stream=None, **opts):
    """Gradients of sum(y ∘ dy) + L_lb + L_z for smelt.moe with the same
    arguments (the aux losses' gradients are always part of it, Megatron's
    convention). The forward is recomputed from x; dropped assignments
    contribute zero. Deterministic: every sum has a fixed order.

    dy:      [T, d], dL/dy.
    needs:   which gradients, among 'dx', 'dwr', 'dwnoise', 'dw1', 'dw3',
             'dw2', 'db1'; None = every one whose parameter is given.
    out:     dict of the same names to tensors to write.
    saved:   smelt.moe(..., save=True)'s state for the same x, weights and
             options: the forward is not run again (same gradients).
    Returns a dict name -> gradient (each shaped like what it differentiates).
    """
    op = "smelt.moe_backward"
    cfg = _moe_cfg(x, wr, w1, w3, top_k, _moe_opts(opts, op), op)
    like = dict(zip(_MOE_GRADS, (x, wr, wnoise, w1, w3, w2, b1)))
    if needs is None:
        needs = [n for n in _MOE_GRADS if like[n] is not None]
    out = dict(out or {})
    for n in list(needs) + list(out):
        if n not in like:
            raise ArgumentError("%s: no gradient named %r (known: %s)" % (op, n, ", ".join(_MOE_GRADS)))
    npy = _is_numpy(x)

    def slot(n):
        if out.get(n) is not None:
            return out[n]
        if n not in needs:
            return None
        if like[n] is None:
            raise ArgumentError("%s: %s is asked for but its parameter is absent" % (op, n))
        return _sys.modules["numpy"].empty(like[n].shape, like[n].dtype) if npy else True

    mode, extra = (1, (dy,)) if saved is None else (3, (dy, saved))
    r = _c_moe(mode, cfg, x, (wr, expert_bias, wnoise, w1, w3, w2, b1), extra, tuple(slot(n) for n in _MOE_GRADS),
               ctx, stream)
    return {n: t for n, t in zip(_MOE_GRADS, r) if t is not None}
from ._norm import (  # noqa: E402
    add_layer_norm,
    add_rms_norm,
    layer_norm,
    norm_backward,
    residual_add,
    rms_norm,
    rotary,
    rotary_tables,
)
from ._norm import __all__ as _norm_all  # noqa: E402

__all__ += _norm_all

from ._bem import bem_backward, bem_benchmark, bem_update, bem_validate  # noqa: E402

__all__ += ["bem_backward", "bem_benchmark", "bem_update", "bem_validate"]

from .graph import Graph  # noqa: E402

__all__ += ["Graph"]


def __getattr__(name):
    # `smelt.torch` without an explicit import (imports torch).
    if name == "torch":
        import importlib

        return importlib.import_module(__name__ + ".torch")
    raise AttributeError("module 'smelt' has no attribute %r" % name)


if "torch" in _sys.modules:
    _probe_torch()
