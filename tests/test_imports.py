"""The package's layering: no module of d3s/ imports another that imports it back (docs/code-map.md,
"Layering"). Read from the source with ``ast``, nothing imported: every import counts, at module level, in
a function or under ``if TYPE_CHECKING:``, since any of them ties the two modules together."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

from helpers import REPO_ROOT

PACKAGE = REPO_ROOT / "d3s"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(tree: ast.Module, module: str, is_package: bool) -> list[tuple[str, int]]:
    """(dotted name, line) of everything ``module`` imports: ``from x import y`` gives x.y (which may be a
    submodule) as well as x; relative imports resolved."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join([*package, base] if base else package)
            names += [(base, node.lineno)] + [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return names


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """Module -> {module of d3s it imports: line of the import}. Importing a.b.c runs the packages a and a.b
    first: they count too, except the importer's own packages (being imported already when it runs)."""
    paths = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for module, path in paths.items():
        is_package = path.name == "__init__.py"
        own_packages = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1 + is_package)}
        edges = graph.setdefault(module, {})
        for name, line in imported_names(ast.parse(path.read_text(), str(path)), module, is_package):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in paths and target != module and target not in own_packages:
                    edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The import cycles, each as its modules in import order with the first repeated last: for every import
    inside a cycle, the shortest cycle that takes it (each cycle once)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def connect(node: str) -> None:  # Tarjan's algorithm (the package is small: recursion is fine)
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    found: list[list[str]] = []
    for component in components:
        members = set(component)
        for start in component:
            for first in sorted(set(graph[start]) & members):
                way = shortest_way(graph, first, start, members)
                cycle = [start, *way]
                turns = {tuple(cycle[i:-1] + cycle[:i]) for i in range(len(cycle) - 1)}
                if not any(tuple(known[:-1]) in turns for known in found):
                    found.append(cycle)
    return found


def shortest_way(graph: dict[str, dict[str, int]], start: str, end: str, members: set[str]) -> list[str]:
    """The shortest import path from ``start`` to ``end`` through ``members`` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while end not in paths:
        node = frontier.pop(0)
        for target in sorted(set(graph[node]) & members - set(paths)):
            paths[target] = [*paths[node], target]
            frontier.append(target)
    return paths[end]


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    steps = [f"{a} (line {graph[a][b]}) -> " for a, b in itertools.pairwise(cycle)]
    return "".join(steps) + cycle[-1]


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, (
        "import cycles in d3s/ (module (line of the import) -> module it imports):\n"
        + "\n".join(describe(cycle, graph) for cycle in found)
    )


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Function-level, TYPE_CHECKING, relative and ``from package import submodule`` imports are all edges."""
    package = tmp_path / "d3s"
    (package / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from d3s.sub import b\n",
        "sub/__init__.py": "from .b import X\n",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import Y\nX = 1\n",
        "c.py": "import d3s.a\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph["d3s.a"] == {"d3s.sub": 2, "d3s.sub.b": 2}
    assert graph["d3s.sub"] == {"d3s.sub.b": 1}
    assert graph["d3s.sub.b"] == {"d3s.c": 3}
    assert cycles(graph) == [
        ["d3s.a", "d3s.sub", "d3s.sub.b", "d3s.c", "d3s.a"],  # importing d3s.sub.b runs d3s.sub first
        ["d3s.a", "d3s.sub.b", "d3s.c", "d3s.a"],
    ]
