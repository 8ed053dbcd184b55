"""recompute: the activation recompute policy of the repeated blocks, as partitioner tags,
and its plan; tags set before it (the gathered parameters') stay."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from compshard.compile_plan import Level
from compshard.passes.fx_utils import block_of_nodes
from compshard.passes.recompute import recompute
from tests.passes.graphs import before

pytestmark = pytest.mark.usefixtures("world")
aten = torch.ops.aten
SAVE, RECOMPUTE = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE


def _run(option):
    """The joint graph's tags before and after ``recompute`` under ``option``, the plan, and
    each node's block."""
    stage = before("joint", "recompute", recompute=option)
    earlier = {node: node.meta["recompute"] for node in stage.graph.nodes if "recompute" in node.meta}
    plan = recompute(stage.graph, stage.ctx, stage.plan.buckets)
    tags = {node: node.meta["recompute"] for node in stage.graph.nodes if "recompute" in node.meta}
    return earlier, tags, plan, block_of_nodes(list(stage.graph.nodes))


def _in_blocks(tags: dict, block_of: dict, target) -> list:
    return [tag for node, tag in tags.items() if node in block_of and node.target == target]


def test_none_tags_nothing():
    earlier, tags, plan, _ = _run("none")
    assert plan.policy == "none" and plan.levels == {} and tags == earlier


@pytest.mark.parametrize("option", ["full", "selective"])
def test_a_named_policy_tags_the_blocks_and_keeps_earlier_tags(option):
    earlier, tags, plan, block_of = _run(option)
    level = Level[option.upper()]
    assert plan.policy == option and plan.levels == {"blocks.0": level, "blocks.1": level}
    assert {node: tags[node] for node in earlier} == earlier
    assert all(node in block_of for node in set(tags) - set(earlier) if tags[node] == RECOMPUTE)
    assert _in_blocks(tags, block_of, aten.relu.default) and set(_in_blocks(tags, block_of, aten.relu.default)) == {
        RECOMPUTE
    }
    matmuls = set(_in_blocks(tags, block_of, aten.addmm.default))
    assert matmuls == ({RECOMPUTE} if option == "full" else {SAVE})  # selective keeps what costs FLOPs
    assert plan.planned_bytes > 0 and plan.recompute_seconds > 0


def test_a_budget_that_cannot_be_met_warns_and_takes_the_least_it_can_save():
    with pytest.warns(UserWarning, match="budget_mb=0 .* cannot be met"):
        _, _, plan, _ = _run({"budget_mb": 0})
    assert plan.policy == "budget" and not plan.fits and plan.budget_bytes == 0
    assert set(plan.levels.values()) == {Level.FULL}


def test_a_budget_that_fits_recomputes_nothing():
    _, _, plan, _ = _run({"budget_mb": 1024})
    assert plan.fits and plan.recompute_seconds == 0 and set(plan.levels.values()) == {Level.SAVE}
