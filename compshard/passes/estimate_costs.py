"""Analysis pass: estimated seconds of every node, from the cost model.

Writes ``meta["compshard_seconds"]`` (compute nodes: FLOPs and bytes; collective starts:
``alpha + bytes * beta``) and ``ctx.notes["costs"]``. The constants were calibrated
when the parameters were sharded and agreed across ranks (see ``cost_model``), so the
decisions made from these estimates are the same on every rank.
"""

from __future__ import annotations

from torch import fx

from compshard.cost_model import Costs, collective_seconds, costs_for, node_seconds
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import META_KEY

SECONDS = "compshard_seconds"
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


def _costs(graph: fx.Graph) -> Costs:
    for node in graph.nodes:
        meta = node.meta.get(META_KEY)
        if meta and meta["kind"] in COLLECTIVES:
            return costs_for(node.args[-1])
    return Costs()


def estimate_costs(gm: fx.GraphModule, ctx: PassContext) -> None:
    costs = _costs(gm.graph)
    ctx.notes["costs"] = costs
    for node in gm.graph.nodes:
        meta = node.meta.get(META_KEY)
        if meta and meta["kind"] in COLLECTIVES:
            node.meta[SECONDS] = collective_seconds(meta["bytes"], costs)
        elif meta and meta["kind"] == "wait":
            node.meta[SECONDS] = 0.0
        else:
            node.meta[SECONDS] = node_seconds(node, costs)
