"""What the epilogue-graph and fusion-planner tests share: the relative
error and the activations in float64 numpy."""

import math

import numpy as np


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)


def gelu(x):
    return 0.5 * x * np.vectorize(math.erfc)(-x / math.sqrt(2.0))


def silu(x):
    return x / (1.0 + np.exp(-x))
