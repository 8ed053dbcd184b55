"""The lowering behind the reduce-scatters of ``passes/lower_reduce_grad.py``, shared by
that pass and by ``passes/coalesce_collectives.py``, which lowers copies of a graph with
candidate coalescings to measure them (``fake_values``); not a pass itself. The pass's
docstring states what holds before and after.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from compshard.comm.layout import ShardLayout, group_size
from compshard.comm.transport import transport_for
from compshard.compile_plan import Bucket, BucketPlan, Coalescing, NodeMeta, ScheduledKind
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import (
    FakeValues,
    aten,
    c10d,
    collective_members,
    compshard_ops,
    emit,
    emit_view,
    first_arg,
    first_use,
    is_op,
    is_view,
    node_order,
    prims,
    reduce_grad_args,
    sink_before,
)

__all__ = ["reduced_in_bucket", "lower_reductions"]


def _cast_and_view(
    graph: fx.Graph, value: fx.Node, local: torch.Tensor, meta: NodeMeta, fake_values: FakeValues | None
) -> fx.Node:
    if value.meta["val"].dtype != local.dtype:
        value = emit(
            graph, prims.convert_element_type.default, (value, local.dtype), meta=meta, fake_values=fake_values
        )
    return emit_view(graph, value, local.shape, meta, fake_values)


def _lower_alone(graph: fx.Graph, node: fx.Node, label: str, fake_values: FakeValues | None) -> None:
    """No communication (cast and view), or a replicated (0-d) parameter: all-reduce the
    average over the shard group (started at once), then over the replica group."""
    args = reduce_grad_args(node)
    grad, param = args.grad, args.param
    groups = [
        name
        for name, size in ((args.group_name, args.world_size), (args.replicate_group, group_size(args.replicate_group)))
        if size > 1
    ]
    dtype = args.reduce_dtype or grad.meta["val"].dtype
    nbytes = grad.meta["val"].numel() * dtype.itemsize
    labels = [f"{label}.{i}" if i else label for i in range(len(groups))]  # one per collective

    def add(target: Any, node_args: tuple, kind: ScheduledKind, collective: str = label) -> fx.Node:
        meta = NodeMeta(kind, (param,), nbytes if kind != "unpack" else 0, collective)
        return emit(graph, target, node_args, meta=meta, fake_values=fake_values)

    value = grad
    with graph.inserting_before(node):
        if dtype != value.meta["val"].dtype:
            value = add(prims.convert_element_type.default, (value, dtype), "pack")
        if groups:
            total = args.world_size * group_size(args.replicate_group)
            value = add(aten.div.Tensor, (value, total), "pack")
            start = add(c10d.all_reduce.default, (value, "sum", groups[0]), "all_reduce")
    with graph.inserting_before(first_use(graph, [node])):
        for i, collective in enumerate(labels):
            if i:
                start = add(c10d.all_reduce.default, (value, "sum", groups[i]), "all_reduce", collective)
            value = add(c10d.wait_tensor.default, (start,), "wait", collective)
        unpack = NodeMeta("unpack", (param,), 0, labels[-1] if labels else label)
        value = _cast_and_view(graph, value, node.meta["val"], unpack, fake_values)
    node.replace_all_uses_with(value)
    graph.erase_node(node)


def _only_views_to_output(node: fx.Node) -> bool:
    """``node`` is a view whose users are the graph output or such views, transitively."""
    return is_view(node) and all(u.op == "output" or _only_views_to_output(u) for u in node.users)


@dataclass(frozen=True)
class _Handoff:
    """A reduce-scatter followed by an all-reduce across replicas: the reduce-scatter's
    start, its wait with the nodes that finish the reduction, and the all-reduce's start."""

    start: fx.Node
    waited: tuple[fx.Node, ...]
    across: fx.Node


def _lower_collective(
    graph: fx.Graph, group: list[tuple[Bucket, list[fx.Node]]], label: str, fake_values: FakeValues | None
) -> _Handoff | None:
    """Reduce-scatter the buckets of ``group`` (usually one; several when coalesced) within
    the shard group (when it has more than one rank), then all-reduce across the replica
    group (when there is one), which is returned."""
    members = [member for _, bucket_members in group for member in bucket_members]
    bucket_names = tuple(bucket.name for bucket, _ in group)
    first, *_ = member_args = [reduce_grad_args(member) for member in members]
    world_size, group_name, replicate_group = first.world_size, first.group_name, first.replicate_group
    replicas = group_size(replicate_group)
    names = [a.param for a in member_args]
    grads = [a.grad for a in member_args]
    dtype = first.reduce_dtype or first.grad.meta["val"].dtype
    shard_numels = [ShardLayout(tuple(a.full_shape), world_size, rank=0).padded_shard_numel for a in member_args]
    locals_ = [m.meta["val"] for m in members]
    nbytes = world_size * sum(shard_numels) * dtype.itemsize
    exchange = world_size > 1 and transport_for(group_name, first.grad.meta["val"].device).reduce_scatters_by_exchange
    reduced_label = label if replicas == 1 else f"{label}.replicas"  # the collective whose result is unpacked

    def meta(kind: ScheduledKind, params: list[str], size: int, collective: str = label) -> NodeMeta:
        return NodeMeta(kind, tuple(params), int(size), collective, bucket_names)

    def add(target: Any, node_args: tuple, node_meta: NodeMeta) -> fx.Node:
        return emit(graph, target, node_args, meta=node_meta, fake_values=fake_values)

    order = node_order(graph)
    with graph.inserting_before(max(members, key=order.__getitem__)):
        packed = add(
            compshard_ops.reduce_scatter_copy_in.default,
            (grads, shard_numels, world_size, dtype, float(world_size * replicas)),
            meta("pack", names, nbytes, reduced_label if world_size == 1 else label),
        )
        if exchange:
            start = add(
                compshard_ops.exchange_rows_.default,
                (packed, world_size, group_name),
                meta("reduce_scatter", names, nbytes),
            )
        elif world_size > 1:
            start = add(
                c10d.reduce_scatter_tensor.default,
                (packed, "sum", world_size, group_name),
                meta("reduce_scatter", names, nbytes),
            )
        else:  # no sharding: all-reduce as soon as the bucket is packed
            start = add(
                c10d.all_reduce.default,
                (packed, "sum", replicate_group),
                meta("all_reduce", names, nbytes, reduced_label),
            )
    # The wait goes before the first user that computes with a reduced gradient; users
    # that only view it on its way out of the graph, and users placed before the start,
    # move after the wait.
    order = node_order(graph)
    users = [u for m in members for u in m.users]
    computing = [u for u in users if order[u] > order[start] and not _only_views_to_output(u)]
    anchor = min(computing, key=order.__getitem__) if computing else next(iter(graph.find_nodes(op="output")))
    early = [u for u in users if u not in computing and order[u] < order[anchor]]
    shard_bytes = sum(shard_numels) * dtype.itemsize
    with graph.inserting_before(anchor):
        reduced = add(
            c10d.wait_tensor.default, (start,), meta("wait", names, nbytes, label if world_size > 1 else reduced_label)
        )
        waited = [reduced]  # the wait and the nodes that finish the reduction
        if exchange:  # this rank's rows from every rank, summed in rank order: by the unpack itself
            rows_view = add(aten.view.default, (reduced, [world_size, sum(shard_numels)]), meta("unpack", names, 0))
            waited.append(rows_view)
            reduced = rows_view
            if replicas > 1:  # the all-reduce across replicas takes the sum (transport.sum_rows' arithmetic)
                if world_size == 2:
                    rows = [add(aten.select.int, (rows_view, 0, row), meta("unpack", names, 0)) for row in (0, 1)]
                    reduced = add(aten.add.Tensor, tuple(rows), meta("unpack", names, shard_bytes))
                    waited += rows
                else:
                    reduced = add(aten.sum.dim_IntList, (rows_view, [0]), meta("unpack", names, shard_bytes))
                waited.append(reduced)
        handoff = None
        if world_size > 1 and replicas > 1:
            across = add(
                c10d.all_reduce.default,
                (reduced, "sum", replicate_group),
                meta("all_reduce", names, shard_bytes, reduced_label),
            )
            handoff = _Handoff(start, tuple(waited), across)
            reduced = add(c10d.wait_tensor.default, (across,), meta("wait", names, shard_bytes, reduced_label))
        unpacked = add(
            compshard_ops.reduce_scatter_copy_out.default,
            (reduced, shard_numels, [math.prod(v.shape) for v in locals_], locals_[0].dtype),
            meta("unpack", names, sum(v.numel() for v in locals_) * locals_[0].dtype.itemsize, reduced_label),
        )
        for i, (member, local) in enumerate(zip(members, locals_)):
            flat = add(operator.getitem, (unpacked, i), meta("unpack", [names[i]], 0, reduced_label))
            view_meta = meta("unpack", [names[i]], 0, reduced_label)
            member.replace_all_uses_with(_cast_and_view(graph, flat, local, view_meta, fake_values))
            graph.erase_node(member)
    sink_before(early, anchor)
    return handoff


def _hand_off_early(graph: fx.Graph, handoffs: list[_Handoff]) -> None:
    """Wait each reduce-scatter and start its all-reduce across replicas just before the
    next bucket's reduce-scatter is packed, instead of at the end: one bucket of backward
    compute hides the reduce-scatter, the rest of it the all-reduce."""
    order = node_order(graph)
    handoffs = sorted(handoffs, key=lambda h: order[h.start])
    for handoff, following in zip(handoffs, handoffs[1:]):
        next_pack = first_arg(following.start)
        (across_wait,) = handoff.across.users
        if order[across_wait] > order[next_pack]:  # its result is not needed before then
            for node in (*handoff.waited, handoff.across):
                next_pack.prepend(node)


def reduced_in_bucket(reduce_grad: fx.Node) -> bool:
    """Whether the gradient goes through its bucket's collective: it communicates (more
    than one data-parallel rank) and is not replicated (0-d, all-reduced alone)."""
    args = reduce_grad_args(reduce_grad)
    communicates = args.world_size * group_size(args.replicate_group) > 1
    return communicates and not ShardLayout(tuple(args.full_shape), args.world_size, rank=0).replicated


def lower_reductions(
    graph: fx.Graph,
    ctx: PassContext,
    buckets: BucketPlan,
    coalescing: Coalescing | None,
    *,
    fake_values: FakeValues | None = None,
) -> None:
    """``fake_values``: for copies that are only measured (``coalesce_collectives``)."""
    bucketed = []
    for index, node in enumerate([n for n in graph.nodes if is_op(n, compshard_ops.reduce_grad.default)]):
        if reduced_in_bucket(node):
            bucketed.append(node)
        else:
            _lower_alone(graph, node, f"{ctx.graph}.reduce.{index}", fake_values)
    handoffs = [
        _lower_collective(graph, group, f"{ctx.graph}.reduce_scatter.{index}", fake_values)
        for index, group in enumerate(collective_members(bucketed, buckets, coalescing, "reduce_scatter"))
    ]
    _hand_off_early(graph, [h for h in handoffs if h is not None])
