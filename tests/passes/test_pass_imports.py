"""The architecture's rule: a pass file imports nothing from another pass file. What
several passes use (the lowerings coalescing measures candidates with, the recompute
model the memory budget prices) lives in shared modules of ``compshard/passes`` that are
not passes."""

from __future__ import annotations

import ast
import importlib
import pathlib

from compshard.passes import PASS_ORDER

PASSES = {step.run.__module__ for steps in PASS_ORDER.values() for step in steps}


def imported_modules(path: pathlib.Path) -> set[str]:
    """The modules a file imports, named in full (``from package import module`` too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_every_pass_of_the_pass_order_is_found():
    assert {
        "compshard.passes.lower_unshard",
        "compshard.passes.coalesce_collectives",
        "compshard.passes.recompute",
        "compshard.passes.keep_gathered",
    } <= PASSES


def test_no_pass_file_imports_another_pass_file():
    crossing = {}
    for module in sorted(PASSES):
        path = pathlib.Path(importlib.import_module(module).__file__)
        others = sorted((imported_modules(path) & PASSES) - {module})
        if others:
            crossing[module] = others
    assert not crossing, f"pass files importing other pass files (move what they share to a shared module): {crossing}"


def test_every_pass_of_the_pass_order_has_its_own_unit_test_file():
    tests = pathlib.Path(__file__).parent
    missing = sorted(module for module in PASSES if not (tests / f"test_{module.rpartition('.')[2]}.py").is_file())
    assert not missing, f"passes without a unit test file tests/passes/test_<pass>.py on hand-built graphs: {missing}"
