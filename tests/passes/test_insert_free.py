"""insert_free: a ``free`` right after the last use of every gathered buffer and bucket,
none for one that reaches the graph outputs (kept for backward)."""

from __future__ import annotations

import pytest

from compshard.compile_plan import node_meta
from compshard.passes.fx_utils import aliases, compshard_ops, escapes, gathered_buffers
from compshard.passes.insert_free import insert_free
from tests.passes.graphs import before, calls, layout

pytestmark = pytest.mark.usefixtures("world")


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_each_gathered_value_is_freed_after_its_last_use_unless_it_is_an_output(kind):
    stage = before(kind, "insert_free")
    assert calls(stage.graph, compshard_ops.free.default) == []
    insert_free(stage.graph, stage.ctx)
    stage.graph.lint()
    frees = {free.args[0]: free for free in calls(stage.graph, compshard_ops.free.default)}
    buffers = gathered_buffers(stage.graph)
    assert set(frees) == {b for b in buffers if not escapes(b)}
    for buffer, free in frees.items():
        group = aliases(buffer)
        uses = [user for alias in group for user in alias.users if user not in group and user is not free]
        between = max(uses).next
        while between is not free:  # right after the last use (behind other frees placed there)
            assert between.target is compshard_ops.free.default
            between = between.next
        meta = node_meta(free)
        assert meta.kind == "free" and meta.freed == ("buffer" if node_meta(buffer).kind == "wait" else "params")
    if kind == "forward":  # the head's bucket is kept for backward: its parameters are not freed here
        kept = [b for b in buffers if node_meta(b).buckets == ("rest.0",) and node_meta(b).kind == "unpack"]
        assert kept and not set(kept) & set(frees)


def test_a_graph_without_gathered_values_is_left_alone():
    stage = before("forward", "lower_unshard")  # nothing gathered yet
    unchanged = layout(stage.graph)
    insert_free(stage.graph, stage.ctx)
    assert layout(stage.graph) == unchanged
