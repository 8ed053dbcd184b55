"""Estimated timeline of a scheduled graph: one compute stream, one communication stream.

Compute nodes run one after another for their estimated seconds; a collective start
queues its collective on the communication stream (first in, first out, each for its
``alpha + bytes * beta``); a wait holds the compute stream until its collective ends.
The time compute spends held is the exposed communication. Estimates come from the
nodes' ``NodeMeta.seconds`` (see the ``estimate_costs`` pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import fx

from compshard.compile_plan import COLLECTIVE_KINDS, node_meta

__all__ = ["Span", "Timeline", "simulate"]


@dataclass
class Span:
    name: str
    stream: str  # "compute" or "comm"
    start: float
    end: float
    kind: str


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    total: float = 0.0
    exposed_comm: float = 0.0
    comm: float = 0.0
    inflight_after: dict[fx.Node, int] = field(default_factory=dict)  # bytes started, not waited
    time_after: dict[fx.Node, float] = field(default_factory=dict)  # compute stream's time after the node


def simulate(graph: fx.Graph) -> Timeline:
    timeline = Timeline()
    now = comm_free = 0.0
    ends: dict[fx.Node, float] = {}
    inflight: dict[fx.Node, int] = {}
    for node in graph.nodes:
        meta = node_meta(node)
        kind = meta.kind or "compute"
        seconds = meta.seconds or 0.0
        if kind in COLLECTIVE_KINDS:
            begin = max(now, comm_free)
            comm_free = ends[node] = begin + seconds
            timeline.spans.append(Span(node.name, "comm", begin, comm_free, kind))
            timeline.comm += seconds
            inflight[node] = meta.bytes
        elif kind == "wait":
            (start,) = node.args
            ready = ends.get(start, now)
            if ready > now:
                timeline.spans.append(Span(node.name, "compute", now, ready, "wait"))
                timeline.exposed_comm += ready - now
                now = ready
            inflight.pop(start, None)
        elif node.op == "call_function" and seconds:
            timeline.spans.append(Span(node.name, "compute", now, now + seconds, kind))
            now += seconds
        timeline.inflight_after[node] = sum(inflight.values())
        timeline.time_after[node] = now
    timeline.total = max(now, comm_free)
    return timeline
