"""bound_gradient_reductions: gradient reductions are waited as late as
``max_inflight_mb`` allows; with room for all of them nothing moves."""

from __future__ import annotations

import pytest

from compshard.compile_plan import MiB, node_meta
from compshard.passes.bound_gradient_reductions import bound_gradient_reductions
from compshard.passes.fx_utils import collective_groups
from tests.passes.graphs import before, layout

pytestmark = pytest.mark.usefixtures("world")


def _in_flight_at_starts(graph) -> list[int]:
    """At each reduce-scatter start, how many reduce-scatters are started and not waited."""
    counts, started = [], set()
    for node in graph.nodes:
        meta = node_meta(node)
        if meta.kind == "reduce_scatter":
            started.add(node)
            counts.append(len(started))
        elif meta.kind == "wait":
            started.discard(node.args[0])
    return counts


def test_with_room_for_every_reduction_nothing_moves():
    stage = before("backward", "bound_gradient_reductions", coalesce="none")
    unchanged = layout(stage.graph)
    bound_gradient_reductions(stage.graph, stage.ctx)
    assert layout(stage.graph) == unchanged
    assert _in_flight_at_starts(stage.graph) == [1, 2, 3]  # all waited at the end


def test_a_bound_below_two_reductions_waits_each_before_the_next_starts():
    stage = before("backward", "bound_gradient_reductions", coalesce="none", max_inflight_mb=1 / MiB)
    bound_gradient_reductions(stage.graph, stage.ctx)
    stage.graph.lint()
    assert _in_flight_at_starts(stage.graph) == [1, 1, 1]
    reductions = collective_groups(stage.graph, "reduce_scatter")
    for earlier, later in zip(reductions, reductions[1:]):
        assert earlier.wait < earlier.unpack[0] < later.issued  # waited and unpacked just before the next is issued
        assert earlier.unpack[-1].next is later.issued
