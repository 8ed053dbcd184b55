"""timeline.simulate on hand-built graphs: one compute stream, one first-in-first-out
communication stream, waits that hold compute until their collective ends."""

from __future__ import annotations

import operator

import pytest
from torch import fx

from compshard.compile_plan import node_meta, set_node_meta
from compshard.timeline import Span, simulate


class Schedule:
    """A graph built node by node, each with its scheduled kind and estimated seconds."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.x = self.graph.placeholder("x")

    def compute(self, name: str, seconds: float | None) -> fx.Node:
        node = self.graph.create_node("call_function", operator.neg, (self.x,), name=name)
        if seconds is not None:
            set_node_meta(node, seconds=seconds)
        return node

    def start(self, name: str, seconds: float, nbytes: int, kind: str = "all_gather") -> fx.Node:
        node = self.graph.create_node("call_function", operator.pos, (self.x,), name=name)
        set_node_meta(node, kind=kind, seconds=seconds, bytes=nbytes)
        return node

    def wait(self, name: str, start: fx.Node) -> fx.Node:
        node = self.graph.create_node("call_function", operator.pos, (start,), name=name)
        set_node_meta(node, kind="wait", bytes=node_meta(start).bytes)
        return node


def test_compute_nodes_run_one_after_another():
    s = Schedule()
    a, b = s.compute("a", 1.0), s.compute("b", 2.0)
    timeline = simulate(s.graph)
    assert timeline.spans == [Span("a", "compute", 0.0, 1.0, "compute"), Span("b", "compute", 1.0, 3.0, "compute")]
    assert timeline.total == 3.0 and timeline.comm == 0.0 and timeline.exposed_comm == 0.0
    assert timeline.time_after[a] == 1.0 and timeline.time_after[b] == 3.0


def test_nodes_without_seconds_and_placeholders_take_no_time():
    s = Schedule()
    set_node_meta(s.x, seconds=5.0)  # a placeholder runs nothing, whatever it says
    free = s.compute("free", None)
    s.compute("a", 1.0)
    timeline = simulate(s.graph)
    assert [span.name for span in timeline.spans] == ["a"]
    assert timeline.time_after[s.x] == 0.0 and timeline.time_after[free] == 0.0
    assert timeline.total == 1.0


def test_a_collective_hidden_behind_compute_exposes_nothing():
    s = Schedule()
    start = s.start("ag", 2.0, 100)
    compute = s.compute("a", 3.0)
    wait = s.wait("w", start)
    timeline = simulate(s.graph)
    assert Span("ag", "comm", 0.0, 2.0, "all_gather") in timeline.spans
    assert [span.kind for span in timeline.spans] == ["all_gather", "compute"]  # no wait span
    assert timeline.exposed_comm == 0.0 and timeline.comm == 2.0 and timeline.total == 3.0
    assert timeline.inflight_after[start] == 100 and timeline.inflight_after[compute] == 100
    assert timeline.inflight_after[wait] == 0


def test_a_wait_holds_compute_until_its_collective_ends():
    s = Schedule()
    start = s.start("ag", 5.0, 100)
    s.compute("a", 1.0)
    wait = s.wait("w", start)
    s.compute("b", 1.0)
    timeline = simulate(s.graph)
    assert Span("w", "compute", 1.0, 5.0, "wait") in timeline.spans
    assert timeline.exposed_comm == pytest.approx(4.0)
    assert timeline.time_after[wait] == 5.0 and timeline.total == 6.0


def test_collectives_queue_first_in_first_out():
    s = Schedule()
    s.start("ag0", 2.0, 10)
    second = s.start("ag1", 2.0, 30)
    s.compute("a", 1.0)
    s.wait("w1", second)
    timeline = simulate(s.graph)
    comm = [(span.name, span.start, span.end) for span in timeline.spans if span.stream == "comm"]
    assert comm == [("ag0", 0.0, 2.0), ("ag1", 2.0, 4.0)]  # the second starts when the first ends
    assert timeline.inflight_after[second] == 40
    assert timeline.exposed_comm == pytest.approx(3.0)  # compute at 1, the second done at 4
    assert timeline.comm == 4.0


def test_a_collective_starts_no_earlier_than_the_compute_before_it():
    s = Schedule()
    s.compute("a", 1.5)
    start = s.start("rs", 1.0, 8, kind="reduce_scatter")
    s.wait("w", start)
    timeline = simulate(s.graph)
    assert Span("rs", "comm", 1.5, 2.5, "reduce_scatter") in timeline.spans
    assert timeline.exposed_comm == pytest.approx(1.0) and timeline.total == 2.5


def test_a_collective_never_waited_still_ends_the_timeline():
    s = Schedule()
    start = s.start("ar", 4.0, 16, kind="all_reduce")
    s.compute("a", 1.0)
    timeline = simulate(s.graph)
    assert timeline.total == 4.0 and timeline.exposed_comm == 0.0
    assert timeline.inflight_after[start] == 16 and timeline.time_after[start] == 0.0


def test_a_wait_on_a_finished_collective_costs_nothing():
    s = Schedule()
    start = s.start("ag", 1.0, 8)
    s.compute("a", 2.0)
    s.wait("w", start)
    s.wait("w_again", start)  # the collective is no longer in flight
    timeline = simulate(s.graph)
    assert [span.stream for span in timeline.spans] == ["comm", "compute"]
    assert timeline.exposed_comm == 0.0 and timeline.total == 2.0
