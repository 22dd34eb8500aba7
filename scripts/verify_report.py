"""The verification's one screen and its README, from the outcomes files of a verify folder.

    python3 scripts/verify_report.py FOLDER

scripts/gpu_check.sh's verify mode appends one tab-separated line per step to
FOLDER/outcomes_part<N>.tsv (name, PASS, FAIL or NOT RUN, detail, seconds, command); this merges
every part's lines, prints them as one table with the counts, writes FOLDER/README.md (the
commands and their outcomes, failures included, and where each raw log is), and exits 1 if any
step failed or was not run (the deadline came first), or none ran.
"""
from __future__ import annotations

import sys
from pathlib import Path

FIELDS = ("step", "outcome", "detail", "seconds", "command")


def read(folder: Path) -> tuple[list[dict[str, str]], list[str]]:
    rows, headers = [], []
    for path in sorted(folder.glob("outcomes_part*.tsv")):
        for line in path.read_text().splitlines():
            if line.startswith("#"):
                headers.append(line[1:].strip())
            elif line.strip():
                rows.append(dict(zip(FIELDS, line.split("\t"))))
    return rows, headers


def screen(rows: list[dict[str, str]]) -> str:
    width = max([len(r["step"]) for r in rows] + [4])
    result = max([len(r["outcome"]) for r in rows] + [6])  # "NOT RUN" is wider than "result"
    lines = [f"{'step':<{width}}  {'result':<{result}}  detail"]
    lines += [f"{r['step']:<{width}}  {r['outcome']:<{result}}  {r.get('detail', '')}" for r in rows]
    lines.append(f"verify: {counts(rows)}")
    return "\n".join(lines)


def counts(rows: list[dict[str, str]]) -> str:
    passed = sum(r["outcome"] == "PASS" for r in rows)
    skipped = sum(r["outcome"] == "NOT RUN" for r in rows)
    text = f"{passed} passed, {len(rows) - passed - skipped} failed"
    return text + (f", {skipped} not run (deadline)" if skipped else "") + f", of {len(rows)} steps"


def readme(folder: Path, rows: list[dict[str, str]], headers: list[str]) -> str:
    out = [f"# {folder.name}", "",
           "World-N verification by `scripts/gpu_check.sh verify` (PART=1: tests/gpu and the examples; "
           "PART=2: every symcomm-bench op with --algo all, bench/layer_step.py and bench/train_step.py, and "
           "where carried nccl-tests' all-to-all and FlashInfer's fused norm as yardsticks), "
           "one device call per part. A sweep fails on any #wrong above 0; tests fail on any failure, error "
           "or skip, on either rank. Raw output of each step: `logs/<step>.log` (tests: one log per rank).", ""]
    out += [f"- {h}" for h in headers]
    out += ["", "| step | outcome | detail | seconds | command |", "|---|---|---|---|---|"]
    for r in rows:
        cells = [r.get(f, "").replace("|", "\\|") for f in FIELDS]
        cells[4] = f"`{cells[4]}`"
        out.append("| " + " | ".join(cells) + " |")
    out += ["", f"**{counts(rows)}.**", ""]
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    folder = Path(argv[0])
    rows, headers = read(folder)
    (folder / "README.md").write_text(readme(folder, rows, headers))
    print(screen(rows))
    return 0 if rows and all(r["outcome"] == "PASS" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
