"""Inspection: what the backend scheduled for one step in this process, as a report. It
reports; it predicts nothing (``compshard.predict`` builds on it for that).

- :mod:`~compshard.inspection.capture`: ``compshard.inspect`` compiles a module and runs
  one step, collecting every graph the backend schedules.
- :mod:`~compshard.inspection.report`: the :class:`Report` of those graphs and its text.
- :mod:`~compshard.inspection.records`: the typed records it lists (collectives, table
  rows, buckets).
- :mod:`~compshard.inspection.trace`: the Chrome / Perfetto trace ``Report.save_trace``
  writes.
- :mod:`~compshard.inspection.nodes`: how the report names a scheduled graph's nodes.

This layer sits above the backend (it compiles through it); only ``compshard`` itself and
``compshard.predict`` import it.
"""

from __future__ import annotations

from compshard.inspection.capture import inspect
from compshard.inspection.records import BucketEntry, Collective, ScheduleRow
from compshard.inspection.report import Report

__all__ = ["BucketEntry", "Collective", "Report", "ScheduleRow", "inspect"]
