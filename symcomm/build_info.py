"""setup.py's record of its nvcc build: built, with what, or why not.

setup.py writes ``_native/build.json`` beside the library, because pip shows a build's own
output only with -v; this module reads it, for _native's error when the library is missing and
for about.py's report. It imports nothing of symcomm's.
"""
from __future__ import annotations

import json
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "_native"
STATUS_FILE = NATIVE_DIR / "build.json"
INSTALL_DOC = "docs/install.md"


def build_record() -> dict | None:
    """setup.py's record of the last build of this copy, or None where it never ran (a
    checkout imported through PYTHONPATH, say)."""
    try:
        return json.loads(STATUS_FILE.read_text())
    except (OSError, ValueError):
        return None


def not_built_reason() -> str:
    """Why this copy has no native library, in one line (the record's reason, or the lack of one)."""
    record = build_record()
    if record is None:
        return ("this copy of symcomm was never built: install it with pip "
                f"(pip install -e .), with nvcc found, to get its kernels ({INSTALL_DOC})")
    if record.get("built"):
        return f"the build recorded {record.get('library')}, which is missing: reinstall ({INSTALL_DOC})"
    return f"not built at install: {record.get('reason')} ({INSTALL_DOC})"


def archs(flags: str) -> str:
    """'-gencode=arch=compute_90,code=sm_90 ...' -> 'sm_90 + compute_90 PTX'."""
    codes = [part.rsplit("code=", 1)[-1] for part in flags.split() if "code=" in part]
    if not codes:
        return flags or "default archs"
    return " + ".join(c if c.startswith("sm_") else f"{c} PTX" for c in codes)
