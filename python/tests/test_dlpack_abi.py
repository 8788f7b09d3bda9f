"""The DLPack consumer at the ABI level: capsules built by hand with ctypes,
so every field smelt reads (version, flags, byte_offset, NULL strides, lanes,
dtype codes) and every obligation it has (rename, call the deleter exactly
once, refuse read-only or copied outputs) can be checked directly."""

import ctypes as C

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402


class DLDevice(C.Structure):
    _fields_ = [("device_type", C.c_int32), ("device_id", C.c_int32)]


class DLDataType(C.Structure):
    _fields_ = [("code", C.c_uint8), ("bits", C.c_uint8), ("lanes", C.c_uint16)]


class DLTensor(C.Structure):
    _fields_ = [
        ("data", C.c_void_p),
        ("device", DLDevice),
        ("ndim", C.c_int32),
        ("dtype", DLDataType),
        ("shape", C.POINTER(C.c_int64)),
        ("strides", C.POINTER(C.c_int64)),
        ("byte_offset", C.c_uint64),
    ]


class DLVersion(C.Structure):
    _fields_ = [("major", C.c_uint32), ("minor", C.c_uint32)]


class ManagedV(C.Structure):
    pass


class ManagedL(C.Structure):
    pass


DELETER_V = C.CFUNCTYPE(None, C.POINTER(ManagedV))
DELETER_L = C.CFUNCTYPE(None, C.POINTER(ManagedL))
ManagedV._fields_ = [
    ("version", DLVersion),
    ("manager_ctx", C.c_void_p),
    ("deleter", DELETER_V),
    ("flags", C.c_uint64),
    ("dl_tensor", DLTensor),
]
ManagedL._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", C.c_void_p), ("deleter", DELETER_L)]

_capsule_new = C.pythonapi.PyCapsule_New
_capsule_new.restype = C.py_object
_capsule_new.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]

READ_ONLY, IS_COPIED = 1, 2


class HandMade:
    """A producer whose capsule is assembled field by field over a numpy
    array's memory. deleted counts deleter calls."""

    def __init__(self, arr, *, versioned=True, major=1, minor=1, flags=0, byte_offset=0, shape=None,
                 strides="contiguous", code=2, bits=32, lanes=1):
        self.arr = arr
        self.deleted = 0
        self.shape = (C.c_int64 * 8)(*(shape if shape is not None else arr.shape))
        ndim = len(shape if shape is not None else arr.shape)
        if strides == "contiguous":
            st = [s // arr.itemsize for s in arr.strides]
            self.strides = (C.c_int64 * 8)(*st)
            sp = C.cast(self.strides, C.POINTER(C.c_int64))
        else:
            sp = None  # NULL: row-major
        t = DLTensor(arr.ctypes.data, DLDevice(1, 0), ndim, DLDataType(code, bits, lanes),
                     C.cast(self.shape, C.POINTER(C.c_int64)), sp, byte_offset)
        if versioned:
            self.deleter = DELETER_V(self._delete)
            self.m = ManagedV(DLVersion(major, minor), None, self.deleter, flags, t)
            self.name = b"dltensor_versioned"
        else:
            self.deleter = DELETER_L(self._delete)
            self.m = ManagedL(t, None, self.deleter)
            self.name = b"dltensor"
        self.capsule = None

    def _delete(self, ptr):
        self.deleted += 1

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, **kw):
        self.capsule = _capsule_new(C.addressof(self.m), self.name, None)
        return self.capsule


def test_byte_offset_and_null_strides(rng):
    base = rng.standard_normal(10).astype(np.float32)
    x = HandMade(base, byte_offset=8, shape=(2, 4), strides=None)  # elements 2..9 as [2, 4]
    out = np.empty((2, 4), np.float32)
    smelt.activation(x, "identity", out=out)
    np.testing.assert_array_equal(out, base[2:].reshape(2, 4))
    assert x.deleted == 1
    assert "used_dltensor_versioned" in repr(x.capsule)


def test_legacy_capsule_deleter_called(rng):
    base = rng.standard_normal(6).astype(np.float32)
    x = HandMade(base, versioned=False)
    y = smelt.activation(x, "relu", out=np.empty(6, np.float32))
    np.testing.assert_array_equal(y, np.maximum(base, 0))
    assert x.deleted == 1 and "used_dltensor" in repr(x.capsule)


def test_unknown_major_version_refused_and_released():
    x = HandMade(np.zeros(4, np.float32), major=2)
    with pytest.raises(NotImplementedError, match="DLPack 2"):
        smelt.activation(x, out=np.empty(4, np.float32))
    assert x.deleted == 1


def test_newer_minor_version_accepted():
    x = HandMade(np.ones(4, np.float32), minor=7)
    out = np.empty(4, np.float32)
    smelt.activation(x, "identity", out=out)
    assert (out == 1).all() and x.deleted == 1


@pytest.mark.parametrize("flags,what", [(READ_ONLY, "read-only"), (IS_COPIED, "copy")])
def test_flags_refused_for_outputs(flags, what):
    x = np.ones(4, np.float32)
    out = HandMade(np.empty(4, np.float32), flags=flags)
    with pytest.raises(ValueError, match=what):
        smelt.activation(x, out=out)
    assert out.deleted == 1
    # The same flags on an input are fine.
    inp = HandMade(x, flags=flags)
    smelt.activation(inp, out=np.empty(4, np.float32))
    assert inp.deleted == 1


def test_vector_lanes_refused():
    x = HandMade(np.zeros(4, np.float32), lanes=2)
    with pytest.raises(TypeError, match="lanes 2"):
        smelt.activation(x, out=np.empty(4, np.float32))
    assert x.deleted == 1


@pytest.mark.parametrize("code,bits,name", [(10, 8, "e4m3"), (12, 8, "e5m2"), (4, 16, "bf16"), (6, 8, "bool")])
def test_dtype_codes(code, bits, name):
    # smelt's activation takes only f32/f16/bf16: its dtype error names what it saw.
    x = HandMade(np.zeros(8, np.uint8), code=code, bits=bits, shape=(8 * 8 // bits,))
    if name == "bf16":
        out = smelt.empty((4,), "bf16", device="cpu")
        smelt.activation(x, "identity", out=out)
        assert x.deleted == 1
        return
    with pytest.raises(TypeError, match=r"\b%s\b" % name):
        smelt.activation(x)
    assert x.deleted == 1


@pytest.mark.parametrize("code,bits", [(7, 8), (13, 8), (5, 64), (2, 8)])
def test_unsupported_dtype_codes(code, bits):
    x = HandMade(np.zeros(8, np.uint8), code=code, bits=bits, shape=(1,))
    with pytest.raises(TypeError, match="DLPack dtype"):
        smelt.activation(x)
    assert x.deleted == 1
