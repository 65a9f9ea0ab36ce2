"""The package's import graph: no circle among atskv's modules (imports at the top of a module,
inside functions and under `if TYPE_CHECKING:` all count: a function-level import only hides a
circle until the function runs, and a type-only one still ties the two modules' designs
together), and no private name (`_x`) imported from another module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted((ROOT / "atskv").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> list[tuple[str, str | None, int]]:
    """(module imported, name taken from it or None, line) for every import: at the top of the
    file, inside a function or under `if TYPE_CHECKING:`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this module
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                source = ".".join(package + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found += [(source, alias.name, node.lineno) for alias in node.names]
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the atskv modules it imports. `from a.b import c` imports a.b, and a.b.c too when
    that is a module; importing a.b.c runs the packages a and a.b first, unless the importer
    lives inside them (they are then already being imported)."""

    def own(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        named, packages = set(), set()
        for source, name, _ in imported_names(module, path):
            for candidate in (source, f"{source}.{name}" if name else None):
                target = candidate and own(candidate)
                if target:
                    named.add(target)
                    parts = target.split(".")
                    packages |= {".".join(parts[:i]) for i in range(1, len(parts))}
        packages = {p for p in packages if p in modules and not module.startswith(p + ".")}
        graph[module] = (named | packages) - {module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as a list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_circle_through_a_function_level_import(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from atskv.x import T\n"
        "def f():\n    from atskv.y import g\n"
    )
    found = sorted((s, n) for s, n, _ in imported_names("atskv.m", source))
    assert found == [("atskv.x", "T"), ("atskv.y", "g"), ("typing", "TYPE_CHECKING")]


def test_no_import_circle_among_atskv_modules():
    modules = module_files()
    assert {"atskv.runtime.reference.sparse", "atskv.selectors", "atskv.kernels.sparse_decode"} <= set(modules)
    graph = import_graph(modules)
    assert "atskv.selectors" in graph["atskv.runtime.reference.sparse"]  # the graph sees real edges
    assert circles(graph) == []


def test_no_private_name_is_imported_from_another_module():
    modules = module_files()
    private = [
        f"{path.relative_to(ROOT)}:{line} imports {name} from {source}"
        for module, path in modules.items()
        for source, name, line in imported_names(module, path)
        if name and name.startswith("_") and not name.startswith("__") and source.startswith("atskv")
    ]
    assert private == []
