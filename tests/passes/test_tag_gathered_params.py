"""tag_gathered_params: gathered parameters of buckets resharded after forward are
recomputed in backward (the whole chain from the gather to its users), those of kept
buckets saved."""

from __future__ import annotations

from dataclasses import replace

import pytest
from torch.utils.checkpoint import CheckpointPolicy

from compshard.compile_plan import BucketPlan
from compshard.passes.fx_utils import compshard_ops, gathered_chain, unshard_args
from compshard.passes.tag_gathered_params import tag_gathered_params
from tests.passes.graphs import before, calls

pytestmark = pytest.mark.usefixtures("world")


def _tags(graph) -> dict:
    return {node: node.meta["recompute"] for node in graph.nodes if "recompute" in node.meta}


def test_resharded_chains_are_recomputed_and_kept_gathers_saved():
    stage = before("joint", "tag_gathered_params")
    assert not _tags(stage.graph)
    buckets = stage.plan.buckets
    tag_gathered_params(stage.graph, stage.ctx, buckets)
    expected = {}
    unshards = calls(stage.graph, compshard_ops.unshard.default)
    for node in unshards:
        if buckets.bucket_of(unshard_args(node).param).keep_gathered:
            expected[node] = CheckpointPolicy.MUST_SAVE
        else:
            expected.update(dict.fromkeys(gathered_chain(node), CheckpointPolicy.MUST_RECOMPUTE))
    assert _tags(stage.graph) == expected
    assert len(expected) > len(unshards)  # the views on the chains (the weights' transposes) are tagged too
    assert CheckpointPolicy.MUST_SAVE in expected.values()


def test_with_every_bucket_kept_nothing_is_recomputed():
    stage = before("joint", "tag_gathered_params")
    kept = BucketPlan(tuple(replace(b, keep_gathered=True) for b in stage.plan.buckets))
    tag_gathered_params(stage.graph, stage.ctx, kept)
    tags = _tags(stage.graph)
    assert set(tags.values()) == {CheckpointPolicy.MUST_SAVE}
    assert set(tags) == set(calls(stage.graph, compshard_ops.unshard.default))
