"""The package's import graph has no cycles: every module imports only modules below it (issue 16's layering).

Read statically from the source (every ``import`` and ``from … import``, at module level or inside functions,
since a deferred import is still a dependency), so the test needs no heavy imports and names the cycle it finds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import composer3d

PACKAGE_DIR = Path(composer3d.__file__).parent


def _module_names() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = ("composer3d", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``path`` imports (``from pkg import sub`` counts as importing ``pkg.sub``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name in modules}


def _with_packages(module: str, imported: set[str]) -> set[str]:
    """Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first, unless the importer lives inside ``a.b`` itself."""
    found = set(imported)
    for name in imported:
        parts = name.split(".")
        for end in range(1, len(parts)):
            package = ".".join(parts[:end])
            if not module.startswith(package + "."):
                found.add(package)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _with_packages(name, _imports(path, modules)) - {name} for name, path in modules.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()
    for start in sorted(graph):
        stack = [(start, iter(sorted(graph[start])))]
        path, on_path = [start], {start}
        while stack:
            node, edges = stack[-1]
            nxt = next(edges, None)
            if nxt is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
                on_path.add(nxt)
    return None


def test_the_package_has_no_import_cycle():
    graph = _import_graph()
    assert "composer3d.trainer" in graph and "composer3d.config.checks" in graph, "the walk found the modules"
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    """The check above can fail: a graph with a cycle is reported, with the modules on it."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_errors_sit_at_the_bottom():
    """Every module may raise ConfigError: the module defining it imports nothing of the package."""
    assert _import_graph()["composer3d.errors"] == set()


def test_a_submodule_import_runs_its_package():
    """`from composer3d.parallel.pipeline import x` runs composer3d/parallel/__init__.py: a dependency too."""
    assert "composer3d.parallel" in _import_graph()["composer3d.config.checks"]
    assert "composer3d.data" not in _import_graph()["composer3d.data.corpus"], "its own package is not"
