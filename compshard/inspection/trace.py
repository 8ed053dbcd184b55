"""The Chrome / Perfetto trace ``Report.save_trace`` writes: the estimated timelines of
the step's graphs, one after another from time 0, and the measured profiler events of one
step (``inspect(..., profile=True)``) from the same time 0.

Kept apart from the report: it is the one place that knows the trace format (``"ph"``
phases, integer process ids named by metadata events, microsecond times).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import fx

from compshard.compile_plan import node_meta
from compshard.inspection.nodes import program_group
from compshard.timeline import Timeline

__all__ = ["chrome_trace"]

_STREAMS = ("compute", "comm")  # the estimated timeline's threads, tids 1 and 2


def chrome_trace(
    graphs: Mapping[str, fx.GraphModule], timelines: Mapping[str, Timeline], measured: dict | None
) -> dict:
    """The trace of ``timelines`` (graph name -> the estimate of ``graphs[name]``), each
    graph its own process (``estimated forward``, ...) with a compute and a communication
    thread and two counter tracks (estimated bytes live, bytes of collectives in flight),
    followed by the events of the ``measured`` profiler trace, their processes named
    ``measured ...``."""
    trace = _Trace()
    offset = 0.0  # seconds: each graph starts where the previous one ended
    for name, timeline in timelines.items():
        trace.add_estimated(name, graphs[name], timeline, offset)
        offset += timeline.total
    trace.add_measured([e for e in (measured or {}).get("traceEvents", []) if isinstance(e, dict)])
    return {"traceEvents": trace.events, "displayTimeUnit": "ms"}


class _Trace:
    """Trace events in the order written; process ids are integers from 1, each named
    and sorted by metadata events where it is first used."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._pids: dict[Any, int] = {}

    def pid(self, key: Any, name: str) -> int:
        if key not in self._pids:
            pid = self._pids[key] = len(self._pids) + 1
            self.events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}})
            self.events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        return self._pids[key]

    def add_estimated(self, name: str, gm: fx.GraphModule, timeline: Timeline, offset: float) -> None:
        """One graph's estimated spans and counters, its times shifted by ``offset`` seconds."""
        process = self.pid(("estimated", name), f"estimated {name}")
        for tid, stream in enumerate(_STREAMS, 1):
            self.events.append({"ph": "M", "name": "thread_name", "pid": process, "tid": tid, "args": {"name": stream}})
        nodes = {node.name: node for node in gm.graph.nodes}
        for span in timeline.spans:
            group = program_group(nodes[span.name]) if span.name in nodes else ""
            self.events.append(
                {
                    "name": span.name,
                    "cat": "tp collective" if group else span.kind,
                    "ph": "X",
                    "pid": process,
                    "tid": _STREAMS.index(span.stream) + 1,
                    "ts": (offset + span.start) * 1e6,
                    "dur": (span.end - span.start) * 1e6,
                    **({"args": {"group": group}} if group else {}),
                }
            )
        for node, seconds in timeline.time_after.items():
            counters = {
                "estimated live bytes": node_meta(node).live_bytes or 0,
                "bytes in flight": timeline.inflight_after.get(node, 0),
            }
            for counter, value in counters.items():
                ts = (offset + seconds) * 1e6
                self.events.append({"name": counter, "ph": "C", "pid": process, "ts": ts, "args": {"bytes": value}})

    def add_measured(self, measured: list[dict]) -> None:
        """The profiler's events under processes of their own, shifted so that the first
        timed event starts at 0."""
        timed = [float(e["ts"]) for e in measured if e.get("ph") != "M" and "ts" in e]
        origin = min(timed, default=0.0)
        names = {
            e.get("pid"): e.get("args", {}).get("name")
            for e in measured
            if e.get("ph") == "M" and e.get("name") == "process_name"
        }
        for event in measured:
            original = event.get("pid")
            name = " ".join(str(part) for part in ("measured", names.get(original), original) if part not in (None, ""))
            event = dict(event, pid=self.pid(("measured", original), name))
            if event.get("ph") == "M":
                if event.get("name") in ("process_name", "process_sort_index"):
                    continue  # named by pid()
                event.pop("ts", None)
            elif "ts" in event:
                event["ts"] = float(event["ts"]) - origin
            self.events.append(event)
