"""fx_utils on hand-built graphs: what the scheduling passes read of a lowered graph."""

from __future__ import annotations

import operator

from torch import fx

from compshard.compile_plan import set_node_meta
from compshard.passes.fx_utils import collective_groups, start_gathers_at_waits


def _scheduled(graph: fx.Graph, kind: str, collective: str, *args: fx.Node) -> fx.Node:
    node = graph.call_function(operator.add, args or (0, 0))
    set_node_meta(node, kind=kind, collective=collective, bytes=8)
    return node


def _lowered() -> tuple[fx.Graph, dict[str, fx.Node]]:
    """Two all-gathers and a reduce-scatter as the lowerings lay them out, with compute
    between them: pack, start, compute, wait, unpack."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    n: dict[str, fx.Node] = {}
    n["pack0"] = _scheduled(graph, "pack", "fw.all_gather.0", x)
    n["start0"] = _scheduled(graph, "all_gather", "fw.all_gather.0", n["pack0"])
    n["pack1"] = _scheduled(graph, "pack", "fw.all_gather.1", x)
    n["start1"] = _scheduled(graph, "all_gather", "fw.all_gather.1", n["pack1"])
    n["compute"] = graph.call_function(operator.mul, (x, x))
    n["wait0"] = _scheduled(graph, "wait", "fw.all_gather.0", n["start0"])
    n["unpack0"] = _scheduled(graph, "unpack", "fw.all_gather.0", n["wait0"])
    n["start2"] = _scheduled(graph, "reduce_scatter", "fw.reduce_scatter.0", n["compute"])
    n["wait1"] = _scheduled(graph, "wait", "fw.all_gather.1", n["start1"])
    n["unpack1a"] = _scheduled(graph, "unpack", "fw.all_gather.1", n["wait1"])
    n["unpack1b"] = _scheduled(graph, "unpack", "fw.all_gather.1", n["unpack1a"])
    graph.output((n["unpack0"], n["unpack1b"], n["start2"]))
    return graph, n


def test_collective_groups_collect_each_collectives_nodes_in_graph_order():
    graph, n = _lowered()
    gathers = collective_groups(graph, "all_gather")
    assert [(g.pack, g.start, g.wait, g.unpack) for g in gathers] == [
        ([n["pack0"]], n["start0"], n["wait0"], [n["unpack0"]]),
        ([n["pack1"]], n["start1"], n["wait1"], [n["unpack1a"], n["unpack1b"]]),
    ]
    assert [g.issued for g in gathers] == [n["pack0"], n["pack1"]]
    (reduction,) = collective_groups(graph, "reduce_scatter")
    assert reduction.start is n["start2"] and reduction.pack == [] and reduction.issued is n["start2"]


def test_start_gathers_at_waits_moves_pack_and_start_to_their_wait():
    graph, n = _lowered()
    gathers = start_gathers_at_waits(graph)
    assert [g.wait for g in gathers] == [n["wait0"], n["wait1"]]
    order = list(graph.nodes)
    for pack, start, wait in (("pack0", "start0", "wait0"), ("pack1", "start1", "wait1")):
        assert order.index(n[wait]) - order.index(n[start]) == 1 and order.index(n[start]) - order.index(n[pack]) == 1
    assert order.index(n["compute"]) < order.index(n["pack0"])  # nothing started before the compute any more
    graph.lint()
