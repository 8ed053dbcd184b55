"""Analysis pass: estimated seconds of every node, from the cost model.

Writes ``meta["compshard_seconds"]`` (compute nodes: FLOPs and bytes; collective starts:
``alpha + bytes * beta`` of the collective's own process group, twice for an all-reduce)
and ``ctx.notes["costs"]`` (the constants of the graph's first group, which compute is
estimated with). The constants were calibrated when the parameters were sharded and
agreed across ranks (see ``cost_model``), so the decisions made from these estimates are
the same on every rank.
"""

from __future__ import annotations

from torch import fx

from compshard.cost_model import Costs, collective_seconds, costs_for, node_seconds
from compshard.passes.agree_shapes import AGREED_SECONDS
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import COLLECTIVE_KINDS, META_KEY, collective_group

SECONDS = "compshard_seconds"


def estimate_costs(gm: fx.GraphModule, ctx: PassContext) -> None:
    group_name = collective_group(gm.graph)
    costs = costs_for(group_name) if group_name else Costs()
    ctx.notes["costs"] = costs
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if meta and meta["kind"] in COLLECTIVE_KINDS:  # a collective's last argument names its group
            node.meta[SECONDS] = collective_seconds(meta["bytes"], costs_for(node.args[-1]), meta["kind"])
        elif meta and meta["kind"] == "wait":
            node.meta[SECONDS] = 0.0
        elif AGREED_SECONDS in node.meta:  # the ranks' largest estimate (see agree_shapes)
            node.meta[SECONDS] = node.meta[AGREED_SECONDS]
        else:
            node.meta[SECONDS] = node_seconds(node, costs)
