"""Backward pass: lower ``compshard::reduce_grad`` to one reduce-scatter per bucket.

Before: ``local = reduce_grad(full_grad, ...)`` per parameter; the bucket plan.
After, per bucket, as soon as the last of its gradients exists (just before the latest
member's marker): a ``pack`` node (``compshard::reduce_scatter_copy_in``: flatten, cast
to the reduce dtype, divide by the world size, zero-pad into the rank-major buffer) and
the ``reduce_scatter_tensor`` start (sum); just before the first use of any member's
result (for gradients that are graph outputs: the end of the graph; the deferral pass
may pull it earlier to bound the bytes in flight): the ``wait_tensor`` and ``unpack``
nodes (``compshard::reduce_scatter_copy_out`` to this rank's rows in the shard dtype,
then a view to the local shape). Replicated (0-d) parameters all-reduce alone; at world
size 1 the gradient is only cast and viewed.

Replica groups (strategies ``"hybrid_shard"`` and ``"no_shard"``): after the
reduce-scatter's wait, the bucket's reduced shard is all-reduced across the replica
group (its own start and wait; the unpack follows that wait). Without sharding (shard
group of one rank) the packed bucket is all-reduced instead of reduce-scattered, started
as soon as it is packed, as DDP does. The divisor is the number of data-parallel ranks.

The arithmetic is the eager op's (divide, then sum over ranks, then cast), so compiled
and eager gradients agree.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from compshard.ops import Layout, ReduceGradArgs, group_size
from compshard.passes.context import PassContext
from compshard.passes.assign_buckets import members_by_bucket
from compshard.passes.fx_utils import (
    aten, c10d, compshard_ops, emit, first_use, is_op, node_order, schedule_meta, sink_before,
)

prims = torch.ops.prims


def _cast_and_view(graph: fx.Graph, value: fx.Node, local: torch.Tensor, meta: dict) -> fx.Node:
    if value.meta["val"].dtype != local.dtype:
        value = emit(graph, prims.convert_element_type.default, (value, local.dtype), meta=meta)
    return emit(graph, aten.view.default, (value, list(local.shape)), meta=meta)


def _lower_alone(graph: fx.Graph, node: fx.Node, label: str) -> None:
    """No communication (cast and view), or a replicated (0-d) parameter: all-reduce the
    average over the shard group, then over the replica group."""
    args = ReduceGradArgs(*node.args)
    grad, param = args.grad, args.param
    groups = [(g, n) for g, n in ((args.group_name, args.world_size), (args.replicate_group,
                                                                        group_size(args.replicate_group))) if n > 1]
    dtype = args.reduce_dtype or grad.meta["val"].dtype
    nbytes = grad.meta["val"].numel() * dtype.itemsize
    meta = lambda kind, suffix="": schedule_meta(  # noqa: E731
        kind, [param], nbytes if kind != "unpack" else 0, label + suffix)
    value = grad
    with graph.inserting_before(node):
        if dtype != value.meta["val"].dtype:
            value = emit(graph, prims.convert_element_type.default, (value, dtype), meta=meta("pack"))
        if groups:
            value = emit(graph, aten.div.Tensor, (value, math.prod(n for _, n in groups)), meta=meta("pack"))
    with graph.inserting_before(first_use(graph, [node])):
        for i, (group_name, _) in enumerate(groups):
            suffix = f".{i}" if i else ""
            start = emit(graph, c10d.all_reduce.default, (value, "sum", group_name), meta=meta("all_reduce", suffix))
            value = emit(graph, c10d.wait_tensor.default, (start,), meta=meta("wait", suffix))
        last = f".{len(groups) - 1}" if len(groups) > 1 else ""  # the unpack follows the last wait
        value = _cast_and_view(graph, value, node.meta["val"], meta("unpack", last))
    node.replace_all_uses_with(value)
    graph.erase_node(node)


def _lower_bucket(graph: fx.Graph, bucket, members: list[fx.Node], label: str) -> None:
    """Reduce-scatter within the shard group (when it has more than one rank), then
    all-reduce across the replica group (when there is one)."""
    first = ReduceGradArgs(*members[0].args)
    world_size, group_name, replicate_group = first.world_size, first.group_name, first.replicate_group
    replicas = group_size(replicate_group)
    names = [m.args[4] for m in members]
    grads = [m.args[0] for m in members]
    dtype = first.reduce_dtype or grads[0].meta["val"].dtype
    shard_numels = [Layout(tuple(m.args[1]), world_size, rank=0).padded_shard_numel for m in members]
    locals_ = [m.meta["val"] for m in members]
    nbytes = world_size * sum(shard_numels) * dtype.itemsize
    reduced_label = label if replicas == 1 else f"{label}.replicas"  # the collective whose result is unpacked

    def meta(kind: str, params: list[str], size: int, collective: str = label) -> dict:
        return {**schedule_meta(kind, params, size, collective), "bucket": bucket.name}

    order = node_order(graph)
    with graph.inserting_before(max(members, key=order.__getitem__)):
        packed = emit(graph, compshard_ops.reduce_scatter_copy_in.default,
                      (grads, shard_numels, world_size, dtype, float(world_size * replicas)),
                      meta=meta("pack", names, nbytes, reduced_label if world_size == 1 else label))
        if world_size > 1:
            start = emit(graph, c10d.reduce_scatter_tensor.default, (packed, "sum", world_size, group_name),
                         meta=meta("reduce_scatter", names, nbytes))
        else:  # no sharding: all-reduce as soon as the bucket is packed
            start = emit(graph, c10d.all_reduce.default, (packed, "sum", replicate_group),
                         meta=meta("all_reduce", names, nbytes, reduced_label))
    # Users of a member placed before the start (views of a local gradient) wait for it.
    order = node_order(graph)
    users = [u for m in members for u in m.users]
    late = [u for u in users if order[u] > order[start]]
    anchor = min(late, key=order.__getitem__) if late else next(iter(graph.find_nodes(op="output")))
    early = [u for u in users if order[u] < order[start]]
    shard_bytes = sum(shard_numels) * dtype.itemsize
    with graph.inserting_before(anchor):
        reduced = emit(graph, c10d.wait_tensor.default, (start,),
                       meta=meta("wait", names, nbytes, label if world_size > 1 else reduced_label))
        if world_size > 1 and replicas > 1:
            across = emit(graph, c10d.all_reduce.default, (reduced, "sum", replicate_group),
                          meta=meta("all_reduce", names, shard_bytes, reduced_label))
            reduced = emit(graph, c10d.wait_tensor.default, (across,), meta=meta("wait", names, shard_bytes,
                                                                                   reduced_label))
        unpacked = emit(graph, compshard_ops.reduce_scatter_copy_out.default,
                        (reduced, shard_numels, [math.prod(v.shape) for v in locals_], locals_[0].dtype),
                        meta=meta("unpack", names, sum(v.numel() for v in locals_) * locals_[0].dtype.itemsize,
                                  reduced_label))
        for i, (member, local) in enumerate(zip(members, locals_)):
            flat = emit(graph, operator.getitem, (unpacked, i), meta=meta("unpack", [names[i]], 0, reduced_label))
            view_meta = meta("unpack", [names[i]], 0, reduced_label)
            member.replace_all_uses_with(_cast_and_view(graph, flat, local, view_meta))
            graph.erase_node(member)
    sink_before(early, anchor)


def lower_reduce_grad(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    bucketed = []
    for index, node in enumerate([n for n in graph.nodes if is_op(n, compshard_ops.reduce_grad.default)]):
        args = ReduceGradArgs(*node.args)
        communicates = args.world_size * group_size(args.replicate_group) > 1
        if not communicates or Layout(tuple(args.full_shape), args.world_size, rank=0).replicated:
            _lower_alone(graph, node, f"{ctx.graph}.reduce.{index}")
        else:
            bucketed.append(node)
    for index, (bucket, members) in enumerate(members_by_bucket(bucketed, ctx)):
        _lower_bucket(graph, bucket, members, f"{ctx.graph}.reduce_scatter.{index}")
