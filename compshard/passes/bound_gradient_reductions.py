"""Backward pass: wait gradient reductions as late as the in-flight bound allows.

Before: every gradient reduction (a bucket's reduce-scatter, and with replicas its
all-reduce) is waited just before its gradients' first use (for gradients that are
graph outputs: at the end), so all of their full-size input buffers could be in flight
at once.
After: walking the starts of one kind in order, when starting one would put more than
``max_inflight_mb`` of that kind in flight, the oldest in-flight ones are waited (their
wait and unpack nodes moved) just before it. Reduce-scatters and all-reduces are bounded
separately. With the default bound and small models nothing moves: waits stay at the
end, as late as possible.

Trade-off: a lower bound frees gradient buffers sooner at the cost of blocking earlier.
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import MiB, node_meta
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import CollectiveGroup, collective_groups, node_order, waited

__all__ = ["bound_gradient_reductions"]


def bound_gradient_reductions(graph: fx.Graph, ctx: PassContext) -> None:
    for kind in ("reduce_scatter", "all_reduce"):
        _bound(graph, kind, ctx.options.max_inflight_mb * MiB)


def _bound(graph: fx.Graph, kind: str, bound: float) -> None:
    started: list[CollectiveGroup] = []
    for group in collective_groups(graph, kind):
        anchor = group.issued
        order = node_order(graph)
        inflight = [g for g in started if order[waited(g)] > order[anchor]]  # waits only ever move up
        nbytes = node_meta(group.start).bytes
        while inflight and sum(node_meta(g.start).bytes for g in inflight) + nbytes > bound:
            for node in [waited(inflight[0]), *inflight[0].unpack]:
                anchor.prepend(node)
            inflight.pop(0)
        started.append(group)
