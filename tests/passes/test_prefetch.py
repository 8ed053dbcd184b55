"""prefetch: each all-gather's pack and start move earlier (a fixed distance, or "auto"),
never past the gather used before it, within the in-flight bound and (auto) the estimated
peak; waits stay where they are."""

from __future__ import annotations

import pytest

from compshard.compile_plan import MiB
from compshard.passes.fx_utils import collective_groups, is_view, start_gathers_at_waits
from compshard.passes.memory_model import live_bytes
from compshard.passes.prefetch import prefetch
from tests.passes.graphs import before, copy_module

pytestmark = pytest.mark.usefixtures("world")


def _prefetched(**options):
    stage = before("forward", "prefetch", coalesce="none", **options)
    waits = [g.wait for g in collective_groups(stage.graph, "all_gather")]
    users = {wait: list(wait.users) for wait in waits}
    plan = prefetch(stage.graph, stage.ctx)
    stage.graph.lint()
    gathers = collective_groups(stage.graph, "all_gather")
    assert [g.wait for g in gathers] == waits and all(list(w.users) == users[w] for w in waits)
    assert all(a.start < b.start for a, b in zip(gathers, gathers[1:]))  # issue order = order of use
    return stage, gathers, plan


def _between(first, last) -> list:
    nodes, node = [], first.next
    while node is not last:
        nodes.append(node)
        node = node.next
    return nodes


def test_distance_zero_starts_every_gather_at_its_wait():
    _, gathers, plan = _prefetched(prefetch=0)
    assert plan.as_dict() == {"blocks.0": 0, "blocks.1": 0, "rest.0": 0}
    for gather in gathers:
        assert gather.start.next is gather.wait and gather.pack[-1].next is gather.start


def test_distance_one_starts_each_gather_after_the_previous_wait():
    _, gathers, plan = _prefetched(prefetch=1)
    assert {name: d for name, d in plan.as_dict().items() if name != "blocks.0"} == {"blocks.1": 1, "rest.0": 1}
    for previous, gather in zip(gathers, gathers[1:]):
        assert all(is_view(n) for n in _between(previous.wait, gather.pack[0]))
        assert gather.start < gather.wait and any(not is_view(n) for n in _between(gather.start, gather.wait))


def test_an_in_flight_bound_below_two_gathers_keeps_each_at_its_wait():
    _, gathers, plan = _prefetched(prefetch=2, max_inflight_mb=1 / MiB)
    assert set(plan.as_dict().values()) == {0}
    assert all(g.start.next is g.wait for g in gathers)


def test_auto_never_raises_the_estimated_peak():
    stage = before("forward", "prefetch", coalesce="none")
    at_waits = copy_module(stage.gm).graph
    start_gathers_at_waits(at_waits)
    peak = max(live_bytes(at_waits, count_inputs=False)[0].values())
    plan = prefetch(stage.graph, stage.ctx)
    assert max(live_bytes(stage.graph, count_inputs=False)[0].values()) <= peak
    assert set(plan.as_dict()) == {"blocks.0", "blocks.1", "rest.0"}
