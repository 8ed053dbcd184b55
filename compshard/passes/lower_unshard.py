"""Forward/backward pass: lower ``compshard::unshard`` to an asynchronous all-gather.

Before: ``full = unshard(shard, ...)`` (a marker op).
After, at the marker's place: ``pack`` nodes (flatten, cast to the compute dtype, zero-pad
to the padded shard length ``L``) and the ``all_gather_into_tensor`` start; just before
the first use of ``full``: its ``wait_tensor`` and ``unpack`` nodes (drop the padding,
view as the full shape). A later pass may move the start earlier (prefetch); the wait
stays just before first use, so every use is after its wait.

World size 1 and replicated (0-d) parameters need no collective: ``full`` is a view of
the (cast) shard, and nothing is inserted for them to free.
"""

from __future__ import annotations

import torch
from torch import fx

from compshard.ops import Layout
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import aten, c10d, compshard_ops, emit, is_op, nbytes, node_order, schedule_meta

prims = torch.ops.prims


def lower_unshard(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for index, node in enumerate([n for n in graph.nodes if is_op(n, compshard_ops.unshard.default)]):
        shard, full_shape, world_size, group_name, param, param_dtype, _, reshard_after_forward = node.args
        ctx.notes.setdefault("reshard", {})[param] = reshard_after_forward
        layout = Layout(tuple(full_shape), world_size, rank=0)
        local_numel = shard.meta["val"].numel()
        dtype = node.meta["val"].dtype
        label = f"{ctx.graph}.all_gather.{index}"

        def meta(kind: str, nbytes_: int) -> dict:
            return schedule_meta(kind, [param], nbytes_, label)

        with graph.inserting_before(node):
            flat = emit(graph, aten.view.default, (shard, [-1]), meta=meta("pack", local_numel * dtype.itemsize))
            if dtype != shard.meta["val"].dtype:
                flat = emit(graph, prims.convert_element_type.default, (flat, dtype), meta=meta("pack", nbytes(flat.meta["val"])))
            if world_size == 1 or layout.replicated:
                full = emit(graph, aten.view.default, (flat, list(full_shape)), meta=meta("unpack", 0))
                node.replace_all_uses_with(full)
                graph.erase_node(node)
                continue
            padded_numel = layout.padded_shard_numel
            if local_numel < padded_numel:
                flat = emit(graph, aten.constant_pad_nd.default, (flat, [0, padded_numel - local_numel], 0.0),
                            meta=meta("pack", padded_numel * dtype.itemsize))
            gathered_bytes = world_size * padded_numel * dtype.itemsize
            start = emit(graph, c10d.all_gather_into_tensor.default, (flat, world_size, group_name),
                         meta=meta("all_gather", gathered_bytes))
        first_use = min(node.users, key=node_order(graph).__getitem__)
        with graph.inserting_before(first_use):
            full = emit(graph, c10d.wait_tensor.default, (start,), meta=meta("wait", gathered_bytes))
            if layout.numel < world_size * padded_numel:
                full = emit(graph, aten.slice.Tensor, (full, 0, 0, layout.numel), meta=meta("unpack", 0))
            full = emit(graph, aten.view.default, (full, list(full_shape)), meta=meta("unpack", 0))
        node.replace_all_uses_with(full)
        graph.erase_node(node)
