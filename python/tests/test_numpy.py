"""The binding on the CPU with numpy: results against float64 references, the
DLPack protocol (versioned and legacy capsules, renaming, deleters, read-only
outputs, dtype and device checks), errors, contexts and smelt.Tensor."""

import gc
import math
import sys
import threading

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

_erf = np.vectorize(math.erf)


def ref_act(x, act, slope=0.01):
    x = x.astype(np.float64)
    if act == "identity":
        return x
    if act == "relu":
        return np.maximum(x, 0)
    if act == "leaky_relu":
        return np.where(x >= 0, x, slope * x)
    if act == "tanh":
        return np.tanh(x)
    if act == "sigmoid":
        return 1 / (1 + np.exp(-x))
    if act == "silu":
        return x / (1 + np.exp(-x))
    if act == "hardswish":
        return x * np.clip(x + 3, 0, 6) / 6
    if act == "gelu":
        return 0.5 * x * (1 + _erf(x / math.sqrt(2)))
    if act == "gelu_tanh":
        return 0.5 * x * (1 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))
    raise AssertionError(act)


def ref_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    e = np.exp(x - m)
    s = e.sum(-1, keepdims=True)
    return e / s, (np.log(s) + m)[..., 0]


def ref_topk(x, k):
    """Descending, ties by ascending index, NaN above everything."""
    x64 = x.astype(np.float64)
    flat = x64.reshape(-1, x.shape[-1])
    vals, idxs = [], []
    for row in flat:
        key = np.where(np.isnan(row), -np.inf, -row)  # NaN first, then descending
        nan_first = ~np.isnan(row)
        order = np.lexsort((np.arange(row.size), key, nan_first))[:k]
        vals.append(row[order])
        idxs.append(order)
    shape = x.shape[:-1] + (k,)
    return np.array(vals).reshape(shape), np.array(idxs).reshape(shape)


TOL = {np.float32: 2e-6, np.float16: 2e-3}


def close(got, want, dtype):
    got = np.asarray(got, dtype=np.float64)
    tol = TOL[dtype]
    err = np.abs(got - want) / (np.abs(want) + 1)
    assert np.all(np.isfinite(got) == np.isfinite(want)), "inf/nan mismatch"
    fin = np.isfinite(want)
    assert err[fin].max(initial=0) <= tol, "max err %g at %s" % (err[fin].max(), np.unravel_index(err.argmax(), err.shape))


# ---- ops


@pytest.mark.parametrize("act", smelt.ACTIVATIONS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_activation(rng, act, dtype):
    x = (rng.standard_normal((7, 129)) * 4).astype(dtype)
    y = smelt.activation(x, act, slope=0.2)
    assert isinstance(y, np.ndarray) and y.dtype == dtype and y.shape == x.shape
    close(y, ref_act(x, act, 0.2).astype(dtype), dtype)


def test_activation_out_strided_and_inplace(rng):
    base = rng.standard_normal((6, 10)).astype(np.float32)
    x = base[:, ::2]  # non-contiguous input
    out = np.full((10, 6), np.nan, np.float32).T[:, ::2]  # non-contiguous output
    r = smelt.activation(x, "silu", out=out)
    assert r is out
    close(out, ref_act(x, "silu"), np.float32)
    # In place: y == x exactly is allowed.
    z = base.copy()
    smelt.activation(z, "relu", out=z)
    close(z, ref_act(base, "relu"), np.float32)


@pytest.mark.parametrize("shape", [(1,), (3, 1), (5, 7), (2, 3, 257)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_softmax(rng, shape, dtype):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    y, lse = smelt.softmax(x, return_lse=True)
    want_y, want_lse = ref_softmax(x)
    assert y.dtype == dtype and lse.dtype == np.float32 and lse.shape == shape[:-1]
    close(y, want_y, dtype)
    close(lse, want_lse, np.float32 if dtype == np.float32 else np.float16)
    assert isinstance(smelt.softmax(x), np.ndarray)


def test_softmax_special_rows():
    x = np.array([[1, 2, np.nan], [-np.inf, -np.inf, -np.inf], [0, -np.inf, 0]], np.float32)
    y, lse = smelt.softmax(x, return_lse=True)
    assert np.isnan(y[0]).all() and np.isnan(lse[0])
    assert (y[1] == 0).all() and lse[1] == -np.inf
    np.testing.assert_allclose(y[2], [0.5, 0, 0.5], rtol=1e-6)


def test_softmax_explicit_lse(rng):
    x = rng.standard_normal((4, 9)).astype(np.float32)
    lse = np.empty(4, np.float32)
    y = smelt.softmax(x, lse=lse)
    assert isinstance(y, np.ndarray)
    close(lse, ref_softmax(x)[1], np.float32)


@pytest.mark.parametrize("k", [1, 3, 17])
def test_topk(rng, k):
    x = rng.standard_normal((5, 17)).astype(np.float32)
    x[0, :4] = 1.5  # ties
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    v, i = smelt.topk(x, k)
    want_v, want_i = ref_topk(x, k)
    assert i.dtype == np.int64 and v.shape == (5, k)
    np.testing.assert_array_equal(i, want_i)
    np.testing.assert_array_equal(v, want_v.astype(np.float32))


def test_topk_index_dtypes_and_values_only(rng):
    x = rng.standard_normal((3, 8)).astype(np.float16)
    v, i = smelt.topk(x, 2, index_dtype="int32")
    assert i.dtype == np.int32
    v2, i2 = smelt.topk(x, 2, index_dtype=np.int32)
    assert i2.dtype == np.int32
    v3, none = smelt.topk(x, 2, index_dtype=None)
    assert none is None
    np.testing.assert_array_equal(v, v3)


# ---- errors


def test_error_classes(rng):
    x = rng.standard_normal((2, 3)).astype(np.float32)
    with pytest.raises(TypeError) as e:
        smelt.activation(x.astype(np.float64))
    assert isinstance(e.value, smelt.DTypeError) and isinstance(e.value, smelt.Error)
    assert e.value.status_name == "SMELT_STATUS_DTYPE_MISMATCH"
    assert "f64" in str(e.value)
    with pytest.raises(ValueError) as e:
        smelt.activation(x, out=np.empty((3, 2), np.float32))
    assert isinstance(e.value, smelt.ArgumentError) and "shape" in str(e.value)
    with pytest.raises(ValueError, match="act='nope'"):
        smelt.activation(x, "nope")
    with pytest.raises(ValueError):
        smelt.topk(x, 4)
    with pytest.raises(TypeError, match="index_dtype"):
        smelt.topk(x, 1, index_dtype="float32")
    with pytest.raises(TypeError, match="DLPack tensor"):
        smelt.activation([1.0, 2.0])


def test_too_many_dims():
    x = np.zeros((1,) * 9, np.float32)
    with pytest.raises(ValueError, match="at most 8"):
        smelt.activation(x)


def test_unsupported_dtype_code():
    x = np.zeros((2, 2), np.complex64)
    with pytest.raises(TypeError, match="complex"):
        smelt.activation(x, out=x)


def test_readonly_output_refused(rng):
    x = rng.standard_normal(4).astype(np.float32)
    ro = np.empty(4, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        smelt.activation(x, out=ro)
    # Read-only inputs are fine.
    x.flags.writeable = False
    smelt.activation(x)


# ---- the DLPack protocol, with instrumented producers


class Producer:
    """Wraps a numpy array; records what the consumer asked for and can
    pretend to be a legacy (pre-1.0) producer or to live on another device."""

    def __init__(self, arr, legacy=False, device=None, versioned_major=None):
        self.arr = arr
        self.legacy = legacy
        self.device = device
        self.calls = []
        self.capsules = []

    def __dlpack_device__(self):
        return self.device or self.arr.__dlpack_device__()

    def __dlpack__(self, **kw):
        self.calls.append(kw)
        if self.legacy and "max_version" in kw:
            raise TypeError("unexpected keyword argument 'max_version'")
        cap = self.arr.__dlpack__(**kw)
        self.capsules.append(cap)
        return cap


def test_versioned_capsule_consumed_and_released(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    out = np.empty_like(x)
    px, po = Producer(x), Producer(out)
    before = (sys.getrefcount(x), sys.getrefcount(out))
    smelt.activation(px, "tanh", out=po)
    close(out, ref_act(x, "tanh"), np.float32)
    assert px.calls == [{"max_version": (1, 1)}]  # CPU: no stream argument
    assert "used_dltensor_versioned" in repr(px.capsules[0])
    assert "used_dltensor_versioned" in repr(po.capsules[0])
    px.capsules.clear()
    po.capsules.clear()
    gc.collect()
    assert (sys.getrefcount(x), sys.getrefcount(out)) == before  # deleters ran


def test_legacy_producer_fallback(rng):
    x = rng.standard_normal(5).astype(np.float32)
    out = np.empty_like(x)
    px, po = Producer(x, legacy=True), Producer(out, legacy=True)
    smelt.activation(px, "relu", out=po)
    close(out, ref_act(x, "relu"), np.float32)
    assert px.calls == [{"max_version": (1, 1)}, {}]
    assert "used_dltensor" in repr(px.capsules[0]) and "versioned" not in repr(px.capsules[0])


def test_unsupported_device_refused_before_export(rng):
    x = rng.standard_normal(5).astype(np.float32)
    p = Producer(x, device=(4, 0))  # OpenCL
    with pytest.raises(RuntimeError, match="opencl"):
        smelt.activation(p)
    assert p.calls == []


def test_cuda_producer_gets_the_stream_or_a_clear_error(rng):
    x = rng.standard_normal(5).astype(np.float32)
    p = Producer(x, device=(2, 0))  # claims CUDA
    if smelt.info()["device_count"] == 0:
        with pytest.raises(RuntimeError) as e:
            smelt.activation(p)
        assert isinstance(e.value, smelt.Error)
        assert p.calls == []
    else:
        with pytest.raises(Exception):
            smelt.activation(p, out=p)  # the numpy data is not device memory
        assert p.calls and p.calls[0].get("stream") == 1  # legacy default stream


def test_stream_argument_on_cpu_is_ignored_or_refused(rng):
    x = rng.standard_normal(5).astype(np.float32)
    with pytest.raises(TypeError):
        smelt.activation(x, stream=object())


def test_used_capsule_is_refused(rng):
    x = rng.standard_normal(3).astype(np.float32)

    class Stale:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kw):
            cap = x.__dlpack__(**kw)
            np.from_dlpack(type("W", (), {"__dlpack__": lambda s, **k: cap, "__dlpack_device__": lambda s: (1, 0)})())
            return cap

    with pytest.raises(TypeError, match="unconsumed"):
        smelt.activation(Stale())


# ---- smelt.Tensor, contexts, info


def test_smelt_tensor_roundtrip(rng):
    t = smelt.empty((3, 5), "f32", device="cpu")
    assert t.shape == (3, 5) and t.strides == (5, 1) and t.dtype == "f32" and t.device == "cpu"
    view = np.from_dlpack(t)
    view[...] = rng.standard_normal((3, 5))
    y = smelt.activation(t, "sigmoid")  # no framework to allocate with: a smelt.Tensor
    assert isinstance(y, smelt.Tensor)
    close(np.from_dlpack(y), ref_act(view, "sigmoid"), np.float32)
    assert np.from_dlpack(y).__array_interface__["data"][0] == y.data_ptr
    v, i = smelt.topk(t, 2)
    assert isinstance(v, smelt.Tensor) and i.dtype == "i64" and v.shape == (3, 2)
    del view, t, y, v, i
    gc.collect()


def test_smelt_tensor_legacy_export():
    t = smelt.empty((4,), "f16", device="cpu")
    cap = t.__dlpack__()
    assert "dltensor" in repr(cap)
    del cap  # an unconsumed capsule frees its reference
    assert t.__dlpack_device__() == (1, 0)


def test_context_api(rng):
    c = smelt.Context("cpu", deterministic=True)
    assert c.device == "cpu" and c.device_type == "cpu" and c.deterministic and c.stream is None
    assert "cpu" in repr(c)
    assert c.pool_stats() == {"used": 0, "reserved": 0, "peak": 0}
    c.synchronize()
    x = rng.standard_normal((4, 4)).astype(np.float32)
    for _ in range(3):
        smelt.activation(x, ctx=c)
    st = c.cache_stats()
    assert st["plan_misses"] == 1 and st["plan_hits"] == 2
    c.clear_plans()
    c.deterministic = False
    assert not c.deterministic
    with pytest.raises(ValueError):
        smelt.Context("tpu")
    with pytest.raises(TypeError):
        smelt.activation(x, ctx="cpu")
    assert smelt.default_context() is smelt.default_context(smelt.default_context().device)
    assert smelt.default_context("cpu").device == "cpu"


def test_info():
    i = smelt.info()
    for k in ("version", "driver_loaded", "nvrtc_loaded", "device_count", "cache_dir", "devices"):
        assert k in i
    assert i["version"] == smelt.__version__
    assert len(i["devices"]) == i["device_count"]
    if not i["driver_loaded"]:
        assert i["driver_error"]


def test_threads(rng):
    xs = [rng.standard_normal((64, 33)).astype(np.float32) for _ in range(8)]
    results = [None] * len(xs)

    def work(j):
        for _ in range(20):
            results[j] = smelt.softmax(xs[j])

    ts = [threading.Thread(target=work, args=(j,)) for j in range(len(xs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for x, y in zip(xs, results):
        close(y, ref_softmax(x)[0], np.float32)
