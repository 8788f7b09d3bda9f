"""How the binding finds NVRTC: the nvidia-cuda-nvrtc wheel that its own
Python imports is named in SMELT_NVRTC_PATH before libsmelt opens NVRTC (no
activated venv needed), an explicit SMELT_NVRTC_PATH is kept, and one naming
a missing file is an error that smelt.info() reports (no fallback)."""

import os
import subprocess
import sys

import smelt

# The folder smelt was imported from (an in-place build or site-packages).
SMELT_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(smelt.__file__)))


def run_smelt(code, env_extra, extra_path=()):
    env = {k: v for k, v in os.environ.items() if k not in ("SMELT_NVRTC_PATH", "VIRTUAL_ENV")}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, SMELT_PARENT])
    out = subprocess.run([sys.executable, "-c", "import smelt\n" + code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def fake_wheel(tmp_path):
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.13").write_bytes(b"")
    return str(lib / "libnvrtc.so.13")


def test_wheel_on_sys_path_is_named(tmp_path):
    want = fake_wheel(tmp_path)
    got = run_smelt("import os; print(os.environ['SMELT_NVRTC_PATH'])", {}, [str(tmp_path)])
    assert got == want


def test_explicit_path_is_kept(tmp_path):
    fake_wheel(tmp_path)
    got = run_smelt("import os; print(os.environ['SMELT_NVRTC_PATH'])", {"SMELT_NVRTC_PATH": "/x/libnvrtc.so.13"},
                    [str(tmp_path)])
    assert got == "/x/libnvrtc.so.13"


def test_missing_explicit_path_is_an_error(tmp_path):
    missing = str(tmp_path / "libnvrtc.so.13")
    got = run_smelt("i = smelt.info(); print(i['nvrtc_loaded'], i['nvrtc_error'])", {"SMELT_NVRTC_PATH": missing})
    assert got.startswith("False SMELT_NVRTC_PATH: " + missing)
