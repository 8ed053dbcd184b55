"""The lowering behind the all-gathers of ``passes/lower_unshard.py``, shared by that
pass and by ``passes/coalesce_collectives.py``, which lowers copies of a graph with
candidate coalescings to measure them (``fake_values``); not a pass itself. The pass's
docstring states what holds before and after.
"""

from __future__ import annotations

import operator
from typing import Any

from torch import fx

from compshard.comm.layout import ShardLayout, resolve_group
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
    first_use,
    held_full,
    hoist_before,
    is_op,
    prims,
    unshard_args,
)

__all__ = ["gathered_remotely", "lower_gathers"]


def _lower_locally(graph: fx.Graph, node: fx.Node, fake_values: FakeValues | None) -> None:
    held = held_full(node)
    if held is not None:  # its value is the full tensor held between steps: read as is
        node.replace_all_uses_with(held)
        graph.erase_node(node)
        return
    args = unshard_args(node)
    shard, full_shape, param = args.shard, args.full_shape, args.param
    dtype = node.meta["val"].dtype
    with graph.inserting_before(node):
        flat = emit(graph, aten.view.default, (shard, [-1]), meta=NodeMeta("pack", (param,)), fake_values=fake_values)
        if dtype != shard.meta["val"].dtype:
            flat = emit(
                graph,
                prims.convert_element_type.default,
                (flat, dtype),
                meta=NodeMeta("pack", (param,), flat.meta["val"].numel() * dtype.itemsize),
                fake_values=fake_values,
            )
        full = emit(
            graph,
            aten.view.default,
            (flat, list(full_shape)),
            meta=NodeMeta("unpack", (param,)),
            fake_values=fake_values,
        )
    node.replace_all_uses_with(full)
    graph.erase_node(node)


def _lower_gather(
    graph: fx.Graph, group: list[tuple[Bucket, list[fx.Node]]], label: str, fake_values: FakeValues | None
) -> None:
    """One all-gather for the buckets of ``group`` (usually one; several when coalesced)."""
    members = [member for _, bucket_members in group for member in bucket_members]
    first, *rest = member_args = [unshard_args(member) for member in members]
    world_size, group_name = first.world_size, first.group_name
    names = [a.param for a in member_args]
    layouts = [ShardLayout(tuple(a.full_shape), world_size, rank=0) for a in member_args]
    shard_numels = [layout.padded_shard_numel for layout in layouts]
    dtype = members[0].meta["val"].dtype
    gathered_bytes = world_size * sum(shard_numels) * dtype.itemsize
    bucket_names = tuple(bucket.name for bucket, _ in group)

    def meta(
        kind: ScheduledKind,
        params: list[str],
        nbytes: int,
        buckets: tuple[str, ...] = bucket_names,
        gathered: bool = False,
    ) -> NodeMeta:
        return NodeMeta(kind, tuple(params), int(nbytes), label, buckets, gathered)

    def add(target: Any, node_args: tuple, node_meta: NodeMeta, kwargs: dict | None = None) -> fx.Node:
        return emit(graph, target, node_args, kwargs, meta=node_meta, fake_values=fake_values)

    for a in rest:
        hoist_before(a.shard, members[0])
    rank = resolve_group(group_name).rank()  # the slot's offset: the one rank-dependent constant
    slot = sum(shard_numels)
    with graph.inserting_before(members[0]):
        buffer = add(
            compshard_ops.all_gather_copy_in.default,
            ([a.shard for a in member_args], shard_numels, dtype, world_size, rank),
            meta("pack", names, gathered_bytes),
        )
        if transport_for(group_name, members[0].meta["val"].device).all_gathers_by_send_recv:
            start = add(
                compshard_ops.gather_rows_.default,
                (buffer, world_size, group_name),
                meta("all_gather", names, gathered_bytes),
            )
        else:
            packed = add(aten.slice.Tensor, (buffer, 0, rank * slot, (rank + 1) * slot), meta("pack", names, 0))
            start = add(
                c10d.all_gather_into_tensor_out.default,
                (packed, world_size, group_name),
                meta("all_gather", names, gathered_bytes),
                {"out": buffer},
            )
    with graph.inserting_before(first_use(graph, members)):
        buffer = add(c10d.wait_tensor.default, (start,), meta("wait", names, gathered_bytes, gathered=True))
        numels = [layout.numel for layout in layouts]
        splits = [len(bucket_members) for _, bucket_members in group]
        unpacked = add(
            compshard_ops.all_gather_copy_out.default,
            (buffer, shard_numels, numels, world_size, splits),
            meta("unpack", names, sum(numels) * dtype.itemsize),
        )
        index = 0
        for j, (bucket, bucket_members) in enumerate(group):
            bucket_params = names[index : index + len(bucket_members)]
            bucket_numels = numels[index : index + len(bucket_members)]
            flat = add(
                operator.getitem,
                (unpacked, j),
                meta("unpack", bucket_params, sum(bucket_numels) * dtype.itemsize, (bucket.name,), gathered=True),
            )
            offset = 0
            for member, layout, name in zip(bucket_members, layouts[index:], bucket_params):
                piece = add(
                    aten.slice.Tensor,
                    (flat, 0, offset, offset + layout.numel),
                    meta("unpack", [name], 0, (bucket.name,)),
                )
                full = emit_view(
                    graph, piece, layout.full_shape, meta("unpack", [name], 0, (bucket.name,)), fake_values
                )
                member.replace_all_uses_with(full)
                graph.erase_node(member)
                offset += layout.numel
            index += len(bucket_members)


def gathered_remotely(unshard: fx.Node) -> bool:
    """Whether ``unshard`` needs an all-gather: not at world size 1, not replicated (0-d),
    not held between steps (``shard_optimizer``)."""
    args = unshard_args(unshard)
    return (
        held_full(unshard) is None
        and args.world_size > 1
        and not ShardLayout(tuple(args.full_shape), args.world_size, rank=0).replicated
    )


def lower_gathers(
    graph: fx.Graph,
    ctx: PassContext,
    buckets: BucketPlan,
    coalescing: Coalescing | None,
    *,
    fake_values: FakeValues | None = None,
) -> None:
    """``fake_values``: for copies that are only measured (``coalesce_collectives``)."""
    remote = []
    for node in [n for n in graph.nodes if is_op(n, compshard_ops.unshard.default)]:
        if gathered_remotely(node):
            remote.append(node)
        else:
            _lower_locally(graph, node, fake_values)
    for index, group in enumerate(collective_members(remote, buckets, coalescing, "all_gather")):
        _lower_gather(graph, group, f"{ctx.graph}.all_gather.{index}", fake_values)
