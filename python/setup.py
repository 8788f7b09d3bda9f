"""Builds and installs smelt's Python package:

    pip install ./python                          # from the repository root
    pip install --no-build-isolation ./python     # offline: the installed setuptools (>= 70.1, or wheel too)
    SMELT_LIB_DIR=build pip install ./python      # link an existing CMake build's libsmelt.a

By default libsmelt's C sources are compiled into the extension (with the
embedded-kernels file made by the project's own generator, cmake/embed.c), so
installing needs only a C compiler and setuptools: no CMake, torch or CUDA
toolkit. The extension uses the Python 3.9 limited API: one abi3 wheel serves
every CPython >= 3.9.
"""

import os
import sys

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smelt_build as sb  # noqa: E402


def require_wheel_builder():
    """pip builds the wheel with the bdist_wheel command: setuptools' own from
    70.1 on, the wheel package's before. With neither (a fresh venv of Python
    3.11 has setuptools 65 and no wheel), --no-build-isolation used to fail
    with "invalid command 'bdist_wheel'"; say what to install instead."""
    for module in ("setuptools.command.bdist_wheel", "wheel.bdist_wheel"):
        try:
            __import__(module)
            return
        except ImportError:
            pass
    sys.exit("smelt: building the wheel needs setuptools >= 70.1 (this is %s) or the wheel package; "
             "run `pip install -U setuptools` (or `pip install wheel`), then install again" % setuptools.__version__)


class BuildExt(build_ext):
    def build_extension(self, ext):
        lib_dir = os.environ.get("SMELT_LIB_DIR")
        if lib_dir:
            # pip runs this from python/: a relative folder may be meant from the repository root.
            tried = [os.path.join(os.path.abspath(lib_dir), "libsmelt.a"), os.path.join(sb.REPO, lib_dir, "libsmelt.a")]
            lib = next((p for p in tried if os.path.exists(p)), None)
            if not lib:
                raise RuntimeError("SMELT_LIB_DIR: libsmelt.a not found at %s" % " or ".join(tried))
            ext.extra_objects = [lib]
        else:
            embedded = sb.generate_embedded(os.path.join(os.path.abspath(self.build_temp), "gen"))
            ext.sources = ext.sources + sb.library_sources() + [embedded]
            ext.include_dirs = ext.include_dirs + [os.path.join(sb.REPO, "src")]
        super().build_extension(ext)


def rel(paths):
    # setuptools wants paths relative to setup.py's folder (its working directory).
    return [os.path.relpath(p, sb.HERE) for p in paths]


ext = Extension(
    "smelt._smelt",
    sources=rel(sb.extension_sources()),
    depends=rel(sb.extension_headers()),
    include_dirs=rel([os.path.join(sb.REPO, "include")]),
    define_macros=[("Py_LIMITED_API", sb.LIMITED_API)] + [(d, None) for d in sb.LIB_DEFINES],
    extra_compile_args=sb.C_FLAGS,
    extra_link_args=["-Wl,--exclude-libs,ALL"],
    libraries=sb.LINK_LIBS,
    py_limited_api=True,
)

require_wheel_builder()
setup(
    name="smelt-kernels",
    version=sb.version(),
    description="Fused GPU kernels for machine learning (Python binding: DLPack, torch custom ops)",
    packages=["smelt"],
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
    python_requires=">=3.9",
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
    zip_safe=False,
)
