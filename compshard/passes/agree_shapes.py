"""Forward/backward/inference pass, run twice (before and after lowering): plan on shapes every rank shares.

Ranks may hold local batches of different sizes (the last batch of an epoch, a sampler
that does not pad). Their graphs are then the same ops on different activation shapes,
and the estimates that coalescing and prefetch decide from (FLOPs, bytes live) would
differ, and with them the schedules: one rank would wait for a collective that another
issues elsewhere.

Before (``agree_shapes``): each node's ``meta["val"]`` holds this rank's fake tensors.
The ranks exchange the shapes of every node's tensors (size hints, so no guard is
installed) through the process group's c10d store, as the schedule check does. When the
graphs have the same nodes with tensors of the same ranks, every tensor whose shape is
not the elementwise maximum over ranks gets a stand-in fake tensor of that shape for the
memory estimates, so every rank estimates, and so decides, alike. Otherwise nothing
changes (the schedule check then reports any difference).
A rank's own rows (parameter shards, local gradients) differ in shape between ranks by
design; the lowering builds on them, so they keep their values until it is done, and
``agree_lowered_shapes`` then agrees on them too (with the nodes the lowering added),
and on each node's estimated seconds: every node gets the largest of the ranks'
(``NodeMeta.agreed_seconds``, which ``estimate_costs`` takes). Each stand-in keeps this
rank's own value in ``NodeMeta.stashed_val``; the last pass (``restore_shapes``) puts
them back, so the executor and Inductor see this rank's shapes.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor

from compshard.comm.layout import resolve_group
from compshard.comm.rank_exchange import exchange_across_ranks
from compshard.compile_plan import set_node_meta
from compshard.cost_model import costs_for, node_seconds
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import (
    collective_group,
    compshard_ops,
    first_arg,
    is_op,
    is_view,
    reduce_grad_args,
    restore_stashed_vals,
    unshard_args,
)
from compshard.sizes import size_hint

__all__ = ["agree_shapes", "agree_lowered_shapes"]

Shapes = list[tuple[int, ...]] | None  # one node's tensors' shapes (None: it has no tensor)


def _shapes(val: Any) -> Shapes:
    """Shapes (size hints) of the tensors in ``val``, flattened; None if it holds none."""
    leaves = [val] if isinstance(val, torch.Tensor) else torch.utils._pytree.tree_leaves(val)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    return [_shape(t) for t in tensors] if tensors else None


def _shape(tensor: torch.Tensor) -> tuple[int, ...]:
    shape = tuple(tensor.shape)
    return shape if all(type(n) is int for n in shape) else tuple(size_hint(n) for n in shape)


def _group(graph: fx.Graph) -> str:
    for node in graph.nodes:
        if is_op(node, compshard_ops.unshard.default):
            return unshard_args(node).group_name
        if is_op(node, compshard_ops.reduce_grad.default):
            return reduce_grad_args(node).group_name
    return ""


def _agreed(everyone: list[list[Shapes]]) -> list[Shapes] | None:
    """Per node, the elementwise maximum shapes over ranks; None when the graphs differ."""
    mine = everyone[0]
    if all(other == mine for other in everyone[1:]):  # the usual case: nothing to agree on
        return mine
    if any(len(other) != len(mine) for other in everyone):
        return None
    agreed: list[Shapes] = []
    for per_rank in zip(*everyone):
        if any(shapes is None for shapes in per_rank):
            if any(shapes is not None for shapes in per_rank):
                return None
            agreed.append(None)
            continue
        if len({len(shapes) for shapes in per_rank}) != 1 or len({tuple(map(len, s)) for s in per_rank}) != 1:
            return None
        agreed.append([tuple(max(dims) for dims in zip(*tensor_shapes)) for tensor_shapes in zip(*per_rank)])
    return agreed


def _stand_in(val: Any, shapes: list[tuple[int, ...]]) -> Any:
    """``val`` with each tensor replaced by an empty fake tensor of the agreed shape."""
    leaves, spec = torch.utils._pytree.tree_flatten(val)
    remaining = iter(shapes)
    replaced = []
    for leaf in leaves:
        if isinstance(leaf, FakeTensor):
            shape = next(remaining)
            with leaf.fake_mode:
                leaf = torch.empty(shape, dtype=leaf.dtype, device=leaf.device)
        replaced.append(leaf)
    return torch.utils._pytree.tree_unflatten(replaced, spec)


def _local_shard_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes holding a rank's own rows (parameter shards on their way into an ``unshard``,
    local gradients out of a ``reduce_grad``, and their views): their shapes differ
    between ranks by design and the lowering builds on them, so they keep their values."""
    local: set[fx.Node] = set()
    for node in graph.nodes:
        if is_op(node, compshard_ops.unshard.default):
            shard = unshard_args(node).shard
            while isinstance(shard, fx.Node) and shard not in local:
                local.add(shard)
                shard = first_arg(shard) if is_view(shard) and shard.args else None
        elif is_op(node, compshard_ops.reduce_grad.default) or (is_view(node) and first_arg(node) in local):
            local.add(node)
    return local


def _agree(graph: fx.Graph, keep_local: bool) -> None:
    group_name = _group(graph) or collective_group(graph) or ""
    if not (group_name and dist.is_initialized() and dist.get_world_size(resolve_group(group_name)) > 1):
        return
    if dist.get_backend(resolve_group(group_name)) == dist.Backend.FAKE:  # one process stands for every rank
        return
    nodes = list(graph.nodes)
    shapes = [_shapes(node.meta.get("val")) for node in nodes]
    # Seconds only once lowered: nothing before estimate_costs reads them, and it runs after.
    seconds = None if keep_local else [node_seconds(node, costs_for(group_name)) for node in nodes]
    _, everyone = exchange_across_ranks("compshard-shapes", group_name, (shapes, seconds), "a graph with collectives")
    agreed = _agreed([rank_shapes for rank_shapes, _ in everyone])
    if agreed is None:
        return
    if seconds is not None:
        for node, *per_rank in zip(nodes, *(rank_seconds for _, rank_seconds in everyone)):
            set_node_meta(node, agreed_seconds=max(per_rank))
    local = _local_shard_nodes(graph) if keep_local else set()
    for node, own, target in zip(nodes, shapes, agreed):
        if (
            own is not None
            and target is not None
            and own != target
            and node not in local
            and all(
                isinstance(t, FakeTensor)
                for t in torch.utils._pytree.tree_leaves(node.meta["val"])
                if isinstance(t, torch.Tensor)
            )
        ):
            set_node_meta(node, stashed_val=node.meta["val"])
            node.meta["val"] = _stand_in(node.meta["val"], target)


def agree_shapes(graph: fx.Graph, ctx: PassContext) -> None:
    """Before lowering: agree on every node but a rank's own rows (the lowering reads them)."""
    _agree(graph, keep_local=True)


def agree_lowered_shapes(graph: fx.Graph, ctx: PassContext) -> None:
    """After lowering, before the estimates that prefetch and the bounds decide from: agree
    on every node, a rank's own rows (shards, packed and local gradients) included. The
    first agreement's stand-ins are undone first, so the seconds are estimated on this
    rank's own tensors (an op rerun on stand-ins can disagree with its shape arguments)."""
    restore_stashed_vals(graph)
    _agree(graph, keep_local=False)
