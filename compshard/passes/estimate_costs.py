"""Analysis pass: estimated seconds of every node, from the cost model.

Writes ``NodeMeta.seconds`` (compute nodes: FLOPs and bytes, at the constants of the
graph's first process group, or of the group calibrated last in a graph with no
collective; collective starts: ``alpha + bytes * beta`` of the
collective's own group, twice for an all-reduce). The constants were calibrated when the parameters were
sharded and agreed across ranks (see ``cost_model``), so the decisions made from these
estimates are the same on every rank.
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import COLLECTIVE_KINDS, node_meta, set_node_meta
from compshard.cost_model import collective_seconds, compute_costs, costs_for, node_seconds
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import collective_group, op_arg

__all__ = ["estimate_costs"]


def estimate_costs(graph: fx.Graph, ctx: PassContext) -> None:
    group_name = collective_group(graph)
    costs = costs_for(group_name) if group_name else compute_costs()
    for node in graph.nodes:
        meta = node_meta(node)
        if meta.kind in COLLECTIVE_KINDS:
            seconds = collective_seconds(meta.bytes, costs_for(op_arg(node, "group_name")), meta.kind)
        elif meta.kind == "wait":
            seconds = 0.0
        elif meta.agreed_seconds is not None:  # the ranks' largest estimate (see agree_shapes)
            seconds = meta.agreed_seconds
        else:
            seconds = node_seconds(node, costs)
        set_node_meta(node, seconds=seconds)
