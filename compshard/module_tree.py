"""The module tree's repeated blocks, found from dotted names alone.

A *repeated block* is a numbered child (``blocks.3``) of a container that has at least
two numbered children among the names given: the transformer layers of a decoder, the
stages of a ResNet. Bucketing makes one bucket per block; ``shard`` makes each block
gather every parameter beneath it on entry to each call. The outermost such block wins,
so a ``ModuleList`` of experts inside a layer belongs to the layer. Module-name patterns
(``buckets=[...]``, ``shard(gather_units=[...])``) pick modules the same way: the
outermost match wins.
"""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterable, Sequence

__all__ = [
    "check_patterns_match",
    "common_parent",
    "gather_units_hint",
    "module_of",
    "outermost_match",
    "repeated_block",
    "repeated_containers",
]


def module_of(param: str) -> str:
    """The module path of a parameter name (``blocks.0.attn`` for ``blocks.0.attn.weight``)."""
    return param.rpartition(".")[0]


def outermost_match(module: str, patterns: Sequence[str]) -> str | None:
    """The shortest prefix of module path ``module`` (``moe`` of ``moe.experts.3``) that
    matches one of the ``fnmatch`` ``patterns``; ``None`` if none does (the root, path
    ``""``, never matches)."""
    parts = module.split(".") if module else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if any(fnmatch.fnmatchcase(prefix, pattern) for pattern in patterns):
            return prefix
    return None


def check_patterns_match(option: str, patterns: Sequence[str], modules: Sequence[str]) -> None:
    """Raise a ``ValueError`` naming ``compshard.shard``'s ``option`` when one of its
    ``fnmatch`` ``patterns`` matches none of the module paths ``modules``."""
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(name, p) for name in modules)]
    if unmatched:
        raise ValueError(
            f"compshard.shard: {option} pattern(s) {unmatched} match no submodule; module names "
            f"look like {list(modules[:6])}"
        )


def repeated_block(module: str, containers: set[str]) -> str | None:
    """The outermost repeated block (``blocks.3``) that module path ``module`` lies in."""
    parts = module.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit() and ".".join(parts[:i]) in containers:
            return ".".join(parts[: i + 1])
    return None


def repeated_containers(modules: Iterable[str]) -> set[str]:
    """Module paths with at least two numbered children among ``modules`` (``blocks``)."""
    children: dict[str, set[str]] = {}
    for module in modules:
        for match in re.finditer(r"\.(\d+)(?=\.)", "." + module + "."):
            prefix = ("." + module)[: match.start()].lstrip(".")
            children.setdefault(prefix, set()).add(match.group(1))
    return {prefix for prefix, numbers in children.items() if len(numbers) >= 2}


def gather_units_hint(modules: list[str]) -> str:
    """What to do when the ranks gathered in different ``modules`` (module paths; one alone
    where the other ranks were at the end of the forward): name their common parent in
    ``gather_units``."""
    parent = common_parent(modules) if len(set(modules)) > 1 else ""
    where = f"gather_units=[{parent!r}]" if parent else "gather_units=['<a module that contains them>']"
    return f"Gather the module that every rank calls as one unit: compshard.shard(model, {where})"


def common_parent(modules: list[str]) -> str:
    """The innermost module containing every one of ``modules`` (module paths), short of
    any of them, and short of a numbered container (a ``ModuleList`` of experts is never
    called itself): ``""`` for the root."""
    if not modules:
        return ""
    parts = [module.split(".") for module in modules]
    common = os.path.commonprefix(parts)[: min(len(p) for p in parts) - 1]
    if common and parts[0][len(common)].isdigit():
        common = common[:-1]
    return ".".join(common)
