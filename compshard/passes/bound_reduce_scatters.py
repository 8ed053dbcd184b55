"""Backward pass: wait reduce-scatters as late as the in-flight bound allows.

Before: every reduce-scatter is waited just before its gradients' first use (for
gradients that are graph outputs: at the end), so all of their full-size input buffers
could be in flight at once.
After: walking the starts in order, when starting one would put more than
``max_inflight_mb`` of reduce-scatters in flight, the oldest in-flight ones are waited
(their wait and unpack nodes moved) just before it. With the default bound and small
models nothing moves: waits stay at the end, as late as possible.

Gradient all-reduces (strategies with replicas) are bounded the same way, separately.

Trade-off: a lower bound frees gradient buffers sooner at the cost of blocking earlier.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import MB, META_KEY, node_order
from compshard.passes.prefetch import collective_groups


def bound_reduce_scatters(gm: fx.GraphModule, ctx: PassContext) -> None:
    for kind in ("reduce_scatter", "all_reduce"):
        _bound(gm.graph, kind, ctx.options.max_inflight_mb * MB)


def _bound(graph: fx.Graph, kind: str, bound: float) -> None:
    started: list[dict] = []
    for group in collective_groups(graph, kind):
        anchor = group["pack"][0] if group["pack"] else group["start"]
        order = node_order(graph)
        inflight = [g for g in started if order[g["wait"]] > order[anchor]]  # waits only ever move up
        nbytes = group["start"].meta[META_KEY]["bytes"]
        while inflight and sum(g["start"].meta[META_KEY]["bytes"] for g in inflight) + nbytes > bound:
            for node in [inflight[0]["wait"], *inflight[0]["unpack"]]:
                anchor.prepend(node)
            inflight.pop(0)
        started.append(group)
