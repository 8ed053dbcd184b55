"""The package's shape: what each module offers, and which way imports go.

- Every module lists its public names in ``__all__``, and everything it lists exists.
- An import of a name from a compshard module, inside the package or from the
  benchmarks, names something that module lists (or one of its submodules): what is not
  listed is the module's own business and may change without notice.
- Module-level imports between compshard's modules form no cycle (an import inside a
  function is how a lower module reaches a higher one at call time, and says so).
- Layers: the kernels import nothing of compshard outside ``compshard.kernels`` but its
  logging, the communication layer (``compshard.comm``) nothing but the kernels and the
  compile plan's error type; the passes import nothing of the API above them (what calls
  the passes); the prediction (``compshard.predict``) and the pipeline
  (``compshard.pipelining``) are imported by nothing but ``compshard`` itself.
- Every module lies in one of ``LAYERS`` and imports nothing of a later one.
- Private modules (a name part starting with ``_``) need no ``__all__``.
- No module is longer than ``MAX_FILE_LINES`` and no function (decorators and docstring
  included) longer than ``MAX_FUNCTION_LINES``: a room a reader can hold in their head.
"""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "compshard"
# The package's layers, lowest first (docs/architecture.md's module map): a module
# imports nothing of a later layer. Each name is a top-level module or subpackage.
LAYERS = [
    {"compile_plan", "options", "torch_compat", "module_tree", "tensor_parallel", "clip"},
    {"sizes", "timeline", "logs"},
    {"kernels"},
    {"comm"},
    {"compile_cache", "cost_model"},
    {"sharding"},
    {"passes"},
    {"inductor_regions", "checkpoint", "backend"},
    {"inspection", "pipelining", "models", "optim"},
    {"predict"},
    {"integrations"},
]
# The lowest layers, each with the only compshard modules (or packages) outside it that
# it may import.
LOWER_LAYERS = {
    "compshard.kernels": {"compshard.logs"},
    "compshard.comm": {"compshard.compile_plan", "compshard.kernels"},
}
# The user-facing layers above the backend: only ``compshard`` itself (which exports
# their functions) imports them, and neither imports the other.
TOP_LAYERS = ("compshard.predict", "compshard.pipelining")
# The modules and packages that run the passes or face the user (and ``compshard``
# itself): a pass importing one reaches up.
ABOVE_THE_PASSES = {
    "compshard.backend",
    "compshard.sharding",
    "compshard.inspection",
    "compshard.predict",
    "compshard.pipelining",
    "compshard.checkpoint",
    "compshard.compile_cache",
    "compshard.tensor_parallel",
    "compshard.clip",
    "compshard.optim",
}
# The most lines a library module, and one function in it, may have.
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 100


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
PUBLIC_MODULES = sorted(m for m in MODULES if not any(part.startswith("_") for part in m.split(".")))


def _imports(path: pathlib.Path, module_level: bool) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each import of a compshard module in ``path`` (``name``:
    what a ``from`` import takes, None for a plain import), at module level only (not in
    functions or ``if TYPE_CHECKING:`` blocks) when ``module_level``."""
    tree = ast.parse(path.read_text())
    nodes = (
        [n for top in tree.body if not isinstance(top, (ast.If, ast.FunctionDef, ast.ClassDef)) for n in ast.walk(top)]
        if module_level
        else list(ast.walk(tree))
    )
    found: list[tuple[str, str | None]] = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "compshard"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "compshard":
            found += [(node.module, alias.name) for alias in node.names]
    return found


def _target(module: str, name: str | None) -> str:
    """The compshard module an import loads: ``module.name`` where that is a submodule."""
    return f"{module}.{name}" if name is not None and f"{module}.{name}" in MODULES else module


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_module_lists_its_public_names(module):
    loaded = importlib.import_module(module)
    assert hasattr(loaded, "__all__"), f"{module} has no __all__"
    missing = [name for name in loaded.__all__ if not hasattr(loaded, name)]
    assert not missing, f"{module}.__all__ lists names it does not define: {missing}"


def test_imports_of_compshard_names_are_listed():
    importers = [*MODULES.values(), *sorted((ROOT / "benchmarks").glob("*.py"))]
    unlisted = []
    for path in importers:
        for module, name in _imports(path, module_level=False):
            if name is None or _target(module, name) != module or module not in MODULES:
                continue  # a plain import, or a submodule
            if name not in importlib.import_module(module).__all__:
                unlisted.append(f"{path.relative_to(ROOT)}: {module}.{name}")
    assert not unlisted, "imported but not in the module's __all__:\n" + "\n".join(unlisted)


def test_module_level_imports_form_no_cycle():
    graph = {
        module: {_target(m, n) for m, n in _imports(path, module_level=True)} & MODULES.keys() - {module}
        for module, path in MODULES.items()
    }
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(module) :], module]))
        if module in done:
            return
        for imported in sorted(graph[module]):
            visit(imported, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_every_module_has_a_layer():
    unplaced = sorted({m.split(".")[1] for m in MODULES if m != "compshard"} - set().union(*LAYERS))
    assert not unplaced, f"modules or subpackages in no layer of LAYERS (add them where they belong): {unplaced}"


def test_no_module_imports_a_later_layer():
    upward = [
        f"{module} -> {target}"
        for module, path in MODULES.items()
        if module != "compshard"
        for target in {_target(m, n) for m, n in _imports(path, module_level=False)}
        if target != "compshard" and _layer(target) > _layer(module)
    ]
    assert not upward, "imports of a later layer (see LAYERS):\n" + "\n".join(sorted(upward))


def test_lower_layers_import_nothing_above_them():
    upward = []
    for module, path in MODULES.items():
        imported = {_target(m, n) for m, n in _imports(path, module_level=False)}
        for layer, allowed in LOWER_LAYERS.items():
            if _within(module, layer):
                upward += [
                    f"{module} -> {m}"
                    for m in imported
                    if not _within(m, layer) and not any(_within(m, a) for a in allowed)
                ]
        for top in TOP_LAYERS:
            if module != "compshard" and not _within(module, top):
                upward += [f"{module} -> {m}" for m in imported if _within(m, top)]
        if module.startswith("compshard.passes"):
            upward += [
                f"{module} -> {m}"
                for m in imported
                if m == "compshard" or any(_within(m, above) for above in ABOVE_THE_PASSES)
            ]
    assert not upward, "imports of a higher layer:\n" + "\n".join(sorted(upward))


def test_no_module_or_function_is_too_long():
    too_long = []
    for module, path in MODULES.items():
        source = path.read_text()
        if (lines := source.count("\n")) > MAX_FILE_LINES:
            too_long.append(f"{module}: {lines} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if (length := node.end_lineno - start + 1) > MAX_FUNCTION_LINES:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long, f"longer than {MAX_FILE_LINES} lines a module, {MAX_FUNCTION_LINES} a function:\n" + "\n".join(
        too_long
    )
