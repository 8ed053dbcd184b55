"""The typed records a :class:`~compshard.inspection.Report` lists: one collective, one
table row, one bucket.

They are frozen: a report describes a schedule already compiled. They also read by field
name (``collective["kind"]``, ``collective.get("of")``, ``bucket["params"]``), the way
``docs/inspect.md`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from compshard.compile_plan import Freed

__all__ = ["BucketEntry", "Collective", "ScheduleRow"]


@dataclass(frozen=True)
class _ReadsByName:
    """A record whose fields also read by name, as a mapping's keys do."""

    def __getitem__(self, name: str) -> Any:
        if name not in self._names():
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name) if name in self._names() else default

    def _names(self) -> set[str]:
        return {f.name for f in fields(self)}


@dataclass(frozen=True)
class Collective(_ReadsByName):
    """One collective start or free of a scheduled graph, as :attr:`Report.collectives`
    lists it."""

    graph: str
    kind: str  # a COLLECTIVE_KINDS entry, "free", or "all_to_all" (expert parallelism's)
    unit: str  # the module of its first parameter
    bytes: int
    params: tuple[str, ...]
    node: str
    op: str  # the operator that runs it: "reduce_scatter_tensor", "exchange_rows_" (gloo), ...
    bucket: str  # the bucket names, joined by "+" when buckets share the collective
    of: Freed | None  # for a free: "buffer" (the all-gather output) or "params" (the unpacked parameters)


@dataclass(frozen=True)
class ScheduleRow(_ReadsByName):
    """One row of the report's table (:meth:`Report.rows`): a scheduled node, or a run of
    compute (or of one bucket's pack or unpack) folded into one row."""

    graph: str
    node: str  # the run's first node
    kind: str  # the scheduled kind, "compute", or "tp collective"
    bucket: str  # the bucket(s) or unit; for a tp collective, its operator and group
    ops: int  # nodes folded into the row
    bytes: int
    seconds: float  # estimated
    in_flight: int  # bytes of collectives started and not yet waited, after the row
    live_after: int  # estimated bytes live after the row


@dataclass(frozen=True)
class BucketEntry(_ReadsByName):
    """One bucket of one plan as :attr:`Report.buckets` lists it."""

    name: str
    plan: int  # index in Report.plans
    params: tuple[str, ...]
    bytes: int  # gathered
    keep_gathered: bool
    prefetch: dict[str, int]  # graph name -> across how many all-gathers' uses its all-gather runs
