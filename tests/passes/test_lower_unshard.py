"""lower_unshard: each bucket's (or coalesced buckets') ``unshard`` markers become one
all-gather: pack and start at the first member's place, wait and unpack just before the
first use; one rank or a 0-d parameter needs no collective."""

from __future__ import annotations

import pytest
import torch

from compshard.comm.transport import simulated_backends
from compshard.compile_plan import BucketPlan, Coalescing, node_meta
from compshard.passes.fx_utils import c10d, collective_groups, compshard_ops
from compshard.passes.lower_unshard import lower_unshard
from tests.passes.graphs import (
    Stack,
    assert_each_leaves_once_in_its_shape,
    before,
    calls,
    nodes_of,
    param_bytes,
    traced,
    unshard,
)

pytestmark = pytest.mark.usefixtures("world")


def _lowered(coalescing: Coalescing | None, kind: str = "forward"):
    stage = before(kind, "lower_unshard", coalesce="none")
    lower_unshard(stage.graph, stage.ctx, stage.plan.buckets, coalescing)
    stage.graph.lint()
    return stage


def test_one_all_gather_per_bucket_waited_just_before_first_use():
    shapes = {name: tuple(p.shape) for name, p in Stack().named_parameters()}
    stage = _lowered(None)
    graph = stage.graph
    assert calls(graph, compshard_ops.unshard.default) == []
    gathers = collective_groups(graph, "all_gather")
    assert [node_meta(g.start).buckets for g in gathers] == [("blocks.0",), ("blocks.1",), ("rest.0",)]
    assert [node_meta(g.start).bytes for g in gathers] == [
        param_bytes("blocks.0."),
        param_bytes("blocks.1."),
        param_bytes("head."),
    ]
    for gather in gathers:
        assert gather.start.target is c10d.all_gather_into_tensor_out.default  # the fake backend is not gloo
        assert gather.pack[0].target is compshard_ops.all_gather_copy_in.default
        assert gather.pack[0] < gather.start < gather.wait < gather.unpack[0]
        assert gather.wait.target is c10d.wait_tensor.default and node_meta(gather.wait).gathered
        after_unpack = gather.unpack[-1].next
        assert set(after_unpack.all_input_nodes) & set(gather.unpack), "the wait is not just before the first use"
        assert_each_leaves_once_in_its_shape(gather.unpack, node_meta(gather.start).params, shapes)


def test_coalesced_buckets_share_one_all_gather_and_unpack_apart():
    stage = _lowered(Coalescing(all_gather=(("blocks.0", "blocks.1"),)))
    gathers = collective_groups(stage.graph, "all_gather")
    assert [node_meta(g.start).buckets for g in gathers] == [("blocks.0", "blocks.1"), ("rest.0",)]
    assert node_meta(gathers[0].start).bytes == param_bytes("blocks.")
    flats = [n for n in gathers[0].unpack if node_meta(n).gathered]  # one flat tensor per bucket, freed apart
    assert [node_meta(n).buckets for n in flats] == [("blocks.0",), ("blocks.1",)]


def test_on_gloo_the_gather_runs_in_place_as_row_exchange(world):
    with simulated_backends({world: "gloo"}):
        stage = _lowered(None, "backward")
    gathers = collective_groups(stage.graph, "all_gather")
    assert [node_meta(g.start).buckets for g in gathers] == [("blocks.1",), ("blocks.0",)]  # rest.0 stayed gathered
    assert all(g.start.target is compshard_ops.gather_rows_.default for g in gathers)


def test_one_rank_needs_no_collective():
    shard = torch.randn(4, 2)
    gm = traced(lambda s: unshard(s, [4, 2], "w", world_size=1).sum(0), shard)
    stage = before("forward", "lower_unshard")
    lower_unshard(gm.graph, stage.ctx, BucketPlan(()), None)
    gm.recompile()
    assert calls(gm.graph, compshard_ops.unshard.default) == [] and not nodes_of(gm.graph, "all_gather", "wait")
    assert nodes_of(gm.graph, "unpack") and torch.equal(gm(shard), shard.sum(0))
