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
    # One compile's decisions shared by its joint, forward and backward graphs (the bucket
    # plan): the backend hands the same dict to each of them.
    shared: dict = field(default_factory=dict)
    # Filled by the passes on this graph, read by later passes, the report and the check.
    notes: dict = field(default_factory=dict)
