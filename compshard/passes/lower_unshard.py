"""Forward/backward pass: lower ``compshard::unshard`` to bucketed all-gathers.

Before: ``full = unshard(shard, ...)`` per parameter (marker ops); the bucket plan in
``ctx.shared`` (see ``assign_buckets``).
After, for the parameters of each bucket present in this graph (a backward graph
re-gathers only those it needs), one all-gather per collective of the plan
(``ctx.notes["coalesced"]["all_gather"]`` from ``coalesce_collectives``; one bucket
each without it), at the first member's place: a ``pack`` node
(``compshard::all_gather_copy_in``: the gather's output buffer with this rank's slot
holding its shards flattened, cast, zero-padded and concatenated), the view of that slot,
and the in-place ``all_gather_into_tensor_out`` start; just before the first use of any
member: the ``wait_tensor`` and ``unpack`` nodes (``compshard::all_gather_copy_out`` into
one flat tensor per bucket holding its parameters back to back, then a slice and view per
parameter). The gathered buffer and each bucket's unpacked tensor carry
``meta["compshard"]["gathered"] = True`` for the free pass: the buffer is released after
the unpack, and each bucket's parameters together after the last use of any of them. A
later pass may move pack and start earlier (prefetch); the wait stays before first use.

World size 1 and replicated (0-d) parameters need no collective: ``full`` is a view of
the (cast) shard, and nothing is inserted for them to free.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from compshard.ops import Layout, UnshardArgs
from compshard.passes.context import PassContext
from compshard.passes.assign_buckets import Bucket, collective_members
from compshard.passes.fx_utils import aten, c10d, compshard_ops, emit, first_use, hoist_before, is_op, schedule_meta

prims = torch.ops.prims


def _lower_locally(graph: fx.Graph, node: fx.Node) -> None:
    args = UnshardArgs(*node.args)
    shard, full_shape, param = args.shard, args.full_shape, args.param
    dtype = node.meta["val"].dtype
    with graph.inserting_before(node):
        flat = emit(graph, aten.view.default, (shard, [-1]), meta=schedule_meta("pack", [param], 0))
        if dtype != shard.meta["val"].dtype:
            flat = emit(graph, prims.convert_element_type.default, (flat, dtype),
                        meta=schedule_meta("pack", [param], flat.meta["val"].numel() * dtype.itemsize))
        full = emit(graph, aten.view.default, (flat, list(full_shape)), meta=schedule_meta("unpack", [param], 0))
    node.replace_all_uses_with(full)
    graph.erase_node(node)


def _lower_gather(graph: fx.Graph, group: list[tuple[Bucket, list[fx.Node]]], label: str) -> None:
    """One all-gather for the buckets of ``group`` (usually one; several when coalesced)."""
    members = [member for _, bucket_members in group for member in bucket_members]
    first = UnshardArgs(*members[0].args)
    world_size, group_name = first.world_size, first.group_name
    names = [m.args[4] for m in members]
    layouts = [Layout(tuple(m.args[1]), world_size, rank=0) for m in members]
    shard_numels = [layout.padded_shard_numel for layout in layouts]
    dtype = members[0].meta["val"].dtype
    gathered_bytes = world_size * sum(shard_numels) * dtype.itemsize
    bucket_names = [bucket.name for bucket, _ in group]

    def meta(kind: str, params: list[str], nbytes: int, buckets: list[str] = bucket_names, **extra) -> dict:
        return {**schedule_meta(kind, params, nbytes, label), "bucket": "+".join(buckets), "buckets": buckets,
                **extra}

    for member in members[1:]:
        hoist_before(member.args[0], members[0])
    rank = _resolve_process_group(group_name).rank()  # the slot's offset: the one rank-dependent constant
    slot = sum(shard_numels)
    with graph.inserting_before(members[0]):
        buffer = emit(graph, compshard_ops.all_gather_copy_in.default,
                      ([m.args[0] for m in members], shard_numels, dtype, world_size, rank),
                      meta=meta("pack", names, gathered_bytes))
        packed = emit(graph, aten.slice.Tensor, (buffer, 0, rank * slot, (rank + 1) * slot), meta=meta("pack", names, 0))
        start = emit(graph, c10d.all_gather_into_tensor_out.default, (packed, world_size, group_name), {"out": buffer},
                     meta=meta("all_gather", names, gathered_bytes))
    with graph.inserting_before(first_use(graph, members)):
        buffer = emit(graph, c10d.wait_tensor.default, (start,), meta=meta("wait", names, gathered_bytes, gathered=True))
        numels = [layout.numel for layout in layouts]
        splits = [len(bucket_members) for _, bucket_members in group]
        unpacked = emit(graph, compshard_ops.all_gather_copy_out.default,
                        (buffer, shard_numels, numels, world_size, splits),
                        meta=meta("unpack", names, sum(numels) * dtype.itemsize))
        index = 0
        for j, (bucket, bucket_members) in enumerate(group):
            bucket_params = names[index:index + len(bucket_members)]
            bucket_numels = numels[index:index + len(bucket_members)]
            flat = emit(graph, operator.getitem, (unpacked, j),
                        meta=meta("unpack", bucket_params, sum(bucket_numels) * dtype.itemsize, [bucket.name],
                                  gathered=True))
            offset = 0
            for member, layout, name in zip(bucket_members, layouts[index:], bucket_params):
                piece = emit(graph, aten.slice.Tensor, (flat, 0, offset, offset + layout.numel),
                             meta=meta("unpack", [name], 0, [bucket.name]))
                full = emit(graph, aten.view.default, (piece, list(layout.full_shape)),
                            meta=meta("unpack", [name], 0, [bucket.name]))
                member.replace_all_uses_with(full)
                graph.erase_node(member)
                offset += layout.numel
            index += len(bucket_members)


def gathered_remotely(unshard: fx.Node) -> bool:
    """Whether ``unshard`` needs an all-gather: not at world size 1, not replicated (0-d)."""
    args = UnshardArgs(*unshard.args)
    return args.world_size > 1 and not Layout(tuple(args.full_shape), args.world_size, rank=0).replicated


def lower_gathers(graph: fx.Graph, ctx: PassContext) -> None:
    """The pass on a bare graph (``coalesce_collectives`` lowers copies to compare plans)."""
    remote = []
    for node in [n for n in graph.nodes if is_op(n, compshard_ops.unshard.default)]:
        if gathered_remotely(node):
            remote.append(node)
        else:
            _lower_locally(graph, node)
    for index, group in enumerate(collective_members(remote, ctx, "all_gather")):
        _lower_gather(graph, group, f"{ctx.graph}.all_gather.{index}")


def lower_unshard(gm: fx.GraphModule, ctx: PassContext) -> None:
    lower_gathers(gm.graph, ctx)
