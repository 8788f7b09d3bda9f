"""What a new user met on the CPU with numpy (issue 26): sizes checked
before numpy allocates an output, errors that are smelt.Error and name the
Python argument, SMELT_DEVICE as the default device, bad environment values
refused, and bf16/fp8 arrays through ml_dtypes both ways."""

import os
import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

F32 = np.float32
PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.abspath(smelt.__file__)))


def peer_args(d=8, n=2):
    wq = np.ones((d, 8), F32)
    keys = [np.ones((n, 4), F32)] * 2
    return np.ones((4, d), F32), wq, keys, np.ones((n * n, d, 1), F32), np.ones((n * n, 1, d), F32)


@pytest.mark.parametrize("call, exc, says", [
    (lambda: smelt.topk(np.ones((4, 8), F32), 2 ** 40), smelt.ArgumentError, "k=1099511627776 must be in [1, 8]"),
    (lambda: smelt.topk(np.ones((4, 8), F32), -1), smelt.ArgumentError, "k=-1"),
    (lambda: smelt.topk(np.ones((4, 8), F32), 2.5), smelt.DTypeError, "k=2.5 must be an int"),
    (lambda: smelt.gemm(np.ones((2, 2), F32), np.ones((2, 2), F32), out_dtype="float17"), smelt.DTypeError,
     "out_dtype='float17'"),
    (lambda: smelt.peer(*peer_args(), k=2 ** 40), smelt.ArgumentError, "k=1099511627776 must be in [1, 4]"),
    (lambda: smelt.attention(*[np.ones((1, 4, 2, 8), F32)] * 3, window=(1, 2, 3)), smelt.ArgumentError,
     "window=(1, 2, 3)"),
    (lambda: smelt.attention(*[np.ones((1, 4, 2, 8), F32)] * 3, window=(-5, 0)), smelt.ArgumentError,
     "window[0]=-5"),
])
def test_checked_before_numpy_allocates(call, exc, says):
    with pytest.raises(exc) as e:
        call()
    assert isinstance(e.value, smelt.Error) and says in str(e.value)


@pytest.mark.parametrize("call, says", [
    (lambda: smelt.attention(*[np.ones((1, 4, 2, 8), F32)] * 3, scale=float("nan")), "scale=nan"),
    (lambda: smelt.peer(*peer_args(), k=2, query_norm="layernorm", norm_eps=-1.0), "norm_eps=-1"),
])
def test_messages_name_python_arguments(call, says):
    with pytest.raises(smelt.ArgumentError) as e:
        call()
    assert says in str(e.value) and "desc->" not in str(e.value) and "cfg." not in str(e.value)


def run_python(code, **env):
    full = dict(os.environ, PYTHONPATH=PYTHON_DIR, **env)
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=120)


def test_smelt_device_is_the_default_device():
    r = run_python("import smelt; print(smelt.empty((2,)).device, smelt.Context().device, "
                   "smelt.PeerStore(num_experts=4, input_dim=2, output_dim=2, expert_hidden_size=1, dtype='f32')"
                   ".context.device)", SMELT_DEVICE="cpu")
    assert r.returncode == 0 and r.stdout.split() == ["cpu", "cpu", "cpu"], r.stderr
    r = run_python("import smelt; smelt.empty((2,))", SMELT_DEVICE="abc")
    assert r.returncode != 0 and 'SMELT_DEVICE "abc" is not cpu, cuda or cuda:N' in r.stderr


@pytest.mark.parametrize("name, value", [("SMELT_JIT", "bogus"), ("SMELT_LOG", "loud")])
def test_bad_environment_values(name, value):
    r = run_python("import numpy as np, smelt\n"
                   "try:\n    smelt.softmax(np.ones((2, 2), np.float32))\n"
                   "except smelt.ArgumentError as e:\n    print(e)", **{name: value})
    assert r.returncode == 0 and '%s="%s" is not one of' % (name, value) in r.stdout, r.stdout + r.stderr


def test_tensor_to_numpy():
    t = smelt.empty((2, 3), "f32", device="cpu")
    a = t.numpy()
    a[...] = 2.0
    assert np.asarray(t).dtype == F32 and (np.asarray(t) == 2.0).all()
    assert np.asarray(t, dtype=np.float64).dtype == np.float64
    c = np.array(t, copy=True)
    c[...] = 3.0
    assert (np.asarray(t) == 2.0).all()


@pytest.fixture
def ml_dtypes():
    return pytest.importorskip("ml_dtypes")


def test_bf16_through_numpy(ml_dtypes):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 16)).astype(ml_dtypes.bfloat16)
    y = smelt.softmax(x)
    assert y.dtype == ml_dtypes.bfloat16
    ref = np.exp(x.astype(np.float64))
    ref /= ref.sum(-1, keepdims=True)
    assert np.abs(y.astype(np.float64) - ref).max() < 1e-2
    d = smelt.gemm(x.astype(F32), x.T.astype(F32).copy(), out_dtype="bf16")
    assert d.dtype == ml_dtypes.bfloat16
    want = x.astype(np.float64) @ x.T.astype(np.float64)
    assert np.abs(d.astype(np.float64) - want).max() <= 1e-2 * np.abs(want).max()


def test_fp8_through_numpy(ml_dtypes):
    a = np.full((3, 4), 0.5).astype(ml_dtypes.float8_e4m3fn)
    d = smelt.gemm(a, a.T.copy(), out_dtype="f32")
    assert d.dtype == F32 and (d == 1.0).all()


def test_smelt_tensor_bf16_to_numpy(ml_dtypes):
    t = smelt.empty((2, 3), "bf16", device="cpu")
    a = t.numpy()
    assert a.dtype == ml_dtypes.bfloat16 and a.shape == (2, 3)
    a[...] = 1.5
    assert (np.asarray(t).astype(F32) == 1.5).all()
    assert smelt.empty((0, 3), "bf16", device="cpu").numpy().shape == (0, 3)
