"""estimate_memory: bytes live after every node, and the peak while a node runs; inputs
count in backward graphs only."""

from __future__ import annotations

import pytest
import torch

from compshard.compile_plan import node_meta
from compshard.options import CompileOptions
from compshard.passes import PassContext
from compshard.passes.estimate_memory import estimate_memory
from tests.passes.graphs import before, layout, traced

X = torch.zeros(100)  # 400 bytes


def _graph():
    return traced(lambda x: (x * 2 + x).sum(), X).graph


def test_two_temporaries_peak_while_the_second_is_made():
    graph = _graph()
    unchanged = layout(graph)
    peak = estimate_memory(graph, PassContext(CompileOptions(), "forward"))
    assert layout(graph) == unchanged
    assert peak == 800  # x * 2 and x * 2 + x live at once
    live = {node.name: node_meta(node).live_bytes for node in graph.nodes}
    assert list(live.values()) == [0, 400, 400, 4, 4]  # after each: x (held by the caller), mul, add, sum, output


def test_a_backward_graph_counts_its_inputs_until_their_last_use():
    graph = _graph()
    peak = estimate_memory(graph, PassContext(CompileOptions(), "backward"))
    assert peak == 400 + 800  # x is released after its last use, the + x
    assert [node_meta(node).live_bytes for node in graph.nodes] == [400, 800, 400, 4, 4]


@pytest.mark.usefixtures("world")
def test_every_node_of_a_scheduled_graph_gets_its_live_bytes():
    stage = before("backward", "estimate_memory")
    peak = estimate_memory(stage.graph, stage.ctx)
    live = [node_meta(node).live_bytes for node in stage.graph.nodes]
    assert None not in live and 0 < max(live) <= peak
