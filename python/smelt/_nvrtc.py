"""Finds NVRTC in the nvidia-cuda-nvrtc wheel that this Python imports.

libsmelt alone cannot know which Python runs it (a venv's python run by its
full path sets no VIRTUAL_ENV), so smelt names the wheel's library in
SMELT_NVRTC_PATH at import, before libsmelt opens NVRTC. scripts/setup-deps
and `make test` run this file as a script, before the binding is built: it
imports nothing of smelt.
"""

import glob
import importlib.util
import os

# The CUDA 13 wheel's folder, then the CUDA 12 one's (nvidia-cuda-nvrtc-cu12).
_WHEEL_LIB_DIRS = ("cu13/lib", "cuda_nvrtc/lib")


def wheel_library():
    """The path of the wheel's libnvrtc.so.N, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    roots = (spec.submodule_search_locations or []) if spec else []
    for root in roots:
        for sub in _WHEEL_LIB_DIRS:
            found = sorted(glob.glob(os.path.join(root, sub, "libnvrtc.so.[0-9]*")))
            if found:
                return found[-1]
    return None


def name_wheel_library():
    """Sets SMELT_NVRTC_PATH to the wheel's library, unless it is set already."""
    lib = None if os.environ.get("SMELT_NVRTC_PATH") else wheel_library()
    if lib:
        os.environ["SMELT_NVRTC_PATH"] = lib


if __name__ == "__main__":
    print(wheel_library() or "")
