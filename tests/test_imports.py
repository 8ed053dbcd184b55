"""The package's modules import one another without cycles.

Every ``import`` of a ``compshard`` module counts, at module level or inside a function
(an import deferred into a function hides a cycle, it does not remove it). An import
names the module it reads from: ``from compshard.passes.fx_utils import emit`` is an edge
to ``compshard.passes.fx_utils``, ``from compshard.comm import ops`` one to ``compshard.comm.ops``.
Importing a module also runs the ``__init__`` of the packages it lies in, so it is an
edge to those packages too, except to the packages the importing module lies in itself
(they are being initialized already: a package's ``__init__`` importing its own modules
is how a package exposes them).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "compshard"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The compshard modules ``path`` imports."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            if name not in modules:
                continue
            found.add(name)
            parts = name.split(".")
            found.update(
                parent
                for i in range(1, len(parts))
                if (parent := ".".join(parts[:i])) in modules and not (package + ".").startswith(parent + ".")
            )
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (depth-first search), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        stack.append(module)
        for imported in sorted(graph[module]):
            if state.get(imported) == "open":
                return stack[stack.index(imported) :] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        state[module] = "done"
        stack.pop()
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_deferred_relative_and_package_imports():
    graph = _graph()
    assert "compshard.kernels" in graph["compshard.comm.bucket_ops"]  # imported inside a function
    assert "compshard.kernels.reference" in graph["compshard.kernels.bucket_copy"]  # a relative import
    assert "compshard.passes" in graph["compshard.backend"]  # the package of compshard.passes.partition
    assert "compshard.passes" not in graph["compshard.passes.prefetch"]  # its own package


def test_no_import_cycles():
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)
