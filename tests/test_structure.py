"""Rules of the code's shape that a reviewer would otherwise have to re-check by hand:
imports form a DAG, the vocabulary module imports nothing of symcomm's, environment variables
are read in one module, the README's settings table lists exactly those, and the module maps
in docs/guide.md and docs/architecture.md name exactly the modules there are."""
from __future__ import annotations

import ast
import re
from collections.abc import Callable
from pathlib import Path

import symcomm.settings as settings

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "symcomm"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``: they name types for annotations and
    never run, so they are not edges of the run-time import graph."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def _imports(path: Path) -> set[str]:
    """symcomm modules imported anywhere in the file, function bodies included (an import
    hidden in a function to dodge a cycle is still a cycle), ``if TYPE_CHECKING:`` excluded."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("symcomm")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("symcomm"):
                found.add(target)
                # "from . import x" imports the submodule x
                found |= {f"{target}.{a.name}" for a in node.names}
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in _imports(p) if m in modules and m != name} for name, p in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            # a package's __init__ importing its own submodules is how packages work, not a cycle
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_imports_form_a_dag():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_vocabulary_imports_nothing_of_symcomms():
    assert _graph()["symcomm.base"] == set()


def test_environment_is_read_in_settings_only():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "settings.py":
            continue
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bos\.environ\b|\bgetenv\(", line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
    assert not offenders, "read environment variables through symcomm.settings:\n" + "\n".join(offenders)


def test_readme_settings_table_lists_exactly_what_symcomm_reads():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)
    assert rows, "no settings table under '## Settings'"
    assert sorted(rows) == sorted(settings.VARIABLES)
    # and every variable settings.py reads is in VARIABLES
    source = (PACKAGE / "settings.py").read_text()
    read = set(re.findall(r'_(?:get|flag)\("([A-Z_]+)"\)', source))
    read |= set(re.findall(r'"(PYTORCH_[A-Z_]+)"', source))
    listed = {name for key in settings.VARIABLES for name in key.split(", ")}
    assert read <= listed, read - listed


def test_communicator_stays_small():
    lines = len((PACKAGE / "communicator.py").read_text().splitlines())
    assert lines <= 350, f"communicator.py has {lines} lines: move path-specific work into its path"


_MEASURED = re.compile(r"\d[\d.,]*\s?(?:µs|us\b|×(?! ?[A-Z])|GB/s)")  # "4× H200" names a machine


def _uncited_paragraphs(text: str) -> list[str]:
    """Paragraphs (outside code blocks) that quote a measurement but cite no raw result file."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [p.strip()[:80] for p in re.split(r"\n\s*\n", text)
            if _MEASURED.search(p) and "bench/results/" not in p and "docs/measuring.md" not in p]


# The README and the pages that took its numbers (docs/benchmarks.md) or quote measurements
# for users (docs/guide.md, docs/install.md).
MEASURED_PAGES = ("README.md", "docs/benchmarks.md", "docs/guide.md", "docs/install.md")


def test_every_number_in_the_readme_and_user_docs_cites_the_file_it_comes_from():
    cited = []
    for page in MEASURED_PAGES:
        text = (ROOT / page).read_text()
        missing = _uncited_paragraphs(text)
        assert not missing, f"{page} paragraphs quoting numbers without a bench/results/ source:\n" + "\n".join(missing)
        cited += re.findall(r"bench/results/[\w./-]+", text)
    absent = [c for c in cited if not (ROOT / c.rstrip(".")).exists()]
    assert cited and not absent, absent


def test_the_citation_check_flags_a_bare_number():
    assert _uncited_paragraphs("It takes 4.2 µs.\n\nCited 4.2 µs (" + "bench/results/" + "x.txt).") == ["It takes 4.2 µs."]


def _private_definitions(package: Path) -> dict[str, set[str]]:
    """_name -> the symcomm modules that define it (a function, class, assignment or attribute)."""
    defined: dict[str, set[str]] = {}
    for path in package.rglob("*.py"):
        module = str(path.relative_to(package))
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names = [node.attr]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names = [node.id]
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    defined.setdefault(name, set()).add(module)
    return defined


def private_reach_through(package: Path = PACKAGE) -> list[str]:
    """``x._name`` where ``_name`` is a private member another symcomm module defines, and
    ``from symcomm... import _name``: one module reaching into another's underscore members.
    ``self._name`` is a class's own (or inherited, protected) member and stays allowed."""
    defined = _private_definitions(package)
    found = []
    for path in package.rglob("*.py"):
        module = str(path.relative_to(package))
        for node in ast.walk(ast.parse(path.read_text())):
            own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if isinstance(node, ast.Attribute) and not own and node.attr in defined and module not in defined[node.attr]:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("symcomm")):
                found += [f"{path.name}:{node.lineno}: imports {a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__") and a.name not in ("_nccl",
                                                                                                      "_native")]
    return found


def test_no_module_reaches_into_another_modules_private_members():
    found = private_reach_through()
    assert not found, "use a public name (or move the code into the module that owns it):\n" + "\n".join(found)


def test_the_reach_through_finder_finds_one(tmp_path):
    package = tmp_path / "symcomm"
    package.mkdir()
    (package / "owner.py").write_text("class Owner:\n    def __init__(self):\n        self._state = 1\n")
    (package / "user.py").write_text("from .owner import _helper\n\ndef peek(o):\n    return o._state + self_ok()\n")
    found = private_reach_through(package)
    assert sorted(found) == ["user.py:1: imports _helper", "user.py:4: o._state"], found


# ----------------------------------------------------------------------------- the maps in docs
# docs/guide.md's "Where things are" and docs/architecture.md's "Layers" name modules by bare
# file name, which tests/test_docs.py (paths with a folder) cannot follow: these hold both maps
# to the files, both ways, so a module that is added, moved or deleted fails here until the
# map says so.
_TREE_ENTRY = re.compile(r"^((?:  ){0,4})(\S+)")  # a name at two spaces per level; deeper: description
_MODULE_NAME = re.compile(r"[\w/]+\.py\b")


def _code_block(page: str, heading: str) -> str:
    """The first fenced block under ``heading`` in ``page``."""
    section = (ROOT / page).read_text().split(f"\n{heading}\n", 1)[1]
    return section.split("```", 2)[1]


def tree_entries(block: str) -> tuple[list[str], list[str]]:
    """(repository paths of a tree's entries, problems with its shape). An entry line starts
    with its name at 2 * depth spaces, under the folder entry (a name ending in "/") above it;
    a line indented deeper continues a description."""
    folders: list[str] = []
    paths, problems = [], []
    for line in block.splitlines():
        match = _TREE_ENTRY.match(line)
        if match is None:
            continue
        depth, name = len(match.group(1)) // 2, match.group(2)
        if depth > len(folders):
            problems.append(f"{name!r} is indented under something that is not a folder")
            continue
        del folders[depth:]
        paths.append("/".join([*folders, name.rstrip("/")]))
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
    return paths, problems


def tree_problems(block: str, exists: Callable[[str], bool], required: list[str]) -> list[str]:
    """What a tree block gets wrong: entries that do not exist, and ``required`` files that it
    does not list. A folder listed with no entries under it stands for all its files."""
    listed, problems = tree_entries(block)
    problems += [f"lists {p}, which does not exist" for p in listed if not exists(p)]
    whole = [p for p in listed if not any(q.startswith(p + "/") for q in listed)]
    problems += [f"does not list {f}" for f in required
                 if f not in listed and not any(f.startswith(p + "/") for p in whole)]
    return problems


def layer_problems(block: str, modules: list[str]) -> list[str]:
    """What a layer diagram gets wrong: ``*.py`` names that are no module (``modules``: paths
    relative to symcomm/), and modules it does not name (by that path or by file name)."""
    named = {n.removeprefix("symcomm/") for n in _MODULE_NAME.findall(block)}
    basenames = {m.rpartition("/")[2] for m in modules}
    problems = [f"names {n}, which is not a module of symcomm" for n in sorted(named)
                if n not in modules and n not in basenames]
    problems += [f"does not name {m}" for m in modules if m not in named and m.rpartition("/")[2] not in named]
    return problems


def _files(folder: str, pattern: str) -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / folder).rglob(pattern)
                  if p.is_file() and "__pycache__" not in p.parts and "_native" not in p.parts[1:2])


def test_the_guide_lists_every_module_and_nothing_else():
    block = _code_block("docs/guide.md", "## Where things are")
    required = [*_files("symcomm", "*.py"), *_files("csrc", "*"), *_files("scripts", "*"),
                *_files("examples", "*.py"), *_files("docs", "*.md")]
    problems = tree_problems(block, lambda p: (ROOT / p).exists(), required)
    assert not problems, "docs/guide.md, 'Where things are':\n" + "\n".join(problems)


def test_the_layers_name_every_module_and_nothing_else():
    block = _code_block("docs/architecture.md", "## Layers")
    modules = [p.removeprefix("symcomm/") for p in _files("symcomm", "*.py") if not p.startswith("symcomm/bench/")]
    problems = layer_problems(block, modules)
    assert not problems, "docs/architecture.md, 'Layers':\n" + "\n".join(problems)


def test_the_map_checks_find_what_is_wrong():
    # '|' stands for '/', so that tests/test_docs.py does not take these made-up paths for citations.
    def s(text):
        return text.replace("|", "/")
    tree = s("pkg|\n  a.py           the a\n                 continued, b.py in a description\n"
             "  sub|           a package\n    c.py         the c\n  gone.py        deleted\n"
             "  whole|         all of it\ncsrc|\n  k.cu\n")
    files = {s(f) for f in ("pkg|a.py", "pkg|b.py", "pkg|sub|c.py", "pkg|sub|d.py", "pkg|whole|e.py", "csrc|k.cu")}
    known = files | {s(f) for f in ("pkg", "pkg|sub", "pkg|whole", "csrc")}
    assert tree_entries(tree)[0] == [s(p) for p in ("pkg", "pkg|a.py", "pkg|sub", "pkg|sub|c.py", "pkg|gone.py",
                                                    "pkg|whole", "csrc", "csrc|k.cu")]
    assert tree_problems(tree, known.__contains__, sorted(files)) == [
        s(m) for m in ("lists pkg|gone.py, which does not exist", "does not list pkg|b.py",
                       "does not list pkg|sub|d.py")]
    assert tree_entries("a.py\n  b.py\n")[1] == ["'b.py' is indented under something that is not a folder"]
    layers = s(" communicator.py -> custom.py\n symcomm|peer|capture.py, symcomm|backends|nccl.py (and fp4.py)\n")
    assert layer_problems(layers, [s(m) for m in ("communicator.py", "capture.py", "peer|capture.py",
                                                  "backends|nccl.py", "fp4.py", "pool.py")]) == [
        "names custom.py, which is not a module of symcomm", "does not name capture.py", "does not name pool.py"]
