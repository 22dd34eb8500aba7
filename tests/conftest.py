"""Settings for every test process, and for the ranks and scripts the tests start (they inherit
the environment); and the ``needs_native`` marker.

TORCHINDUCTOR_VEC_ISA_OK=0: torch.compile of CPU code otherwise probes the CPU's vector
instruction sets by compiling a test program per set, once per process: 46 s a process on the
GPU image (torch 2.11, measured 2026-11-25, bench/NOTES.md), 1.4 s on the CPU machine. Every rank
of every compiled test paid it, and it was most of the README test command's time there. The
tests check symcomm's operations under torch.compile, not Inductor's vectorisation; a value
the caller set is kept.

``@pytest.mark.needs_native`` (or the ``native_library`` fixture, which also hands over the loaded
library): the test calls csrc/'s library, which `pip install` builds only where it finds nvcc.
Without it the test skips, saying why the library is missing, as the README's test command must
pass on a machine without a CUDA toolkit. SYMCOMM_REQUIRE_NATIVE=1 turns that skip into a
failure, so a run that built the library (.ci/run) cannot pass by skipping its tests, as
SYMCOMM_REQUIRE_GPU=1 does for the GPU suites.

``setup_py``: the package's setup.py as a module (its nvcc search, flags and build steps), for
the tests of the build and of what nvcc makes of csrc/.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

REQUIRE_NATIVE = "SYMCOMM_REQUIRE_NATIVE"


def native_missing() -> str | None:
    """Why csrc/'s library does not load in this process, or None when it does."""
    from symcomm import _native  # not at import: the setting above must come before torch's

    try:
        _native.load()
    except OSError as exc:
        return str(exc)
    return None


def skip_without_native() -> None:
    reason = native_missing()
    if reason is None:
        return
    if os.environ.get(REQUIRE_NATIVE) == "1":
        pytest.fail(f"{REQUIRE_NATIVE}=1 but: {reason}", pytrace=False)
    pytest.skip(f"needs csrc/'s native library: {reason}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_native") is not None:
        skip_without_native()


@pytest.fixture(scope="session")
def native_library():
    """csrc/'s library, loaded (``_native.Native``); the test skips where there is none."""
    skip_without_native()
    from symcomm import _native

    return _native.load()


@pytest.fixture(scope="session")
def setup_py():
    # Imported, not run: setup() is called only when setuptools executes the file as __main__.
    spec = importlib.util.spec_from_file_location("symcomm_setup", Path(__file__).resolve().parents[1] / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Why tests skipped, grouped by reason, when pytest was not asked to list them (-rs): on a
    machine without GPUs over a thousand skip, and the count alone does not say that is expected."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped or "s" in (config.option.reportchars or "").replace("a", "s").replace("A", "s"):
        return
    reasons: dict[str, int] = {}
    for report in skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        reason = reason.removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason (-rs lists each test)")
    for reason, count in sorted(reasons.items(), key=lambda kv: -kv[1])[:6]:
        terminalreporter.write_line(f"{count:6d}  {reason[:150]}")
    if len(reasons) > 6:
        terminalreporter.write_line(f"{'':6}  ... and {len(reasons) - 6} more reasons")
