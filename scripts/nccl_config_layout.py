"""Print the C layout of NCCL's ncclConfig_t, as a compiler lays it out, for one or more headers.

    python scripts/nccl_config_layout.py --git NCCL_REPO v2.28.9-1 v2.29.2-1 ...
    python scripts/nccl_config_layout.py --header NCCL_H --source "what it is"

For each header it cuts out the ``typedef struct ncclConfig_v... { ... } ncclConfig_t;`` block
verbatim (the struct uses only C's own types), compiles a tiny C program around it with ``cc``
and prints ``sizeof`` and every field's ``offsetof``/``sizeof`` as JSON, together with the
entries of ``NCCL_CONFIG_INITIALIZER`` in order. ``--git`` reads ``src/nccl.h.in`` and
``makefiles/version.mk`` at each tag of a clone of the NCCL repository; ``--header`` reads an
installed ``nccl.h`` (its version comes from its own ``NCCL_MAJOR/MINOR/PATCH``).

tests/golden/nccl_config_layouts.json is this script's output, and tests/test_nccl_config.py
holds symcomm's ctypes structs to it: CI has no NCCL and cannot fetch headers, so the table is
the header's word, written down once.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_STRUCT = re.compile(r"typedef struct (ncclConfig_v\d+) \{(.*?)\} ncclConfig_t;", re.DOTALL)
_INITIALIZER = re.compile(r"#define NCCL_CONFIG_INITIALIZER \{(.*?)\n\}", re.DOTALL)
_FIELD = re.compile(r"^\s*([A-Za-z_][\w\s\*]*?[\s\*])(\w+)\s*;")


def _fields(body: str) -> list[str]:
    without_comments = re.sub(r"/\*.*?\*/", "", body, flags=re.DOTALL)
    names = []
    for line in without_comments.splitlines():
        if match := _FIELD.match(line):
            names.append(match.group(2))
    return names


def _initializer(text: str) -> list[list[str]]:
    """[comment name, value text] per entry of NCCL_CONFIG_INITIALIZER."""
    match = _INITIALIZER.search(text)
    if not match:
        raise SystemExit("no NCCL_CONFIG_INITIALIZER in the header")
    entries = []
    for line in match.group(1).splitlines():
        line = line.rstrip("\\").strip()
        if m := re.match(r"(.+?),\s*/\*\s*(\w+)\s*\*/", line):
            entries.append([m.group(2), m.group(1).strip()])
    return entries


def layout(text: str) -> dict:
    match = _STRUCT.search(text)
    if not match:
        raise SystemExit("no ncclConfig_t in the header")
    tag, body = match.groups()
    names = _fields(body)
    lines = ["#include <stddef.h>", "#include <stdio.h>",
             f"typedef struct {tag} {{{body}}} ncclConfig_t;",
             "int main(void) {", '  printf("%zu\\n", sizeof(ncclConfig_t));']
    lines += [f'  printf("{n} %zu %zu\\n", offsetof(ncclConfig_t, {n}), sizeof(((ncclConfig_t*)0)->{n}));'
              for n in names]
    lines += ["  return 0;", "}"]
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "layout.c", Path(tmp) / "layout"
        src.write_text("\n".join(lines) + "\n")
        subprocess.run(["cc", "-std=c11", "-o", str(exe), str(src)], check=True)
        out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")
    fields = [[name, int(off), int(size)] for name, off, size in (row.split() for row in out[1:] if row)]
    return {"struct_tag": tag, "sizeof": int(out[0]), "fields": fields, "initializer": _initializer(text)}


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def from_git(repo: str, tag: str) -> tuple[str, dict]:
    version_mk = _git(repo, "show", f"{tag}:makefiles/version.mk")
    parts = {k: v for k, v in re.findall(r"NCCL_(MAJOR|MINOR|PATCH)\s*:=\s*(\d+)", version_mk)}
    version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    commit = _git(repo, "rev-parse", f"{tag}^{{commit}}").strip()
    entry = layout(_git(repo, "show", f"{tag}:src/nccl.h.in"))
    entry["source"] = f"NVIDIA/nccl tag {tag}, commit {commit}, src/nccl.h.in"
    return version, entry


def from_header(path: str, source: str) -> tuple[str, dict]:
    text = Path(path).read_text()
    parts = dict(re.findall(r"#define NCCL_(MAJOR|MINOR|PATCH) (\d+)", text))
    version = f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"
    entry = layout(text)
    entry["source"] = f"{source}, nccl.h sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"
    return version, entry


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--git", nargs="+", metavar=("REPO", "TAG"),
                        help="a clone of the NCCL repository, then the release tags to read")
    parser.add_argument("--header", action="append", default=[], help="an installed nccl.h")
    parser.add_argument("--source", action="append", default=[],
                        help="for each --header, where it came from (recorded in the output)")
    args = parser.parse_args(argv)
    table: dict[str, dict] = {}
    if args.git:
        repo, *tags = args.git
        for tag in tags:
            version, entry = from_git(repo, tag)
            table[version] = entry
    for i, header in enumerate(args.header):
        version, entry = from_header(header, args.source[i] if i < len(args.source) else header)
        table[version] = entry
    json.dump(table, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
