"""What the torch tests share: the devices to run on, the mark for CUDA-only
cases, seeded random tensors and the relative error against a float64
reference. Import it after pytest.importorskip("torch"); the seeded
generator is the `gen` fixture of conftest.py."""

import pytest
import torch

import smelt

CUDA = torch.cuda.is_available() and smelt.info()["device_count"] > 0
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def randn(gen, shape, dtype=torch.float32, device="cpu", scale=1.0):
    """Normal values drawn in float64 from gen on the CPU (the same on every
    device), scaled, then moved to device and rounded to dtype."""
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)


def rel(got, want):
    """‖got - want‖ / ‖want‖ in float64."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
