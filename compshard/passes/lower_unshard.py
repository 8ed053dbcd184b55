"""Forward/backward pass: lower ``compshard::unshard`` to bucketed all-gathers.

Before: ``full = unshard(shard, ...)`` per parameter (marker ops). Takes the bucket plan
(``assign_buckets``) and the coalescing (``coalesce_collectives``; None: one collective
per bucket).
After, for the parameters of each bucket present in this graph (a backward graph
re-gathers only those it needs), one all-gather per collective of the coalescing, at the
first member's place: a ``pack`` node
(``compshard::all_gather_copy_in``: the gather's output buffer with this rank's slot
holding its shards flattened, cast, zero-padded and concatenated) and the in-place start
(the view of that slot and ``all_gather_into_tensor_out``; on gloo
``compshard::gather_rows_``, see ``comm.transport.Transport``); just before the
first use of any member: the ``wait_tensor`` and ``unpack`` nodes
(``compshard::all_gather_copy_out`` into one flat tensor per bucket holding its
parameters back to back, then a slice and view per parameter). The gathered buffer and
each bucket's unpacked tensor carry ``NodeMeta.gathered`` for the free pass: the buffer is released after
the unpack, and each bucket's parameters together after the last use of any of them. A
later pass may move pack and start earlier (prefetch); the wait stays before first use.

World size 1 and replicated (0-d) parameters need no collective: ``full`` is a view of
the (cast) shard, and nothing is inserted for them to free.
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import BucketPlan, Coalescing
from compshard.passes.all_gather_builder import lower_gathers
from compshard.passes.context import PassContext

__all__ = ["lower_unshard"]


def lower_unshard(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan, coalescing: Coalescing | None) -> None:
    lower_gathers(graph, ctx, buckets, coalescing)
