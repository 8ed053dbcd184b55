"""agree_shapes / agree_lowered_shapes: every rank estimates on the largest shapes any rank
has (stand-ins, this rank's own values stashed), and on the largest estimated seconds."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

from compshard.compile_plan import node_meta
from compshard.passes.agree_shapes import agree_lowered_shapes, agree_shapes
from compshard.passes.fx_utils import compshard_ops, unshard_args
from tests.passes.graphs import before, calls

pytestmark = pytest.mark.usefixtures("world")
module = importlib.import_module("compshard.passes.agree_shapes")  # (the package's name is the function)


def _values(graph) -> dict:
    return {node: node.meta.get("val") for node in graph.nodes}


def _larger(shapes: list) -> list:
    """Another rank's shapes: every dimension of every tensor one larger."""
    return [None if tensors is None else [tuple(d + 1 for d in shape) for shape in tensors] for tensors in shapes]


@pytest.fixture
def two_ranks(monkeypatch):
    """The fake world's second rank answers the exchange with ``answer(own value)``."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")

    def answer_with(answer):
        monkeypatch.setattr(
            module, "exchange_across_ranks", lambda namespace, group_name, value, what: (1, [value, answer(value)])
        )

    return answer_with


def _shape(node) -> tuple:
    return tuple(node.meta["val"].shape)


def test_on_the_fake_world_every_rank_is_this_one_and_nothing_changes():
    stage = before("forward", "agree_shapes")
    values = _values(stage.graph)
    agree_shapes(stage.graph, stage.ctx)
    assert _values(stage.graph) == values and not any(node_meta(n).stashed_val is not None for n in values)


def test_the_largest_shapes_stand_in_but_a_ranks_own_rows_keep_theirs(two_ranks):
    two_ranks(lambda value: (_larger(value[0]), value[1]))
    stage = before("forward", "agree_shapes")
    values = _values(stage.graph)
    shards = {unshard_args(n).shard for n in calls(stage.graph, compshard_ops.unshard.default)}
    agree_shapes(stage.graph, stage.ctx)
    changed = 0
    for node, own in values.items():
        if not isinstance(own, torch.Tensor):
            continue
        if node in shards:
            assert node.meta["val"] is own and node_meta(node).stashed_val is None
        else:
            changed += 1
            assert node_meta(node).stashed_val is own and _shape(node) == tuple(d + 1 for d in own.shape), node
    assert changed and shards


def test_graphs_that_differ_between_ranks_are_left_to_the_schedule_check(two_ranks):
    two_ranks(lambda value: (value[0][:-1], value[1]))
    stage = before("forward", "agree_shapes")
    values = _values(stage.graph)
    agree_shapes(stage.graph, stage.ctx)
    assert _values(stage.graph) == values


def test_after_lowering_every_node_is_agreed_and_takes_the_largest_seconds(two_ranks):
    two_ranks(lambda value: (_larger(value[0]), value[1] and [1.0] * len(value[1])))  # the other: 1 s a node
    stage = before("forward", "agree_lowered_shapes", coalesce="none")  # no other exchange on the way
    agree_lowered_shapes(stage.graph, stage.ctx)
    for node in stage.graph.nodes:
        meta = node_meta(node)
        assert meta.agreed_seconds == 1.0
        if isinstance(meta.stashed_val, torch.Tensor):
            assert _shape(node) == tuple(d + 1 for d in meta.stashed_val.shape)
        elif isinstance(node.meta.get("val"), torch.Tensor):  # only tensors of the same shape keep their value
            pytest.fail(f"{node} kept its own value")
