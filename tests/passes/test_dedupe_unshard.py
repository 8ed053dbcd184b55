"""dedupe_unshard: one ``unshard`` per parameter per Dynamo graph, nothing else erased."""

from __future__ import annotations

import operator

import torch
from torch import fx

from compshard.comm.op_spec import UnshardArgs
from compshard.options import CompileOptions
from compshard.passes import PassContext
from compshard.passes.dedupe_unshard import dedupe_unshard
from tests.passes.graphs import layout

CTX = PassContext(CompileOptions(), "dynamo")


def _unshard(graph: fx.Graph, shard: fx.Node, param: str, reshard_after_forward: bool = True) -> fx.Node:
    """An ``unshard`` call as Dynamo records it (the op packet, positional arguments)."""
    spec = UnshardArgs(None, [4, 2], 2, "0", param, None, None, reshard_after_forward, "", "reduce", None).spec()
    return graph.call_function(torch.ops.compshard.unshard, (shard, spec, None))


def test_a_second_read_of_a_parameter_reads_the_first_unshard():
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    first, again, other = _unshard(graph, a, "w"), _unshard(graph, a, "w"), _unshard(graph, b, "v")
    product = graph.call_function(operator.mul, (first, again))
    in_place = graph.call_method("add_", (other, 1))  # its result unused: it must stay
    graph.output(product)
    dedupe_unshard(graph, CTX)
    unshards = [n for n in graph.nodes if n.target is torch.ops.compshard.unshard]
    assert unshards == [first, other]
    assert product.args == (first, first)
    assert in_place in graph.nodes and again not in graph.nodes
    graph.lint()


def test_reads_of_different_parameters_or_arguments_stay_apart():
    graph = fx.Graph()
    a = graph.placeholder("a")
    nodes = [_unshard(graph, a, "w"), _unshard(graph, a, "v"), _unshard(graph, a, "w", reshard_after_forward=False)]
    graph.output(tuple(nodes))
    unchanged = layout(graph)
    dedupe_unshard(graph, CTX)
    assert layout(graph) == unchanged
