"""What every pass receives besides the graph: options, which graph it is, and the rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from compshard.options import CompileOptions

GraphKind = Literal["dynamo", "joint", "forward", "backward", "inference"]


@dataclass
class PassContext:
    options: CompileOptions
    graph: GraphKind
    rank: int = 0
    # Filled by the passes, read by later passes, the report and the fingerprint check.
    notes: dict = field(default_factory=dict)
