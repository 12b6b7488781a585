"""No import cycles among the runner's modules.

Every ``import`` counts, including those inside functions and under
``TYPE_CHECKING``: a deferred import hides a cycle from the interpreter, not from a
reader, and the fix is the same (move what both need into a module below them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.Import | ast.ImportFrom, here: str, is_package: bool,
              modules: set[str]) -> set[str]:
    """The modules ``node`` depends on, absolute. ``from pkg import name`` depends on
    ``pkg.name`` when that is a module, else on ``pkg`` (its ``__init__``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        package = here.split(".") if is_package else here.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join(package + ([base] if base else []))
    return {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
            for alias in node.names}


def import_graph(package_dir: Path, root: Path, *more: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same packages it imports (``package_dir`` and any
    ``more``, taken together). An import of a package's submodule also runs the
    package's ``__init__``, but that is how packages work, not a dependency of the
    submodule: only imports a module writes count."""
    files = {module_name(p, root): p
             for d in (package_dir, *more) for p in sorted(d.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[name].update(m for m in _imported(node, name, is_package, set(files))
                                   if m in files and m != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each
    sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_runner_has_no_import_cycle() -> None:
    graph = import_graph(ROOT / "vllm" / "runner", ROOT)
    assert "vllm.runner.model" in graph and "vllm.runner.mla" in graph["vllm.runner.model"]
    assert cycles(graph) == []


@pytest.mark.parametrize(("files", "want"), [
    ({"a.py": "from pkg import b\n", "b.py": "def f():\n    from pkg.a import x\n"},
     [["pkg.a", "pkg.b"]]),
    ({"a.py": "from . import b\n", "b.py": "import pkg.c\n", "c.py": "from .a import x\n"},
     [["pkg.a", "pkg.b", "pkg.c"]]),
    ({"a.py": "from pkg import b\n", "b.py": "import os\n", "__init__.py": "from .a import x\n"},
     []),
    ({"a.py": "from pkg import x\n", "__init__.py": "from .a import y\nx = 1\n"},
     [["pkg", "pkg.a"]]),
    ({"a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
      "b.py": "from pkg.a import A\n"}, [["pkg.a", "pkg.b"]]),
])
def test_cycle_finder_finds_what_it_should(tmp_path: Path, files: dict[str, str],
                                           want: list[list[str]]) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, text in files.items():
        (package / name).write_text(text)
    assert cycles(import_graph(package, tmp_path)) == want
