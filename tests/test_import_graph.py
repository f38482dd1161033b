"""No module of the tree imports one that imports it back, directly or through others, within a package or across
them. Every import statement counts, also one inside a function or under TYPE_CHECKING: a circle hidden in a
function is still one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("inferscale_kv", "memory_service", "precompute_worker", "inference_node", "harness", "benchmarks", "demo")


def import_graph(*roots: Path) -> dict[str, set[str]]:
    """Each module of the packages at `roots` -> the modules of those packages it imports (`from a.b import c`
    names a.b.c when that is a module, else a.b; relative imports are resolved)."""
    names = {path: _module_name(root.parent, path) for root in roots for path in sorted(root.rglob("*.py"))}
    modules = set(names.values())
    graph = {}
    for path, name in names.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                             for alias in node.names)
        graph[name] = (found & modules) - {name}
    return graph


def _module_name(base: Path, path: Path) -> str:
    parts = path.relative_to(base).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        path.append(module)
        for target in sorted(graph[module]):
            if target in path:
                return [*path[path.index(target):], target]
            if target not in done and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done and (cycle := visit(module)) is not None:
            return cycle
    return None


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph(*(REPO / package for package in PACKAGES))
    assert "memory_service.servicer" in graph and "benchmarks.serve" in graph  # every package is read
    facade = graph["inference_node.connector"]
    assert {"inference_node.connector.scheduler", "inference_node.connector.worker"} <= facade  # sees the package
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


@pytest.mark.parametrize(("graph", "cycle"), [
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": set(), "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
])
def test_the_check_finds_circles_through_other_modules(graph, cycle) -> None:
    assert find_cycle(graph) == cycle


def test_an_import_hidden_in_a_function_or_made_relative_still_closes_a_circle(tmp_path: Path) -> None:
    """The circle this package once dodged: the façade imports a role that imports the façade's types back."""
    package = tmp_path / "node"
    (package / "connector").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "connector" / "__init__.py").write_text("def build():\n    from .roles import Role\n    return Role\n")
    (package / "connector" / "roles.py").write_text("from node.connector import Spec\n")
    assert import_graph(package) == {"node": set(), "node.connector": {"node.connector.roles"},
                                     "node.connector.roles": {"node.connector"}}
    assert find_cycle(import_graph(package)) == ["node.connector", "node.connector.roles", "node.connector"]
