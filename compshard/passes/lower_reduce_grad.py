"""Backward pass: lower ``compshard::reduce_grad`` to an asynchronous reduce-scatter.

Before: ``local = reduce_grad(full_grad, ...)``.
After, at the marker's place (as soon as the full gradient exists): ``pack`` nodes
(flatten, cast to the reduce dtype, zero-pad to ``world_size * L``) and the
``reduce_scatter_tensor`` start (sum); just before the first use of ``local`` (for a
gradient that is a graph output: at the end of the graph, as late as possible): the
``wait_tensor`` and ``unpack`` nodes (this rank's rows, divided by the world size, cast to
the shard dtype, viewed as the local shape). Replicated (0-d) parameters all-reduce.

The arithmetic is the eager op's, in the same order, so compiled and eager gradients agree.
"""

from __future__ import annotations

import torch
from torch import fx

from compshard.ops import Layout
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import aten, c10d, compshard_ops, emit, is_op, node_order, schedule_meta

prims = torch.ops.prims


def lower_reduce_grad(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    for index, node in enumerate([n for n in graph.nodes if is_op(n, compshard_ops.reduce_grad.default)]):
        grad, full_shape, world_size, group_name, param, reduce_dtype, shard_dtype = node.args
        layout = Layout(tuple(full_shape), world_size, rank=0)
        local = node.meta["val"]
        grad_val = grad.meta["val"]
        dtype = reduce_dtype or grad_val.dtype
        label = f"{ctx.graph}.reduce_scatter.{index}"

        def meta(kind: str, nbytes_: int) -> dict:
            return schedule_meta(kind, [param], nbytes_, label)

        with graph.inserting_before(node):
            flat = grad
            if not grad_val.is_contiguous():
                flat = emit(graph, aten.clone.default, (flat,), {"memory_format": torch.contiguous_format},
                            meta=meta("pack", layout.numel * grad_val.dtype.itemsize))
            flat = emit(graph, aten.view.default, (flat, [-1]), meta=meta("pack", 0))
            if dtype != grad_val.dtype:
                flat = emit(graph, prims.convert_element_type.default, (flat, dtype),
                            meta=meta("pack", layout.numel * dtype.itemsize))
            if world_size == 1:
                reduced = flat
            else:
                if layout.replicated:
                    kind, nbytes_ = "all_reduce", dtype.itemsize
                    start = emit(graph, c10d.all_reduce.default, (flat, "sum", group_name), meta=meta(kind, nbytes_))
                else:
                    kind, nbytes_ = "reduce_scatter", world_size * layout.padded_shard_numel * dtype.itemsize
                    padding = world_size * layout.padded_shard_numel - layout.numel
                    if padding:
                        flat = emit(graph, aten.constant_pad_nd.default, (flat, [0, padding], 0.0), meta=meta("pack", nbytes_))
                    start = emit(graph, c10d.reduce_scatter_tensor.default, (flat, "sum", world_size, group_name),
                                 meta=meta(kind, nbytes_))
        with graph.inserting_before(min(node.users, key=node_order(graph).__getitem__)):
            if world_size != 1:
                reduced = emit(graph, c10d.wait_tensor.default, (start,), meta=meta("wait", nbytes_))
                if not layout.replicated:
                    reduced = emit(graph, aten.slice.Tensor, (reduced, 0, 0, local.numel()), meta=meta("unpack", 0))
                reduced = emit(graph, aten.div.Tensor, (reduced, world_size), meta=meta("unpack", local.numel() * dtype.itemsize))
            if local.dtype != dtype:
                reduced = emit(graph, prims.convert_element_type.default, (reduced, local.dtype),
                               meta=meta("unpack", local.numel() * local.dtype.itemsize))
            reduced = emit(graph, aten.view.default, (reduced, list(local.shape)), meta=meta("unpack", 0))
        node.replace_all_uses_with(reduced)
        graph.erase_node(node)
