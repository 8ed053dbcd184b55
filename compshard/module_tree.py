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
import re
from collections.abc import Iterable, Sequence

__all__ = ["module_of", "outermost_match", "repeated_block", "repeated_containers"]


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
