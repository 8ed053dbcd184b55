"""estimate_costs: every node's estimated seconds (cost model), the graph unchanged."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from compshard import cost_model
from compshard.compile_plan import COLLECTIVE_KINDS, node_meta, set_node_meta
from compshard.cost_model import Costs, collective_seconds
from compshard.passes.estimate_costs import estimate_costs
from tests.passes.graphs import before, layout, nodes_of, traced

pytestmark = pytest.mark.usefixtures("world")


def test_collectives_cost_their_link_waits_nothing_and_compute_its_estimate():
    stage = before("backward", "estimate_costs")
    unchanged = layout(stage.graph)
    estimate_costs(stage.graph, stage.ctx)
    assert layout(stage.graph) == unchanged
    starts = nodes_of(stage.graph, *COLLECTIVE_KINDS)
    assert {node_meta(n).kind for n in starts} == {"all_gather", "reduce_scatter"}
    for node in starts:
        meta = node_meta(node)
        assert meta.seconds == collective_seconds(meta.bytes, Costs(), meta.kind) > Costs().alpha
    assert all(node_meta(n).seconds == 0.0 for n in nodes_of(stage.graph, "wait"))
    compute = [
        n for n in stage.graph.nodes if isinstance(n.target, torch._ops.OpOverload) and node_meta(n).kind is None
    ]
    assert compute and all(node_meta(n).seconds >= Costs().node_overhead for n in compute)


def test_the_ranks_agreed_seconds_win():
    stage = before("forward", "estimate_costs")
    compute = next(n for n in stage.graph.nodes if n.op == "call_function" and node_meta(n).kind is None)
    set_node_meta(compute, agreed_seconds=3.0)
    estimate_costs(stage.graph, stage.ctx)
    assert node_meta(compute).seconds == 3.0


def test_only_ops_that_can_count_flops_run_again_and_the_estimates_are_unchanged():
    """An op with no FLOP formula and no decomposition counts zero FLOPs: its estimate is
    its bytes, whether or not it is run again under the counter (which is skipped)."""
    gm = traced(lambda x, w: torch.relu((x @ w).view(-1) + 1).sum(), torch.randn(8, 4), torch.randn(4, 6))
    ops = [n for n in gm.graph.nodes if isinstance(n.target, torch._ops.OpOverload)]
    counting = {n.target for n in ops if cost_model._counts_flops(n.target)}
    assert counting == {torch.ops.aten.mm.default}
    assert cost_model._counts_flops(torch.ops.aten.linear.default)  # decomposes to ops with formulas
    assert not cost_model._counts_flops(torch.ops.compshard.unshard.default)
    for node in ops:
        values = (node.args, node.kwargs)
        args, kwargs = torch.utils._pytree.tree_map_only(torch.fx.Node, lambda n: n.meta["val"], values)
        skipped = cost_model._node_seconds(node, node.target, args, kwargs, Costs())
        with mock.patch.object(cost_model, "_counts_flops", lambda op: True):
            run_again = cost_model._node_seconds(node, node.target, args, kwargs, Costs())
        assert skipped == run_again
