"""assign_buckets: the bucket plan of a joint graph, the graph unchanged."""

from __future__ import annotations

import pytest
import torch

from compshard.compile_plan import MiB
from compshard.passes.assign_buckets import assign_buckets
from tests.passes.graphs import before, layout, param_bytes, traced, unshard

pytestmark = pytest.mark.usefixtures("world")

BLOCK = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def test_auto_makes_a_bucket_per_block_and_pools_the_rest_keeping_the_last_used():
    stage = before("joint", "assign_buckets")
    unchanged = layout(stage.graph)
    buckets = assign_buckets(stage.graph, stage.ctx)
    assert layout(stage.graph) == unchanged
    assert [(b.index, b.name, b.params, b.keep_gathered) for b in buckets] == [
        (0, "blocks.0", tuple(f"blocks.0.{p}" for p in BLOCK), False),
        (1, "blocks.1", tuple(f"blocks.1.{p}" for p in BLOCK), False),
        (2, "rest.0", ("head.weight", "head.bias"), True),  # used last in forward: backward needs it first
    ]
    assert [b.nbytes for b in buckets] == [param_bytes("blocks.0."), param_bytes("blocks.1."), param_bytes("head.")]
    assert buckets.bucket_of("blocks.1.fc2.bias").name == "blocks.1"


def test_none_gives_every_parameter_its_own_bucket():
    stage = before("joint", "assign_buckets", buckets="none")
    buckets = assign_buckets(stage.graph, stage.ctx)
    assert [b.params for b in buckets] == [(b.name,) for b in buckets]
    (kept,) = [b.name for b in buckets if b.keep_gathered]
    assert len(buckets) == 10 and kept.startswith("head.")


def test_a_size_target_splits_in_order_of_first_use():
    stage = before("joint", "assign_buckets", buckets=param_bytes("blocks.0.") / MiB)
    buckets = assign_buckets(stage.graph, stage.ctx)
    assert [b.name for b in buckets] == ["rest.0", "rest.1", "rest.2"]
    assert [b.nbytes for b in buckets] == [param_bytes("blocks.0."), param_bytes("blocks.1."), param_bytes("head.")]


def test_patterns_make_one_bucket_per_module_matched():
    stage = before("joint", "assign_buckets", buckets=["blocks.*.fc1"])
    buckets = assign_buckets(stage.graph, stage.ctx)
    assert [b.name for b in buckets] == ["blocks.0.fc1", "rest.0", "blocks.1.fc1"]
    assert buckets.bucket_of("blocks.1.fc2.weight").name == "rest.0"


def test_a_graph_without_backward_keeps_no_bucket_gathered():
    gm = traced(
        lambda a, b: unshard(a, [4, 2], "w", 2) @ unshard(b, [2, 3], "v", 2), torch.ones(2, 2), torch.ones(1, 3)
    )
    (bucket,) = assign_buckets(gm.graph, before("joint", "assign_buckets").ctx)
    assert (bucket.name, bucket.params, bucket.nbytes, bucket.keep_gathered) == ("rest.0", ("w", "v"), 56, False)
