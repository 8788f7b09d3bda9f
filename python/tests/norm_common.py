"""What the norm and rotary tests share: the rotary reference in float64
numpy (the torch tests convert their tensors to it)."""

import numpy as np


def ref_rotary(x, cos, sin, pos, layout, inverse):
    x = x.astype(np.float64)
    B, S, H, D = x.shape
    half = cos.shape[1]
    p = np.broadcast_to(np.arange(S), (B, S)) if pos is None else np.clip(pos, 0, cos.shape[0] - 1)
    c = cos[p][:, :, None, :].astype(np.float64)
    s = sin[p][:, :, None, :].astype(np.float64) * (-1 if inverse else 1)
    y = x.copy()
    if layout == "neox":
        x1, x2 = x[..., :half], x[..., half:2 * half]
        y[..., :half], y[..., half:2 * half] = x1 * c - x2 * s, x2 * c + x1 * s
    else:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
        y[..., 0:2 * half:2], y[..., 1:2 * half:2] = x1 * c - x2 * s, x2 * c + x1 * s
    return y
