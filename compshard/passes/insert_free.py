"""Forward/backward pass: free each gathered buffer and bucket right after its last use.

Before: gathered values (nodes marked ``NodeMeta.gathered``: a bucket's all-gather output
and the flat tensor its parameters are unpacked into) live until Python drops the last
reference.
After: a ``compshard::free(value)`` node directly after the last user of any alias of
each one, releasing its storage at that point even if something else still holds a
reference (a collective of the program that reads it, tensor parallelism's, uses it
until its wait). A value with an alias among the graph outputs is left alone: it is saved for
backward (a kept bucket) and autograd releases it after use. Both codegens run the
frees (Inductor compiles only the compute between scheduled nodes).
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import Freed, NodeMeta, node_meta
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import aliases, compshard_ops, emit, escapes, gathered_buffers, node_order, reads_until

__all__ = ["insert_free"]


def insert_free(graph: fx.Graph, ctx: PassContext) -> None:
    order = node_order(graph)
    for buffer in gathered_buffers(graph):
        if escapes(buffer):
            continue
        group = aliases(buffer)
        users = [end for alias in group for u in alias.users if u not in group for end in reads_until(u)]
        if not users:
            continue
        last = max(users, key=order.__getitem__)
        meta = node_meta(buffer)
        with graph.inserting_after(last):
            freed: Freed = "buffer" if meta.kind == "wait" else "params"
            emit(
                graph,
                compshard_ops.free.default,
                (buffer,),
                meta=NodeMeta("free", meta.params, meta.bytes, meta.collective, freed=freed),
            )
