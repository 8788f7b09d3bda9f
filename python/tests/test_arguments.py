"""Arguments that are not what an op takes: a non-tensor where a tensor goes
(an int, None, a list), a sub_keys list of the wrong length or holding a
non-tensor, a store that is not a smelt.PeerStore, and stream= on a CPU
context. Each raises a smelt.Error naming the Python argument, never an
AttributeError or IndexError from inside the layer. numpy cases run
everywhere; the torch ones where torch is installed."""

import pytest

import smelt

NOT_TENSORS = [3, None, [1.0, 2.0]]


def peer_problem(xp, rand):
    """A small valid smelt.peer problem: (x, wq, sub_keys, u, v), k=2."""
    x, wq = rand(xp, (5, 8)), rand(xp, (8, 2 * 4))
    sub_keys = [rand(xp, (4, 2)), rand(xp, (3, 2))]
    u, v = rand(xp, (12, 8, 1)), rand(xp, (12, 1, 6))
    return x, wq, sub_keys, u, v


def grouped_problem(xp, rand, offs):
    return rand(xp, (6, 4)), rand(xp, (2, 4, 3)), offs


def np_rand(np, shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def check_names(exc, op, name):
    """A smelt.Error whose message starts with op and names the argument."""
    assert isinstance(exc.value, smelt.Error), type(exc.value)
    msg = str(exc.value)
    assert msg.startswith(op + ":") and name in msg, msg


def peer_cases(x, wq, sub_keys, u, v):
    """(argument name, call) for each non-tensor in each of peer's tensor
    arguments, including the lists."""
    for bad in NOT_TENSORS:
        yield "x", lambda bad=bad: smelt.peer(bad, wq, sub_keys, u, v, k=2)
        yield "wq", lambda bad=bad: smelt.peer(x, bad, sub_keys, u, v, k=2)
        yield "sub_keys[1]", lambda bad=bad: smelt.peer(x, wq, [sub_keys[0], bad], u, v, k=2)
        yield "v", lambda bad=bad: smelt.peer(x, wq, sub_keys, u, bad, k=2)
        yield "u", lambda bad=bad: smelt.peer(x, wq, sub_keys, bad, v, k=2)
        if bad is not None:
            yield "bq", lambda bad=bad: smelt.peer(x, wq, sub_keys, u, v, k=2, bq=bad)
            yield "out", lambda bad=bad: smelt.peer(x, wq, sub_keys, u, v, k=2, out=bad)
            yield "store", lambda bad=bad: smelt.peer(x, wq, sub_keys, k=2, store=bad)
    yield "sub_keys", lambda: smelt.peer(x, wq, 7, u, v, k=2)
    yield "sub_keys", lambda: smelt.peer(x, wq, sub_keys[:1], u, v, k=2)
    yield "sub_keys", lambda: smelt.peer(x, wq, sub_keys * 3, u, v, k=2)
    yield "x", lambda: smelt.peer_retrieve(3, wq, sub_keys, u, v, k=2)
    yield "bq", lambda: smelt.peer_backward(x, None, None, wq, sub_keys, u, v, k=2, bq=3)


def grouped_cases(a, b, offs):
    for bad in NOT_TENSORS:
        yield "a", lambda bad=bad: smelt.gemm_grouped(bad, b, offs)
        yield "b", lambda bad=bad: smelt.gemm_grouped(a, bad, offs)
        yield "offs", lambda bad=bad: smelt.gemm_grouped(a, b, bad)
        if bad is not None:
            yield "c", lambda bad=bad: smelt.gemm_grouped(a, b, offs, c=bad)
            yield "bias", lambda bad=bad: smelt.gemm_grouped(a, b, offs, bias=bad)
            yield "out", lambda bad=bad: smelt.gemm_grouped(a, b, offs, out=bad)
    yield "b", lambda: smelt.gemm_grouped(a, [b[0], b[1]], offs)


def test_peer_non_tensors_numpy():
    np = pytest.importorskip("numpy")
    x, wq, sub_keys, u, v = peer_problem(np, np_rand)
    assert smelt.peer(x, wq, sub_keys, u, v, k=2).shape == (5, 6)  # the problem itself is valid
    for name, call in peer_cases(x, wq, sub_keys, u, v):
        with pytest.raises(smelt.Error) as e:
            call()
        assert name in str(e.value), (name, str(e.value))
        assert str(e.value).startswith(("smelt.peer:", "smelt.peer_retrieve:", "smelt.peer_backward:")), str(e.value)


def test_gemm_grouped_non_tensors_numpy():
    np = pytest.importorskip("numpy")
    a, b, offs = grouped_problem(np, np_rand, np.array([2, 6], np.int32))
    assert smelt.gemm_grouped(a, b, offs).shape == (6, 3)
    for name, call in grouped_cases(a, b, offs):
        with pytest.raises(smelt.Error) as e:
            call()
        check_names(e, "smelt.gemm_grouped", name)


def test_non_tensor_keeps_type_error():
    # A non-tensor is a TypeError as before, now also a smelt.Error (DTypeError).
    with pytest.raises(TypeError) as e:
        smelt.softmax(3)
    assert isinstance(e.value, smelt.DTypeError)


def test_stream_on_cpu_is_refused():
    np = pytest.importorskip("numpy")
    x, wq, sub_keys, u, v = peer_problem(np, np_rand)
    a, b, offs = grouped_problem(np, np_rand, np.array([2, 6], np.int32))
    calls = [lambda: smelt.peer(x, wq, sub_keys, u, v, k=2, stream=12345),
             lambda: smelt.gemm_grouped(a, b, offs, stream=12345),
             lambda: smelt.softmax(a, stream=12345),
             lambda: smelt.default_context("cpu").synchronize(stream=12345)]
    for call in calls:
        with pytest.raises(smelt.Error, match="CPU context has no streams") as e:
            call()
        assert e.value.status_name == "SMELT_STATUS_WRONG_DEVICE"
    # None and 0 (no stream) stay accepted, as NULL is by smelt_ctx_set_stream.
    assert smelt.softmax(a, stream=0).shape == a.shape


def test_non_tensors_torch():
    torch = pytest.importorskip("torch")

    def t_rand(_, shape):
        return torch.randn(shape, dtype=torch.float32)

    x, wq, sub_keys, u, v = peer_problem(torch, t_rand)
    assert tuple(smelt.peer(x, wq, sub_keys, u, v, k=2).shape) == (5, 6)
    for name, call in peer_cases(x, wq, sub_keys, u, v):
        with pytest.raises(smelt.Error) as e:
            call()
        assert name in str(e.value), (name, str(e.value))
    a, b, offs = grouped_problem(torch, t_rand, torch.tensor([2, 6], dtype=torch.int32))
    for name, call in grouped_cases(a, b, offs):
        with pytest.raises(smelt.Error) as e:
            call()
        check_names(e, "smelt.gemm_grouped", name)
    with pytest.raises(smelt.Error, match="CPU context has no streams"):
        smelt.gemm_grouped(a, b, offs, stream=12345)
