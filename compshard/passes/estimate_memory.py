"""Analysis pass: estimated bytes live after each node, from the fake tensors.

Counts storages the graph allocates (not its inputs). A storage is live from the node
that creates it until the last use of any alias of it, or its ``free``; storages that
reach the graph outputs stay live to the end. This is what the FX executor does (it
drops each value after its last use), so the estimate tracks the real allocation order.
Writes ``meta["compshard_live_bytes"]`` on every node and the peak into ``ctx.notes``.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import c10d, compshard_ops, is_op, is_view, nbytes, node_order

LIVE_BYTES = "compshard_live_bytes"


def _storage_root(node: fx.Node, roots: dict[fx.Node, fx.Node]) -> fx.Node | None:
    if node.op == "placeholder" or isinstance(node.meta.get("val"), (list, tuple)):
        return None  # inputs are not counted; a multi-output node's getitems are
    if is_view(node) or is_op(node, c10d.wait_tensor.default):
        parent = node.args[0]
        return roots.get(parent) if isinstance(parent, fx.Node) else None
    return node


def estimate_memory(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    order = node_order(graph)
    roots: dict[fx.Node, fx.Node | None] = {}
    release_at: dict[fx.Node, int] = {}  # storage root -> index of the node after which it dies
    outputs: set[fx.Node] = set()
    for node in graph.nodes:
        roots[node] = _storage_root(node, roots)
        root = roots[node]
        if root is None:
            continue
        for user in node.users:
            if user.op == "output":
                outputs.add(root)
            elif is_op(user, compshard_ops.free.default):
                release_at[root] = order[user]
            else:
                release_at[root] = max(release_at.get(root, order[user]), order[user])
    live, peak = 0, 0
    releases: dict[int, list[fx.Node]] = {}
    for root, index in release_at.items():
        if root not in outputs:
            releases.setdefault(index, []).append(root)
    for node in graph.nodes:
        if roots[node] is node:
            live += nbytes(node.meta.get("val"))
        peak = max(peak, live)
        for root in releases.get(order[node], []):
            live -= nbytes(root.meta.get("val"))
        node.meta[LIVE_BYTES] = live
    ctx.notes["peak_bytes"] = peak
