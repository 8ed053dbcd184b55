"""What every pass receives besides the graph and the plans it takes: the options and
which graph it is."""

from __future__ import annotations

from dataclasses import dataclass

from compshard.compile_plan import GraphKind
from compshard.options import CompileOptions

__all__ = ["PassContext"]


@dataclass(frozen=True)
class PassContext:
    options: CompileOptions
    graph: GraphKind
