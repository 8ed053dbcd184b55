"""restore_shapes: every node's own ``meta["val"]`` is back where ``agree_shapes`` put a
stand-in; other nodes are untouched."""

from __future__ import annotations

import torch

from compshard.compile_plan import node_meta, set_node_meta
from compshard.options import CompileOptions
from compshard.passes import PassContext
from compshard.passes.restore_shapes import restore_shapes
from tests.passes.graphs import layout, traced


def test_stashed_values_come_back_and_the_others_stay():
    gm = traced(lambda x: (x * 2).sum(0), torch.zeros(3, 2))
    own = {node: node.meta.get("val") for node in gm.graph.nodes}
    placeholder, product, total, _ = gm.graph.nodes
    for node in (product, total):  # stand-ins as agree_shapes leaves them: another rank's larger shapes
        set_node_meta(node, stashed_val=node.meta["val"])
        with node.meta["val"].fake_mode:
            node.meta["val"] = torch.empty(5, *node.meta["val"].shape[1:])
    unchanged = layout(gm.graph)
    restore_shapes(gm.graph, PassContext(CompileOptions(), "forward"))
    assert layout(gm.graph) == unchanged
    assert all(node.meta.get("val") is own[node] for node in gm.graph.nodes)
    assert all(node_meta(node).stashed_val is None for node in gm.graph.nodes)
    assert "compshard" not in placeholder.meta  # nothing recorded where nothing was stashed
