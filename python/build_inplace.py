#!/usr/bin/env python3
"""Builds smelt's extension into python/smelt/ for use without installing:

    python3 python/build_inplace.py --lib build      # link build/libsmelt.a (CMake)
    python3 python/build_inplace.py --from-source    # compile libsmelt's sources too
    PYTHONPATH=python python3 -m pytest python/tests

Needs only a C compiler and Python's headers (no setuptools, torch or CUDA
toolkit). Does nothing when the extension is newer than all of its inputs.
"""

import argparse
import glob
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import smelt_build as sb  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=None, help="CMake build folder holding libsmelt.a (default: build)")
    ap.add_argument("--from-source", action="store_true", help="compile libsmelt's sources into the extension")
    ap.add_argument("--debug", action="store_true", help="-O0 -g")
    ap.add_argument("--sanitize", action="store_true", help="AddressSanitizer + UBSan (needs LD_PRELOAD of libasan)")
    ap.add_argument("--force", action="store_true", help="rebuild even when up to date")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()

    pkg = os.path.join(sb.HERE, "smelt")
    out = os.path.join(pkg, "_smelt.abi3.so")
    cc = sb.c_compiler()
    flags = ["-O0", "-g"] if args.debug else ["-O2", "-g"]
    if args.sanitize:
        flags += ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    cmd = cc + flags + sb.C_FLAGS + ["-fPIC", "-shared", "-DPy_LIMITED_API=" + sb.LIMITED_API]
    cmd += ["-D" + d for d in sb.LIB_DEFINES]
    cmd += ["-I" + os.path.join(sb.REPO, "include"), "-I" + sb.python_include()]
    inputs = sb.extension_sources() + sb.extension_headers()
    sources = sb.extension_sources()

    if args.from_source:
        gen_dir = os.path.join(sb.HERE, "build", "gen")
        embedded = sb.generate_embedded(gen_dir, cc)
        lib_sources = sb.library_sources() + [embedded]
        cmd += ["-I" + os.path.join(sb.REPO, "src")]
        sources = sources + lib_sources
        inputs += lib_sources + glob.glob(os.path.join(sb.REPO, "src", "*", "*.h"))
        libs = []
    else:
        lib_dir = os.path.abspath(args.lib or os.path.join(sb.REPO, "build"))
        lib = os.path.join(lib_dir, "libsmelt.a")
        if not os.path.exists(lib):
            sys.exit("build_inplace: %s not found: build the library first (cmake -S . -B build && "
                     "cmake --build build), or use --from-source" % lib)
        inputs.append(lib)
        libs = [lib]

    if not args.force and not sb.newer_than(inputs + [os.path.abspath(__file__), sb.__file__], out):
        print("build_inplace: %s is up to date" % os.path.relpath(out))
        return
    # An interpreter-specific build (e.g. from setup.py build_ext --inplace)
    # would shadow the abi3 one on import; remove it.
    for stale in glob.glob(os.path.join(pkg, "_smelt.*.so")):
        if stale != out:
            os.remove(stale)
    # --exclude-libs keeps libsmelt's symbols out of the dynamic symbol table:
    # only PyInit__smelt is exported.
    cmd += sources + libs + ["-o", out + ".tmp", "-Wl,--exclude-libs,ALL"] + ["-l" + l for l in sb.LINK_LIBS]
    if args.verbose:
        print(" ".join(cmd))
    subprocess.check_call(cmd)
    # Load it once before putting it in place, so a library with missing
    # symbols fails here, by name, rather than at the first import.
    probe = ("import importlib.machinery as m, importlib.util as u; "
             "s = u.spec_from_file_location('smelt._smelt', %r, "
             "loader=m.ExtensionFileLoader('smelt._smelt', %r)); u.module_from_spec(s)") % ((out + ".tmp",) * 2)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        os.remove(out + ".tmp")
        sys.exit("build_inplace: the built extension does not load:\n" + r.stderr.strip().splitlines()[-1])
    os.replace(out + ".tmp", out)
    print("build_inplace: built %s" % os.path.relpath(out))


if __name__ == "__main__":
    main()
