"""scripts/verify_report.py: a step the deadline skipped is counted as not run, and the
verification does not pass."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _report(tmp_path: Path, lines: list[str]) -> subprocess.CompletedProcess:
    (tmp_path / "outcomes_partall.tsv").write_text("# date: test\n" + "\n".join(lines) + "\n")
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "verify_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)


def test_all_passed_exits_0(tmp_path):
    done = _report(tmp_path, ["tests_gpu\tPASS\t642 passed\t83\tpytest", "bench_moe\tPASS\texit 0\t13\tsymcomm-bench moe"])
    assert done.returncode == 0, done.stdout
    assert "verify: 2 passed, 0 failed, of 2 steps" in done.stdout
    assert "**2 passed, 0 failed, of 2 steps.**" in (tmp_path / "README.md").read_text()


def test_a_step_not_run_is_counted_and_fails_the_verification(tmp_path):
    done = _report(tmp_path, ["tests_gpu\tPASS\t642 passed\t83\tpytest",
                              "train_step\tNOT RUN\tdeadline: under 30 s left\t0\ttorchrun bench/train_step.py"])
    assert done.returncode == 1, done.stdout
    assert "verify: 1 passed, 0 failed, 1 not run (deadline), of 2 steps" in done.stdout
    assert "| train_step | NOT RUN |" in (tmp_path / "README.md").read_text()


def test_a_failure_fails_the_verification(tmp_path):
    done = _report(tmp_path, ["bench_moe\tFAIL\texit 1\t13\tsymcomm-bench moe"])
    assert done.returncode == 1
    assert "verify: 0 passed, 1 failed, of 1 steps" in done.stdout
