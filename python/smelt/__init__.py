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
    "Tensor", "UnsupportedError", "activation", "default_context", "empty", "info", "softmax", "topk",
]

_c_activation = _C.activation
_c_softmax = _C.softmax
_c_topk = _C.topk


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


def __getattr__(name):
    # `smelt.torch` without an explicit import (imports torch).
    if name == "torch":
        import importlib

        return importlib.import_module(__name__ + ".torch")
    raise AttributeError("module 'smelt' has no attribute %r" % name)


if "torch" in _sys.modules:
    _probe_torch()
