"""Shared fixtures for smelt's Python tests.

Run from the repository root, either against an in-place build
(PYTHONPATH=python after python/build_inplace.py) or an installed package.
Inputs are fresh seeded random numbers; the seed is printed on failure."""

import os
import random

import pytest


@pytest.fixture
def seed(request):
    s = int(os.environ.get("SMELT_TEST_SEED", random.randrange(1 << 30)))
    request.node.user_properties.append(("seed", s))
    yield s


@pytest.fixture
def rng(seed):
    np = pytest.importorskip("numpy")
    return np.random.default_rng(seed)


@pytest.fixture
def gen(seed):
    torch = pytest.importorskip("torch")
    return torch.Generator().manual_seed(seed)


def pytest_runtest_makereport(item, call):
    # A skip raises too: only a failure names its seed.
    if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        for k, v in item.user_properties:
            if k == "seed":
                print("\n[smelt] %s failed with SMELT_TEST_SEED=%d" % (item.nodeid, v))
