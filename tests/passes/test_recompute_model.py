"""recompute_model on a hand-built joint graph of two repeated blocks, priced by hand.

Each block ``k`` computes ``a = in @ w`` (an mm), ``r = relu(a)``, ``e = exp(a)`` and its
output ``s = r + e``; before the blocks ``h = x * 0.5``, after them ``loss = sum(s1)``. The
backward (every node fed by the tangent) reads ``h``, ``r0``, ``e0``, ``s0``, ``r1`` and
``e1``. Every value is 4 x 8 float32: 128 bytes. Under :data:`COSTS` an elementwise node
takes 1 + 128 / 128 = 2 s and an mm 1 + 512 FLOPs / 64 = 9 s.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.checkpoint import CheckpointPolicy

from compshard import cost_model
from compshard.compile_plan import Level
from compshard.cost_model import Costs
from compshard.passes.fx_utils import backward_nodes
from compshard.passes.recompute_model import (
    BlockRaise,
    Policy,
    block_raises,
    budget_levels,
    option_levels,
    policy_for,
)

aten = torch.ops.aten
COSTS = Costs(flops_per_second=64.0, bytes_per_second=128.0, node_overhead=1.0)
B0, B1 = "blocks.0", "blocks.1"
SAVE, SELECTIVE, FULL = Level.SAVE, Level.SELECTIVE, Level.FULL


class Joint:
    """The joint graph, its nodes by name."""

    def __init__(self) -> None:
        self.graph = fx.Graph()
        self.mode = FakeTensorMode()
        self.nodes: dict[str, fx.Node] = {}
        x, w0, w1 = (self.input(name, *shape) for name, shape in (("x", (4, 8)), ("w0", (8, 8)), ("w1", (8, 8))))
        tangent = self.input("tangents_1", 4, 8)
        h = self.op("h", aten.mul.Tensor, x, 0.5)
        block_input = h
        for k, w in enumerate((w0, w1)):
            block = f"blocks.{k}"
            a = self.op(f"a{k}", aten.mm.default, block_input, w, block=block)
            r = self.op(f"r{k}", aten.relu.default, a, block=block)
            e = self.op(f"e{k}", aten.exp.default, a, block=block)
            block_input = self.op(f"s{k}", aten.add.Tensor, r, e, block=block)
        self.op("loss", aten.sum.default, block_input)  # read by the code after the blocks, not by the backward
        grad = tangent
        for i, name in enumerate(("r1", "e1", "s0", "r0", "e0", "h")):
            grad = self.op(f"g{i}", aten.mul.Tensor, grad, self.nodes[name])
        self.graph.output(grad)

    def input(self, name: str, *shape: int) -> fx.Node:
        node = self.nodes[name] = self.graph.placeholder(name)
        with self.mode:
            node.meta["val"] = torch.empty(shape)
        return node

    def op(self, name: str, target, *args, block: str | None = None) -> fx.Node:
        node = self.nodes[name] = self.graph.create_node("call_function", target, args, name=name)
        with self.mode:
            node.meta["val"] = target(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
        if block is not None:
            node.meta["nn_module_stack"] = {block: (block, nn.Module)}
        return node

    def policy(self) -> Policy:
        backward = backward_nodes(self.graph)
        forward = [n for n in self.graph.nodes if n.op == "call_function" and n not in backward]
        return Policy(forward, backward, COSTS)

    def names(self, nodes: list[fx.Node]) -> set[str]:
        return {node.name for node in nodes}


def test_saving_everything_saves_what_the_backward_reads():
    joint = Joint()
    plan = joint.policy().plan({B0: SAVE, B1: SAVE}, SAVE)
    assert joint.names(plan.saved) == {"h", "r0", "e0", "s0", "r1", "e1"}
    assert plan.recomputed == [] and plan.saved_bytes == 6 * 128 and plan.recompute_seconds == 0.0


def test_selective_recomputes_the_elementwise_nodes_from_the_saved_mm():
    joint = Joint()
    plan = joint.policy().plan({B0: SELECTIVE, B1: SELECTIVE}, SAVE)
    assert joint.names(plan.saved) == {"h", "a0", "s0", "a1"}  # s0 leaves its block: kept
    assert joint.names(plan.recomputed) == {"r0", "e0", "r1", "e1"}
    assert plan.saved_bytes == 4 * 128 and plan.recompute_seconds == pytest.approx(4 * 2)


def test_full_recomputes_a_block_from_its_inputs_and_keeps_its_output():
    joint = Joint()
    plan = joint.policy().plan({B0: FULL, B1: FULL}, SAVE)
    assert joint.names(plan.saved) == {"h", "s0"}
    assert joint.names(plan.recomputed) == {"r0", "e0", "a0", "r1", "e1", "a1"}
    assert plan.saved_bytes == 2 * 128 and plan.recompute_seconds == pytest.approx(4 * 2 + 2 * 9)


def test_nodes_in_no_block_are_left_to_the_partitioner_without_an_outside_level():
    joint = Joint()
    plan = joint.policy().plan({B0: FULL, B1: FULL}, None)
    assert joint.names(plan.outside_inputs) == {"h"}  # read by the recomputed a0, decided elsewhere
    assert joint.names(plan.saved) == {"s0", "s1"}  # each block's output, where the code after it reads it


def test_a_tag_from_an_earlier_pass_wins_and_is_not_priced_again():
    joint = Joint()
    joint.nodes["e0"].meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE
    joint.nodes["r1"].meta["recompute"] = CheckpointPolicy.MUST_SAVE
    plan = joint.policy().plan({B0: SAVE, B1: FULL}, SAVE)
    assert joint.names(plan.recomputed) == {"e0", "e1", "a1"}
    assert joint.names(plan.saved) == {"h", "r0", "a0", "s0", "r1"}  # a0: e0's input, saved at SAVE
    assert plan.saved_bytes == 4 * 128  # r1's bytes are the tag's, not this plan's
    assert plan.recompute_seconds == pytest.approx(2 + 9)  # e1 and a1; e0 is the tag's


def test_a_random_node_is_saved_at_full():
    joint = Joint()
    with joint.graph.inserting_after(joint.nodes["a1"]):
        noise = joint.op("noise", aten.rand_like.default, joint.nodes["a1"], block=B1)
    assert not joint.policy().recompute_node({B1: FULL}, SAVE)(noise)
    assert joint.policy().recompute_node({B1: FULL}, SAVE)(joint.nodes["r1"])


def test_a_budget_prefers_the_raise_that_fits_with_the_least_recompute():
    policy = Joint().policy()
    # from 768 saved bytes: SELECTIVE frees 128 for 4 s, FULL 256 for 13 s, in either block
    assert budget_levels(policy, 768)[0] == {B0: SAVE, B1: SAVE}
    levels, plan = budget_levels(policy, 640)
    assert levels == {B0: SELECTIVE, B1: SAVE} and plan.saved_bytes == 640
    levels, plan = budget_levels(policy, 600)  # only FULL fits, though SELECTIVE frees more per second
    assert levels == {B0: FULL, B1: SAVE} and plan.saved_bytes == 512


def test_a_budget_no_raise_meets_alone_raises_the_most_bytes_per_second_first():
    policy = Joint().policy()
    # SELECTIVE frees 32 bytes per second, FULL 256 / 13; then FULL fits
    levels, plan = budget_levels(policy, 400)
    assert levels == {B0: SELECTIVE, B1: FULL}
    assert plan.saved_bytes == 3 * 128 and plan.recompute_seconds == pytest.approx(4 + 13)
    levels, plan = budget_levels(policy, 0)  # cannot be met: as far as raises free bytes
    assert levels == {B0: FULL, B1: FULL} and plan.saved_bytes == 2 * 128


def test_option_levels_name_a_level_for_every_block_or_price_a_budget():
    policy = Joint().policy()
    assert option_levels(policy, "none") == ({}, None)
    assert option_levels(policy, "selective") == ({B0: SELECTIVE, B1: SELECTIVE}, None)
    levels, plan = option_levels(policy, {"budget_mb": 600 / 2**20})
    assert levels == {B0: FULL, B1: SAVE} and plan.saved_bytes == 512


def test_block_raises_price_each_block_raised_alone():
    joint = Joint()
    with cost_model.assumed({"": COSTS}):  # no unshard in the graph: the group named ""
        assert policy_for(joint.graph).costs == COSTS
        raises = block_raises(joint.graph, "none", frozenset())
        chosen = block_raises(joint.graph, "full", frozenset())
    each = (BlockRaise(SELECTIVE, 128, pytest.approx(4.0)), BlockRaise(FULL, 256, pytest.approx(13.0)))
    assert raises.raises == {B0: each, B1: each}
    assert raises.optional and raises.eager_bytes == 6 * 128
    assert {node.name: block for node, block in raises.block_of.items()} == {
        **{name: B0 for name in ("a0", "r0", "e0", "s0")},
        **{name: B1 for name in ("a1", "r1", "e1", "s1")},
    }
    assert chosen.raises == {B0: (each[1],), B1: (each[1],)} and not chosen.optional
