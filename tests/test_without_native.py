"""The tests that call csrc/'s library, where it was not built (an install without nvcc, as the
README's test command runs on most laptops): they skip, saying why, and fail instead under
SYMCOMM_REQUIRE_NATIVE=1 (.ci/run's build with nvcc). A library path that does not exist stands
in for the missing build; .ci/run also runs the whole suite in an install without nvcc."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The files whose tests needed the library without saying so (issue 35), and one that said so.
FILES = ["tests/test_pool.py", "tests/test_custom_ar_logic.py", "tests/test_native_header.py"]
MISSING = "/nonexistent/libsymcomm.so"


def _pytest(**env: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SYMCOMM_REQUIRE_NATIVE"} | env
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *FILES],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_tests_that_need_the_library_skip_with_the_reason_where_it_is_missing():
    done = _pytest(SYMCOMM_NATIVE_LIBRARY=MISSING)
    assert done.returncode == 0, done.stdout + done.stderr
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert skips and all(f"needs csrc/'s native library: {MISSING}" in line for line in skips), done.stdout
    assert " failed" not in done.stdout and " error" not in done.stdout, done.stdout


def test_require_native_turns_those_skips_into_failures():
    done = _pytest(SYMCOMM_NATIVE_LIBRARY=MISSING, SYMCOMM_REQUIRE_NATIVE="1")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "SYMCOMM_REQUIRE_NATIVE=1 but" in done.stdout and "skipped" not in done.stdout, done.stdout
