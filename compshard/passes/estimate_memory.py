"""Analysis pass: estimated bytes live after each node (``compshard.passes.memory_model``).

Before: the scheduled graph. After (graph unchanged): every node's
``NodeMeta.live_bytes`` (after it runs); returns the graph's estimated peak (bytes live
while a node runs, at the largest), which the report and the logs show. Inputs are
counted in backward graphs only: the saved activations the boxed executor releases after
their last use; forward and inference inputs are held by the caller.
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import set_node_meta
from compshard.passes.context import PassContext
from compshard.passes.memory_model import live_bytes

__all__ = ["estimate_memory"]


def estimate_memory(graph: fx.Graph, ctx: PassContext) -> int:
    during, after = live_bytes(graph, count_inputs=ctx.graph == "backward")
    for node, nbytes_live in after.items():
        set_node_meta(node, live_bytes=nbytes_live)
    return max(during.values(), default=0)
