"""lower_reduce_grad: each bucket's (or coalesced buckets') ``reduce_grad`` markers become
one reduce-scatter packed as soon as the last gradient exists and waited where a result
is first computed with (the end, for gradients that only leave the graph); one rank needs
no collective."""

from __future__ import annotations

import pytest
import torch

from compshard.comm.transport import simulated_backends
from compshard.compile_plan import BucketPlan, Coalescing, node_meta
from compshard.passes.fx_utils import c10d, collective_groups, compshard_ops, is_view, reduce_grad_args
from compshard.passes.lower_reduce_grad import lower_reduce_grad
from tests.passes.graphs import (
    assert_each_leaves_once_in_its_shape,
    before,
    calls,
    nodes_of,
    param_bytes,
    reduce_grad,
    traced,
)

pytestmark = pytest.mark.usefixtures("world")


def _lowered(coalescing: Coalescing | None):
    stage = before("backward", "lower_reduce_grad", coalesce="none")
    grads = {
        reduce_grad_args(n).param: reduce_grad_args(n).grad
        for n in calls(stage.graph, compshard_ops.reduce_grad.default)
    }
    lower_reduce_grad(stage.graph, stage.ctx, stage.plan.buckets, coalescing)
    stage.graph.lint()
    return stage, grads


def _local_shapes() -> dict[str, tuple[int, ...]]:
    stage = before("backward", "lower_reduce_grad", coalesce="none")
    reductions = calls(stage.graph, compshard_ops.reduce_grad.default)
    return {reduce_grad_args(n).param: tuple(n.meta["val"].shape) for n in reductions}


def _last_compute(graph) -> torch.fx.Node:
    return [n for n in graph.nodes if n.op == "call_function" and node_meta(n).kind is None and not is_view(n)][-1]


def test_one_reduce_scatter_per_bucket_packed_once_its_gradients_exist():
    local_shapes = _local_shapes()
    stage, grads = _lowered(None)
    graph = stage.graph
    assert calls(graph, compshard_ops.reduce_grad.default) == []
    reductions = collective_groups(graph, "reduce_scatter")
    assert [node_meta(r.start).buckets for r in reductions] == [("rest.0",), ("blocks.1",), ("blocks.0",)]
    assert [node_meta(r.start).bytes for r in reductions] == [
        param_bytes("head."),
        param_bytes("blocks.1."),
        param_bytes("blocks.0."),
    ]
    last = _last_compute(graph)
    for reduction in reductions:
        (pack,) = reduction.pack
        assert pack.target is compshard_ops.reduce_scatter_copy_in.default
        assert reduction.start.target is c10d.reduce_scatter_tensor.default
        assert set(pack.args[0]) == {grads[p] for p in node_meta(reduction.start).params}
        assert last < reduction.wait  # the gradients only leave the graph: waited at the end
        assert reduction.unpack[0].target is compshard_ops.reduce_scatter_copy_out.default
        assert_each_leaves_once_in_its_shape(reduction.unpack, node_meta(reduction.start).params, local_shapes)
    for earlier, later in zip(reductions, reductions[1:]):  # started while the next bucket's gradients are made
        assert earlier.start < max(later.pack[0].args[0])


def test_coalesced_buckets_share_one_reduce_scatter():
    stage, _ = _lowered(Coalescing(reduce_scatter=(("rest.0", "blocks.1"), ("blocks.0",))))
    reductions = collective_groups(stage.graph, "reduce_scatter")
    assert [node_meta(r.start).buckets for r in reductions] == [("rest.0", "blocks.1"), ("blocks.0",)]
    assert node_meta(reductions[0].start).bytes == param_bytes("head.", "blocks.1.")


def test_on_gloo_the_reduce_scatter_runs_as_an_exchange_summed_by_the_unpack(world):
    with simulated_backends({world: "gloo"}):
        stage, _ = _lowered(None)
    for reduction in collective_groups(stage.graph, "reduce_scatter"):
        assert reduction.start.target is compshard_ops.exchange_rows_.default
        rows = reduction.unpack[0]
        assert rows.target is torch.ops.aten.view.default and rows.args[1][0] == 2 and rows.args[0] is reduction.wait


def test_one_rank_only_casts_and_views():
    grad = torch.randn(4, 2)
    gm = traced(lambda g: reduce_grad(g * 2, "w", world_size=1), grad)
    stage = before("backward", "lower_reduce_grad")
    lower_reduce_grad(gm.graph, stage.ctx, BucketPlan(()), None)
    gm.recompile()
    assert calls(gm.graph, compshard_ops.reduce_grad.default) == []
    assert not nodes_of(gm.graph, "reduce_scatter", "all_reduce", "wait")
    assert torch.equal(gm(grad), grad * 2)
