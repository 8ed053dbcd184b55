"""Backward pass: lower ``compshard::reduce_grad`` to bucketed reduce-scatters.

Before: ``local = reduce_grad(full_grad, ...)`` per parameter. Takes the bucket plan and
the coalescing (``coalesce_collectives``; None: one collective per bucket).
After, per collective of the coalescing, as soon as the last of its gradients exists
(just before the latest member's marker): a ``pack`` node
(``compshard::reduce_scatter_copy_in``: flatten, cast to the reduce dtype, divide by the
world size, zero-pad into the rank-major buffer) and the ``reduce_scatter_tensor`` start
(sum; on gloo an all-to-all of the buffer in place, ``compshard::exchange_rows_``,
whose received rows the unpack sums as it unpacks, or a sum node first where an
all-reduce across replicas follows: see ``comm.transport.Transport`` and
``comm.transport.sum_rows``); just before the first use of
any member's result that computes with it (for gradients that only leave the graph,
through views or not: the end of the graph; the deferral pass may pull it earlier to
bound the bytes in flight): the ``wait_tensor`` and ``unpack`` nodes
(``compshard::reduce_scatter_copy_out`` to this rank's rows in the shard dtype, then a
view to the local shape). Replicated (0-d) parameters all-reduce alone; at world
size 1 the gradient is only cast and viewed.

Replica groups (strategies ``"hybrid_shard"`` and ``"no_shard"``): after the
reduce-scatter's wait, the bucket's reduced shard is all-reduced across the replica
group (its own start and wait; the unpack follows that wait); that wait and start sit
just before the next bucket's reduce-scatter is packed, so the all-reduce overlaps the
rest of backward. Without sharding (shard group of one rank) the packed bucket is
all-reduced instead of reduce-scattered, started as soon as it is packed, as DDP does.
The divisor is the number of data-parallel ranks.

The arithmetic is the eager op's (divide, then sum over ranks, then cast), so compiled
and eager gradients agree.
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import BucketPlan, Coalescing
from compshard.passes.context import PassContext
from compshard.passes.reduce_scatter_builder import lower_reductions

__all__ = ["lower_reduce_grad"]


def lower_reduce_grad(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan, coalescing: Coalescing | None) -> None:
    lower_reductions(graph, ctx, buckets, coalescing)
