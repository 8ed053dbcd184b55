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

The arithmetic is the eager op's (divide, then sum over ranks, then cast), so compiled
and eager gradients agree.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx

from compshard.ops import Layout
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
    """World size 1 (cast and view) or a replicated parameter (all-reduce the average)."""
    grad, _, world_size, group_name, param, reduce_dtype, _ = node.args
    dtype = reduce_dtype or grad.meta["val"].dtype
    nbytes = grad.meta["val"].numel() * dtype.itemsize
    meta = lambda kind: schedule_meta(kind, [param], nbytes if kind != "unpack" else 0, label)  # noqa: E731
    value = grad
    with graph.inserting_before(node):
        if dtype != value.meta["val"].dtype:
            value = emit(graph, prims.convert_element_type.default, (value, dtype), meta=meta("pack"))
        if world_size != 1:
            value = emit(graph, aten.div.Tensor, (value, world_size), meta=meta("pack"))
            start = emit(graph, c10d.all_reduce.default, (value, "sum", group_name), meta=meta("all_reduce"))
    with graph.inserting_before(first_use(graph, [node])):
        if world_size != 1:
            value = emit(graph, c10d.wait_tensor.default, (start,), meta=meta("wait"))
        value = _cast_and_view(graph, value, node.meta["val"], meta("unpack"))
    node.replace_all_uses_with(value)
    graph.erase_node(node)


def _lower_bucket(graph: fx.Graph, bucket, members: list[fx.Node], label: str) -> None:
    _, _, world_size, group_name, _, reduce_dtype, _ = members[0].args
    names = [m.args[4] for m in members]
    grads = [m.args[0] for m in members]
    dtype = reduce_dtype or grads[0].meta["val"].dtype
    shard_numels = [Layout(tuple(m.args[1]), world_size, rank=0).padded_shard_numel for m in members]
    locals_ = [m.meta["val"] for m in members]
    nbytes = world_size * sum(shard_numels) * dtype.itemsize

    def meta(kind: str, params: list[str], size: int) -> dict:
        return {**schedule_meta(kind, params, size, label), "bucket": bucket.name}

    order = node_order(graph)
    with graph.inserting_before(max(members, key=order.__getitem__)):
        packed = emit(graph, compshard_ops.reduce_scatter_copy_in.default,
                      (grads, shard_numels, world_size, dtype, float(world_size)), meta=meta("pack", names, nbytes))
        start = emit(graph, c10d.reduce_scatter_tensor.default, (packed, "sum", world_size, group_name),
                     meta=meta("reduce_scatter", names, nbytes))
    # Users of a member placed before the start (views of a local gradient) wait for it.
    order = node_order(graph)
    users = [u for m in members for u in m.users]
    late = [u for u in users if order[u] > order[start]]
    anchor = min(late, key=order.__getitem__) if late else next(iter(graph.find_nodes(op="output")))
    early = [u for u in users if order[u] < order[start]]
    with graph.inserting_before(anchor):
        reduced = emit(graph, c10d.wait_tensor.default, (start,), meta=meta("wait", names, nbytes))
        unpacked = emit(graph, compshard_ops.reduce_scatter_copy_out.default,
                        (reduced, shard_numels, [math.prod(v.shape) for v in locals_], locals_[0].dtype),
                        meta=meta("unpack", names, sum(v.numel() for v in locals_) * locals_[0].dtype.itemsize))
        for i, (member, local) in enumerate(zip(members, locals_)):
            flat = emit(graph, operator.getitem, (unpacked, i), meta=meta("unpack", [names[i]], 0))
            member.replace_all_uses_with(_cast_and_view(graph, flat, local, meta("unpack", [names[i]], 0)))
            graph.erase_node(member)
    sink_before(early, anchor)


def lower_reduce_grad(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    bucketed = []
    for index, node in enumerate([n for n in graph.nodes if is_op(n, compshard_ops.reduce_grad.default)]):
        _, full_shape, world_size, *_ = node.args
        if world_size == 1 or Layout(tuple(full_shape), world_size, rank=0).replicated:
            _lower_alone(graph, node, f"{ctx.graph}.reduce.{index}")
        else:
            bucketed.append(node)
    for index, (bucket, members) in enumerate(members_by_bucket(bucketed, ctx)):
        _lower_bucket(graph, bucket, members, f"{ctx.graph}.reduce_scatter.{index}")
