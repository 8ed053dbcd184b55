"""Forward/backward pass: free each gathered parameter right after its last use.

Before: all-gather waits whose buffers live until Python drops the last reference.
After: a ``compshard::free(buffer)`` node directly after the last user of any alias of
each gathered buffer, releasing its storage at that point even if something else still
holds a reference. A buffer with an alias among the graph outputs is left alone: it is
saved for backward (``reshard_after_forward=False``) and autograd releases it after use.
Frees are not inserted for Inductor codegen, which plans buffer lifetimes itself.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import (
    META_KEY, aliases, c10d, compshard_ops, emit, is_op, node_order, schedule_kind, schedule_meta,
)


def gathered_buffers(graph: fx.Graph) -> list[fx.Node]:
    """The ``wait_tensor`` nodes of all-gathers: each one's output is a gathered buffer."""
    return [
        node for node in graph.nodes
        if is_op(node, c10d.wait_tensor.default) and schedule_kind(node.args[0]) == "all_gather"
    ]


def escapes(buffer: fx.Node) -> bool:
    return any(user.op == "output" for alias in aliases(buffer) for user in alias.users)


def insert_free(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.options.codegen == "inductor":
        return
    graph = gm.graph
    order = node_order(graph)
    for buffer in gathered_buffers(graph):
        if escapes(buffer):
            continue
        group = aliases(buffer)
        users = [u for alias in group for u in alias.users if u not in group]
        if not users:
            continue
        last = max(users, key=order.__getitem__)
        meta = buffer.meta[META_KEY]
        with graph.inserting_after(last):
            emit(graph, compshard_ops.free.default, (buffer,),
                 meta=schedule_meta("free", meta["params"], meta["bytes"], meta["collective"]))
