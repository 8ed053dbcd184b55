"""partition: the joint graph split into forward and backward, and the account of what the
forward saves."""

from __future__ import annotations

import pytest

from compshard.compile_plan import node_meta
from compshard.passes.fx_utils import output_values
from compshard.passes.memory_model import HELD_OUTSIDE
from compshard.passes.partition import partition
from tests.passes.graphs import before, joint_args, param_bytes

pytestmark = pytest.mark.usefixtures("world")


def test_the_plan_counts_what_the_forward_saves_and_by_kind():
    stage = before("joint")
    args = joint_args()
    forward, backward, plan = partition(stage.gm, args.inputs, stage.plan, **args.kwargs)
    saved = [n for n in backward.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
    assert plan.saved_count == len(saved) > 0
    outputs = output_values(forward.graph)
    assert [n.name for n in outputs[len(outputs) - plan.saved_count :]] == [n.name for n in saved]
    assert plan.buckets is stage.plan.buckets and plan.recompute.policy == stage.plan.recompute.policy
    assert set(plan.recompute.saved) == {"activations", "gathered params", "inputs"}
    # the kept bucket's weight (its bias is not needed in backward), and no other bucket's
    assert plan.recompute.saved["gathered params"] == param_bytes("head.weight")
    assert plan.recompute.saved["activations"] > 0 and plan.recompute.saved["inputs"] > 0
    held = {n.name for n in backward.graph.find_nodes(op="placeholder") if n.meta.get(HELD_OUTSIDE)}
    assert held and held <= {n.name for n in saved}
    assert not any(node_meta(n).kind for n in forward.graph.nodes)  # nothing scheduled yet


def test_the_saved_activations_follow_the_recompute_tags():
    saved = {}
    for option in ("none", "full"):
        stage = before("joint", recompute=option)
        args = joint_args()
        _, _, plan = partition(stage.gm, args.inputs, stage.plan, **args.kwargs)
        assert plan.recompute.policy == option
        saved[option] = plan.recompute.saved["activations"]
    assert 0 < saved["full"] < saved["none"]
