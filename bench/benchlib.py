"""Small helpers shared by the bench/*_vs_*.py peer scripts (run from any
folder: each script puts bench/ first on sys.path, as Python does for the
script's own folder)."""

import math
import os
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit():
    """The short HEAD of the repository, "-dirty" when tracked files changed.
    A tree exported without .git (git archive, as the GPU runs use) is
    inside some other checkout or none: SMELT_COMMIT names its commit."""
    if os.environ.get("SMELT_COMMIT"):
        return os.environ["SMELT_COMMIT"]
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + ("-dirty" if dirty else "") if rev else "unknown"
    except Exception:
        return "unknown"


def fmt(v, spec, width=0):
    """v formatted, or "-" (right-aligned in `width`) when there is no number."""
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "-".rjust(width)
