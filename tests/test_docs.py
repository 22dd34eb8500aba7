"""Every repository path that the sources cite must exist in the repository.

Comments and docs point at files ("csrc/custom_ar.cu explains the kernels", "see
docs/measuring.md"); a pointer to a file that was renamed, deleted, or never part of the
repository (the design notes the project started from) leaves a reader of a clone with
nothing to read. This test scans the repository's own source and documentation files (those
git knows: tracked, or new and not ignored outside a virtual environment made in the clone;
bench/results/ excluded), finds the path-like tokens in them, and fails naming the file, the
line and the path of every one that does not exist. It also fails on any mention of the two
design notes that lived outside the repository: docs/ holds their content now. CPU only; it
imports nothing of symcomm.

What counts as a citation (see ``references``):
- a token containing a slash that ends in a known file extension (``bench/membership.py``);
- a token that starts with one of the repository's top-level folders (``symcomm/tuning/``,
  ``tests/gpu``), with or without an extension;
- in Markdown, the target of a relative link (``[notes](../bench/NOTES.md)``).
A token resolves against the repository root or the citing file's folder (a Markdown link
target, and anything starting with two dots, only against the folder). A path that git ignores
(``symcomm/_native/``, ``out/``) is a build or run output and counts as existing. Skipped: URLs,
absolute paths, and patterns (``*``, ``{``, ``<``, ``$``, ``%``, or an all-capitals folder
such as ``DIR``: globs, format strings, placeholders). bench/results/ holds dated records of
past runs: it is neither scanned nor held to today's layout.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED_SUFFIXES = (".py", ".cu", ".cc", ".h", ".sh", ".md", ".toml")
EXCLUDED_PREFIXES = ("bench/results/",)
# A token starting with one of these folders is a citation. docs and examples are listed even
# where absent, so that a pointer into a missing one is caught.
TOP_FOLDERS = ("symcomm", "csrc", "bench", "tests", "scripts", "docs", "examples", ".ci")
# Run logs (.log) are left out: scripts name the logs they write under their output folder.
EXTENSIONS = ("md", "py", "cu", "cc", "cpp", "h", "cuh", "sh", "json", "toml", "txt", "png", "cfg", "yaml",
              "yml", "so", "ini")
# The design notes the project was built from lived outside the repository; a mention of
# either, with or without its ".md", is a pointer nobody with a clone can follow. (The pattern
# is spelled with brackets so that this file does not mention them itself.)
OUTSIDE_NOTES = re.compile(r"\b(?:DESI[G]N|ANCHOR[S])(?:\.md)?\b")

_TOKEN = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_./+-]*/[A-Za-z0-9_./+-]*")
_EXT = re.compile(r"\.(?:" + "|".join(EXTENSIONS) + r")$")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATTERN_CHARS = frozenset("*{}<>$%[]")
_PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")

Ignored = Callable[[Iterable[str]], set[str]]


def references(line: str, markdown: bool = False) -> list[str]:
    """The repository paths cited on one line, as written (without a trailing slash). Markdown
    link targets come back with a leading './' (they are relative to the citing file)."""
    found: list[str] = []
    for match in _TOKEN.finditer(line):
        start, end, token = match.start(), match.end(), match.group(0)
        before, after = line[max(0, start - 3):start], line[end:end + 1]
        if "://" in before + token[:3] or before.endswith(("/", ":", "@", "~")):
            continue  # a URL, or the tail of an absolute path or a URL
        if after in _PATTERN_CHARS or (start and line[start - 1] in _PATTERN_CHARS):
            continue  # the literal part of a glob, format string or placeholder
        token = token.rstrip(".,;:").rstrip("/")
        parts = token.split("/")
        if not token.strip("./") or "" in parts or any(_PLACEHOLDER.match(p) for p in parts):
            continue
        if token.startswith(("./", "../")) or parts[0] in TOP_FOLDERS or _EXT.search(token):
            found.append(token)
    if markdown:
        for target in _MD_LINK.findall(line):
            target = target.split("#", 1)[0].rstrip("/")
            if (target and "://" not in target and not target.startswith(("/", "mailto:"))
                    and not set(target) & _PATTERN_CHARS):
                target = target if target.startswith(("./", "../")) else "./" + target
                if target not in found:
                    found.append(target)
    return found


def _normalise(path: PurePosixPath) -> str | None:
    parts: list[str] = []
    for part in path.parts:
        if part == "..":
            if not parts:
                return None  # above the repository
            parts.pop()
        elif part != ".":
            parts.append(part)
    return "/".join(parts) or None


def candidates(token: str, citing: str, markdown_link: bool = False) -> list[str]:
    """Repository-relative paths ``token`` (cited in ``citing``) may mean, most likely first."""
    here = PurePosixPath(citing).parent
    tried = [here / token] if markdown_link or token.startswith("../") else [PurePosixPath(token), here / token]
    return [p for p in dict.fromkeys(map(_normalise, tried)) if p]


def problems(path: str, text: str, known: set[str], ignored: Ignored = lambda paths: set()) -> list[str]:
    """'path:line: ...' for every citation of a missing path and every mention of an outside
    note. ``known`` holds the repository's files and folders; ``ignored(paths)`` returns those
    of ``paths`` that git ignores (build and run outputs)."""
    notes: list[tuple[int, str]] = []
    missing: list[tuple[int, str, list[str]]] = []
    markdown = path.endswith(".md")
    for number, line in enumerate(text.splitlines(), 1):
        notes += [(number, m.group(0)) for m in OUTSIDE_NOTES.finditer(line)]
        links = {"./" + t.split("#", 1)[0].rstrip("/") if not t.startswith(("./", "../")) else t
                 for t in _MD_LINK.findall(line)} if markdown else set()
        for token in references(line, markdown):
            options = candidates(token, path, markdown_link=token in links)
            if not any(p in known for p in options):
                missing.append((number, token, options))
    outputs = ignored({q for _, _, options in missing for p in options for q in (p, p + "/")})
    out = [(number, f"{path}:{number}: cites {name}, which is not in the repository (docs/ has its content)")
           for number, name in notes]
    out += [(number, f"{path}:{number}: cites {token}, which does not exist")
            for number, token, options in missing if not any(p in outputs or p + "/" in outputs for p in options)]
    return [message for _, message in sorted(out, key=lambda item: item[0])]


# ----------------------------------------------------------------------------- the repository
def _git(*args: str, stdin: str | None = None) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, input=stdin, capture_output=True, text=True).stdout


def _repository_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the set of repository files is unknown")
    tracked = _git("ls-files", "-z", "--cached").split("\0")
    new = _git("ls-files", "-z", "--others", "--exclude-standard").split("\0")
    # A virtual environment made inside the clone (the README's "fresh virtual environment",
    # under whatever name) is not the repository's, ignored or not: its installed packages cite
    # their own files. Its root holds pyvenv.cfg.
    venvs = tuple(f[:-len("pyvenv.cfg")] for f in new if f.endswith("/pyvenv.cfg"))
    new = [f for f in new if not f.startswith(venvs)] if venvs else new
    # A tracked file deleted in the working tree is gone for a reader too.
    return sorted({f for f in tracked + new if f and (ROOT / f).is_file()})


def _git_ignored(paths: Iterable[str]) -> set[str]:
    paths = sorted(paths)
    if not paths:
        return set()
    return set(_git("check-ignore", "--no-index", "--stdin", stdin="\n".join(paths) + "\n").splitlines())


def known_paths(files: Iterable[str]) -> set[str]:
    """The files and every folder above them, as repository-relative POSIX paths."""
    known = set(files)
    for f in list(known):
        known.update(str(p) for p in PurePosixPath(f).parents if str(p) != ".")
    return known


def test_cited_paths_exist() -> None:
    files = _repository_files()
    known = known_paths(files)
    found: list[str] = []
    for path in files:
        if path.endswith(SCANNED_SUFFIXES) and not path.startswith(EXCLUDED_PREFIXES):
            text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
            found += problems(path, text, known, _git_ignored)
    assert not found, "citations that a clone of the repository cannot follow:\n" + "\n".join(found)


# ----------------------------------------------------------------------------- the scanner itself
# Synthetic lines spell '/' as '|' and '.md' as ',md', and break words with '~', so that this
# file does not cite what they cite.
def _s(text: str) -> str:
    return text.replace("|", "/").replace(",md", ".md").replace("~", "")


def test_scanner_flags_a_missing_file() -> None:
    known = known_paths(["docs/measuring.md", "csrc/custom_ar.cu", "symcomm/tuning/nvidia_h200_w4.json",
                         "bench/NOTES.md"])
    src, doc = _s("symcomm|x.py"), _s("docs|a,md")
    assert problems(src, _s("# csrc|custom_ar.cu, symcomm|tuning| and docs|measuring,md.\n"), known) == []
    assert problems(src, _s("ok\n# see docs|missing,md, csrc|gone.cu\n"), known) == [
        _s("symcomm|x.py:2: cites docs|missing,md, which does not exist"),
        _s("symcomm|x.py:2: cites csrc|gone.cu, which does not exist")]
    assert problems(src, _s("# tests|nothing_here|\n"), known) == [
        _s("symcomm|x.py:1: cites tests|nothing_here, which does not exist")]
    # Markdown links resolve against the citing file's folder.
    assert problems(doc, _s("[m](measuring,md) [n](..|bench|NOTES,md) [z](nope,md) [w](..|nope,md)\n"),
                    known) == [_s("docs|a,md:1: cites ..|nope,md, which does not exist"),
                               _s("docs|a,md:1: cites .|nope,md, which does not exist")]
    notes = problems(src, _s('"""Rules from DESI~GN,md; numbers in ANCHOR~S,md.\n(ANCHOR~S: 9.05 us)"""\n'), known)
    assert notes == [_s("symcomm|x.py:1: cites DESI~GN,md, which is not in the repository (docs| has its content)"),
                     _s("symcomm|x.py:1: cites ANCHOR~S,md, which is not in the repository (docs| has its content)"),
                     _s("symcomm|x.py:2: cites ANCHOR~S, which is not in the repository (docs| has its content)")]
    assert problems(src, "# design notes, anchors, DESIGNS and ANCHORSET are other words\n", known) == []


def test_scanner_skips_urls_absolute_paths_patterns_and_outputs() -> None:
    known = known_paths(["csrc/custom_ar.cu"])
    line = _s("see https:||github.com|NVIDIA|nccl-tests|blob|master|src|common.h, |proc|self|maps, "
              "symcomm|_native|libsymcomm*.so, bench|results|<date>|, bench|results|DIR|SUMMARY,md, "
              "f'{out}|x.json', $OUT|y.json\n")
    assert problems(_s("scripts|x.sh"), line, known) == []
    # A path git ignores is a build or run output: cited, but not kept in the repository.
    built = _s("# builds symcomm|_native|libsymcomm.so\n")
    assert problems("setup.py", built, known, lambda paths: {p for p in paths if p.startswith("symcomm")}) == []
    assert problems("setup.py", built, known) == [
        _s("setup.py:1: cites symcomm|_native|libsymcomm.so, which does not exist")]
