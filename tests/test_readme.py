"""The README is a front page that runs as written: short, its example is a file in examples/
(which tests/test_examples.py runs at world 2 and 3), and its first command is the one CI runs
in a fresh environment without nvcc (.ci/run, through .ci/readme_block.py), followed there by its
second, the test command."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return [b.strip() for b in re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)]


def test_the_readme_is_a_front_page():
    lines = README.count("\n")
    assert lines <= 150, f"README.md has {lines} lines; details belong in docs/"


def test_every_python_example_in_the_readme_is_a_file_in_examples():
    examples = {p.name: p.read_text().strip() for p in (ROOT / "examples").glob("*.py")}
    blocks = _blocks("python")
    assert blocks, "the README shows no example"
    for block in blocks:
        assert block in examples.values(), f"README example not in examples/ verbatim:\n{block[:200]}"


def test_the_first_two_commands_are_what_ci_runs():
    helper = runpy.run_path(str(ROOT / ".ci" / "readme_block.py"))
    blocks = helper["bash_blocks"](README)
    assert blocks == _blocks("bash")
    install, tests = blocks[:2]
    assert "pip install -e ." in install and "symcomm-bench " in install
    assert "python -m pytest tests" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_block.py 1" in ci and "python -m pytest tests" in ci
    # the test command as a newcomer runs it too, without nvcc, not only CI's own pytest call
    assert "readme_block.py 2" in ci and "SYMCOMM_REQUIRE_NATIVE=1 python -m pytest tests" in ci


def test_the_readme_names_the_commands_its_example_runs_with():
    assert "torchrun --nproc-per-node=2 examples/quickstart.py" in README
