"""The package's structure: no import cycle, the house's import contracts, its architecture page.

Read statically from the source (every ``import`` and ``from … import``, at module level or inside
functions, since a deferred import is still a dependency), so the test needs no heavy imports and
names the cycle it finds.
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
    """The package's modules that ``path`` imports (``from pkg import sub`` counts as importing
    ``pkg.sub``)."""
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
    """Importing ``a.b.c`` runs ``a.b``'s ``__init__`` first, unless the importer lives inside
    ``a.b`` itself."""
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
    return {
        name: _with_packages(name, _imports(path, modules)) - {name}
        for name, path in modules.items()
    }


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
                return path[path.index(nxt) :] + [nxt]
            elif nxt not in done:
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
                on_path.add(nxt)
    return None


def test_the_package_has_no_import_cycle():
    graph = _import_graph()
    assert "composer3d.training.trainer" in graph and "composer3d.config.checks" in graph, (
        "the walk found the modules"
    )
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    """The check above can fail: a graph with a cycle is reported, with the modules on it."""
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_a_submodule_import_runs_its_package():
    """`from composer3d.parallel.pipeline.stages import x` runs composer3d/parallel/__init__.py: a
    dependency too."""
    assert "composer3d.parallel" in _import_graph()["composer3d.config.checks.layout"]
    assert "composer3d.data" not in _import_graph()["composer3d.data.corpus"], (
        "its own package is not"
    )


# The house's rules are import-linter's contracts in pyproject.toml ([tool.importlinter]): the
# layers, the schema importing nothing of the package, models/ a leaf, Hugging Face code behind
# models/hf's door, no cycle inside a package. The cycle test above stays: it also counts the
# package ``__init__`` a submodule import runs, which import-linter's graph does not.
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
MAX_ROOT_MODULES = 12


def test_the_import_contracts_hold(capsys):
    # The use case, not importlinter.cli's lint_imports: that one reconfigures logging (dictConfig),
    # which disables every logger already made in this process.
    from importlinter import configuration
    from importlinter.application.use_cases import lint_imports

    configuration.configure()
    passed = lint_imports(config_filename=str(PYPROJECT), cache_dir=None, no_logo=True)
    report = capsys.readouterr().out
    assert passed, report
    assert report.count(" KEPT") == len(_contracts()) >= 6, report


def _contracts() -> list[dict]:
    import tomllib

    return tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]["contracts"]


def test_every_module_sits_in_a_layer():
    """A module outside every layer would escape the layers contract: a new package or root module
    must be placed."""
    (layers,) = [c["layers"] for c in _contracts() if c["type"] == "layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    containers = {
        "composer3d",
        "composer3d.config",
        "composer3d.parallel",
        "composer3d.peft",
    }  # their modules are placed one by one
    unplaced = sorted(
        m
        for m in _module_names()
        if m not in containers and not any(m == p or m.startswith(p + ".") for p in placed)
    )
    assert not unplaced, (
        f"modules in no layer of pyproject.toml's [tool.importlinter] contract: {unplaced}"
    )


def test_the_package_root_holds_at_most_a_dozen_modules():
    root = sorted(path.name for path in PACKAGE_DIR.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules directly in composer3d/: {root}"


ARCHITECTURE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def _mapped_modules(page: str) -> set[str]:
    """The modules the page's package map names: the first code block after "## The package map",
    two spaces of indent a level, ``name/`` a package (its ``__init__.py``), ``name.py`` a
    module."""
    block = page.split("## The package map", 1)[1].split("```", 2)[1]
    paths, folders = set(), []
    for line in block.splitlines()[1:]:
        if not line.strip():
            continue
        depth, name = (len(line) - len(line.lstrip())) // 2, line.split()[0]
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
            paths.add("/".join(folders[1:] + ["__init__.py"]))
        else:
            paths.add("/".join(folders[1:] + [name]))
    return paths


def test_the_architecture_page_maps_every_module():
    """docs/architecture.md's package map is the package as it stands: a module added, moved or
    removed without the page fails here (and so does a page naming a module that is not there)."""
    mapped = _mapped_modules(ARCHITECTURE_PAGE.read_text())
    actual = {str(path.relative_to(PACKAGE_DIR)) for path in PACKAGE_DIR.rglob("*.py")}
    assert mapped == actual, (
        f"on the page, not in the package: {sorted(mapped - actual)}; in the package, not on the "
        f"page: {sorted(actual - mapped)}"
    )


def test_the_map_reader_follows_the_indentation():
    page = "## The package map\n```\npkg/  root\n  a.py  x\n  sub/  y\n    b.py  z\n  c.py\n```\n"
    assert _mapped_modules(page) == {"__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "c.py"}
