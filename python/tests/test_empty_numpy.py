"""Empty numpy arrays through every op on the CPU (issue 26): numpy gives a
size-0 array strides of 0, which smelt must neither refuse as a layout
error nor pass on to the outputs it allocates."""

import pytest

np = pytest.importorskip("numpy")
import smelt  # noqa: E402

F32 = np.float32


def empty(*shape):
    a = np.zeros(shape, F32)
    assert a.size == 0
    return a


def check_empty_out(r, *shapes):
    r = r if isinstance(r, tuple) else (r,)
    assert [tuple(t.shape) for t in r] == [tuple(s) for s in shapes]


@pytest.mark.parametrize("shape", [(0, 8), (3, 0, 8), (0, 0, 8)])
def test_row_ops(shape):
    x = empty(*shape)
    check_empty_out(smelt.activation(x, "gelu"), shape)
    check_empty_out(smelt.softmax(x, return_lse=True), shape, shape[:-1])
    check_empty_out(smelt.topk(x, 2), shape[:-1] + (2,), shape[:-1] + (2,))


def test_gemm():
    check_empty_out(smelt.gemm(empty(0, 8), np.ones((8, 3), F32)), (0, 3))
    check_empty_out(smelt.gemm(np.ones((4, 8), F32), empty(8, 0)), (4, 0))
    d = smelt.gemm(empty(4, 0), empty(0, 3))
    assert d.shape == (4, 3) and not d.any()


def test_gemm_grouped():
    check_empty_out(smelt.gemm_grouped(empty(0, 8), np.ones((2, 8, 3), F32), np.array([0, 0], np.int32)), (0, 3))
    d = smelt.gemm_grouped(empty(4, 0), empty(2, 0, 3), np.array([2, 4], np.int32))
    assert d.shape == (4, 3) and not d.any()


@pytest.mark.parametrize("b, sq, sk", [(0, 4, 4), (1, 0, 4), (1, 0, 0), (2, 3, 0)])
def test_attention(b, sq, sk):
    q, k = np.ones((b, sq, 2, 8), F32), np.ones((b, sk, 2, 8), F32)
    o, lse = smelt.attention(q, k, k, return_lse=True)
    check_empty_out((o, lse), (b, sq, 2, 8), (b, 2, sq))
    d_o = np.ones_like(o)
    check_empty_out(smelt.attention_backward(q, k, k, o, d_o, lse), q.shape, k.shape, k.shape)


def test_attention_varlen():
    # Two sequences, the second with no queries and the first with no keys.
    q, k = np.ones((3, 2, 8), F32), empty(0, 2, 8)
    cq, ck = np.array([0, 3, 3], np.int32), np.array([0, 0, 0], np.int32)
    check_empty_out(smelt.attention_varlen(q, k, k, cq, ck, 3, 0), (3, 2, 8))
    qe = empty(0, 2, 8)
    ce = np.array([0, 0], np.int32)
    o, lse = smelt.attention_varlen(qe, qe, qe, ce, ce, 0, 0, return_lse=True)
    check_empty_out((o, lse), (0, 2, 8), (2, 0))


def peer_weights(d_in=6, d_out=5, h=2, dq=4, n=3):
    rng = np.random.default_rng(0)
    wq = rng.standard_normal((d_in, h * dq)).astype(F32)
    keys = [rng.standard_normal((n, dq // 2)).astype(F32) for _ in range(2)]
    u = rng.standard_normal((n * n, d_in, 1)).astype(F32)
    v = rng.standard_normal((n * n, 1, d_out)).astype(F32)
    return wq, keys, u, v


def test_peer():
    wq, keys, u, v = peer_weights()
    x = empty(0, 6)
    y, ids, scores = smelt.peer(x, wq, keys, u, v, k=2, return_ids=True)
    check_empty_out((y, ids, scores), (0, 5), (0, 2, 2), (0, 2, 2))
    check_empty_out(smelt.peer_retrieve(x, wq, keys, u, v, k=2), (0, 2, 2), (0, 2, 2))
    grads = smelt.peer_backward(x, ids, empty(0, 5), wq, keys, u, v, k=2)
    assert grads["dx"].shape == (0, 6)
    assert not grads["dwq"].any() and not grads["du"].any()


def test_peer_store():
    wq, keys, u, v = peer_weights()
    store = smelt.PeerStore(9, 6, 5, dtype="f32", use_env=False, device="cpu")
    store.write(0, u, v)
    x = empty(0, 6)
    y, ids, _ = smelt.peer(x, wq, keys, store=store, k=2, return_ids=True)
    check_empty_out((y, ids), (0, 5), (0, 2, 2))
    grads = smelt.peer_backward(x, ids, empty(0, 5), wq, keys, store=store, k=2)
    assert grads["dx"].shape == (0, 6) and grads["grad_ids"].shape == (0,)
    assert grads["du_rows"].shape == (0, 6, 1) and not grads["dwq"].any()


def test_smelt_allocated_outputs():
    # A producer smelt does not know gets smelt.Tensor outputs: empty ones too.
    class Wrapped:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kw):
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.a.__dlpack_device__()

    y = smelt.softmax(Wrapped(empty(0, 8)))
    assert isinstance(y, smelt.Tensor) and tuple(y.shape) == (0, 8)
    o = smelt.attention(*(Wrapped(empty(1, 0, 2, 8)) for _ in range(3)))
    assert tuple(o.shape) == (1, 0, 2, 8)
