"""smelt.conv2d, conv2d_dgrad and conv2d_wgrad with numpy, where torch may
be absent: fprop against a direct convolution in float64, dgrad and wgrad
as fprop's adjoints, layout 'nchw' through transposed views, and bad
arguments raising smelt.Error. test_conv2d_torch.py compares against
torch."""

import pytest

import smelt

np = pytest.importorskip("numpy")


def direct(x, w, stride, pads, dilation):
    """y [N, P, Q, K] of x [N, H, W, C] and w [K, R, S, C] in float64:
    a sum over the taps of shifted, strided slices of the padded input."""
    (sh, sw), (dh, dw) = stride, dilation
    xp = np.pad(x.astype(np.float64), ((0, 0), pads[:2], pads[2:], (0, 0)))
    k, r, s, _ = w.shape
    p = (xp.shape[1] - dh * (r - 1) - 1) // sh + 1
    q = (xp.shape[2] - dw * (s - 1) - 1) // sw + 1
    y = np.zeros((x.shape[0], p, q, k))
    for i in range(r):
        for j in range(s):
            taps = xp[:, i * dh:i * dh + (p - 1) * sh + 1:sh, j * dw:j * dw + (q - 1) * sw + 1:sw, :]
            y += taps @ w[:, i, j, :].astype(np.float64).T
    return y


# (x shape, w shape, stride, padding as (top, bottom, left, right), dilation)
CASES = [
    ((2, 7, 9, 3), (5, 3, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1)),
    ((1, 11, 6, 4), (3, 3, 2, 4), (2, 2), (0, 0, 0, 0), (1, 1)),
    ((2, 9, 10, 5), (6, 3, 3, 5), (1, 1), (3, 3, 3, 3), (2, 2)),
    ((1, 13, 12, 3), (4, 7, 7, 3), (2, 2), (3, 3, 3, 3), (1, 1)),
    ((2, 8, 9, 3), (2, 3, 2, 3), (2, 1), (1, 0, 2, 1), (1, 2)),
]


def problem(rng, case):
    xs, ws = case[:2]
    return rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)


@pytest.mark.parametrize("case", CASES)
def test_fprop_dgrad_wgrad(rng, case):
    _, _, stride, pads, dilation = case
    x, w = problem(rng, case)
    kw = dict(stride=stride, padding=pads, dilation=dilation, ctx=smelt.default_context("cpu"))
    y = smelt.conv2d(x, w, **kw)
    want = direct(x, w, stride, pads, dilation)
    assert y.shape == want.shape and y.dtype == np.float32
    assert np.linalg.norm(y - want) <= 1e-6 * np.linalg.norm(want)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dx = smelt.conv2d_dgrad(dy, w, x.shape, **kw)
    dw = smelt.conv2d_wgrad(dy, x, w.shape, **kw)
    # The adjoint identity <conv(x, w), dy> = <x, dx> = <w, dw>.
    lhs = float((want * dy).sum())
    scale = float(np.abs(want * dy).sum())
    assert abs(lhs - float((x.astype(np.float64) * dx).sum())) <= 1e-5 * scale
    assert abs(lhs - float((w.astype(np.float64) * dw).sum())) <= 1e-5 * scale


def test_plans_per_geometry(rng):
    """Calls of the same shapes and different padding, stride, dilation,
    alpha or activation each get their own cached plan (the plan key holds
    every field of the description)."""
    x, w = rng.standard_normal((1, 9, 9, 2)).astype(np.float32), rng.standard_normal((3, 3, 3, 2)).astype(np.float32)
    ctx = smelt.default_context("cpu")
    for pads, stride, dilation in (((1, 0, 2, 1), (1, 1), (1, 1)), ((0, 1, 1, 2), (1, 1), (1, 1)),
                                   ((2, 2, 2, 2), (1, 1), (2, 2)), ((3, 2, 3, 2), (2, 2), (1, 1))):
        want = direct(x, w, stride, pads, dilation)
        for alpha, act in ((1.0, "identity"), (-0.5, "relu")):
            y = smelt.conv2d(x, w, padding=pads, stride=stride, dilation=dilation, alpha=alpha, activation=act,
                             ctx=ctx)
            ref = alpha * want if act == "identity" else np.maximum(alpha * want, 0)
            assert y.shape == ref.shape and np.abs(y - ref).max() <= 1e-5 * (1 + np.abs(ref).max())


def test_nchw_views(rng):
    case = CASES[3]
    _, _, stride, pads, dilation = case
    x, w = problem(rng, case)
    ctx = smelt.default_context("cpu")
    y = smelt.conv2d(x.transpose(0, 3, 1, 2), w.transpose(0, 3, 1, 2), stride=stride, padding=pads, layout="nchw",
                     ctx=ctx)
    assert np.array_equal(y, smelt.conv2d(x, w, stride=stride, padding=pads, ctx=ctx).transpose(0, 3, 1, 2))


def test_epilogue(rng):
    x, w = problem(rng, CASES[0])
    bias = rng.standard_normal(5).astype(np.float32)
    c = rng.standard_normal((2, 7, 9, 5)).astype(np.float32)
    y = smelt.conv2d(x, w, bias, c, padding=1, alpha=0.5, beta=2.0, activation="relu",
                     ctx=smelt.default_context("cpu"))
    want = np.maximum(0.5 * direct(x, w, (1, 1), (1, 1, 1, 1), (1, 1)) + 2.0 * c + bias, 0)
    assert np.linalg.norm(y - want) <= 1e-6 * np.linalg.norm(want)


def test_bad_arguments(rng):
    x, w = problem(rng, CASES[0])
    calls = [
        ("x", lambda: smelt.conv2d(3, w)),
        ("w", lambda: smelt.conv2d(x, None)),
        ("x", lambda: smelt.conv2d(x[0], w)),
        ("dtype", lambda: smelt.conv2d(x.astype(np.int32), w.astype(np.int32))),
        ("dtype", lambda: smelt.conv2d(x, w.astype(np.float16))),
        ("C", lambda: smelt.conv2d(x, w[..., :2])),
        ("padding", lambda: smelt.conv2d(x, w, padding=(1, 2, 3))),
        ("layout", lambda: smelt.conv2d(x, w, layout="NHWC")),
        ("x_shape", lambda: smelt.conv2d_dgrad(x, w)),
    ]
    for what, call in calls:
        with pytest.raises(smelt.Error) as exc:
            call()
        assert what.lower() in str(exc.value).lower(), (what, str(exc.value))
