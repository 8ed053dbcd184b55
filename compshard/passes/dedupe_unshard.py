"""Dynamo-graph pass: one ``unshard`` per parameter per graph.

Before: each read of a sharded attribute is its own ``compshard::unshard`` call (a module
called twice, or tied weights read from two modules, reads a parameter twice).
After: every later unshard of a parameter is replaced by the first one, so autograd sums
the full gradients of all uses before the single ``reduce_grad`` of that parameter: one
all-gather and one reduce-scatter per parameter per graph. Running before AOTAutograd is
what makes the gradient merge free; the graph is otherwise unchanged.

Only the merged unshard nodes are erased. No dead-code elimination runs here: the Dynamo
graph is not functionalized, and FX counts an in-place call whose result is unused
(``h.mul_(2)``, ``buf.add_(1)``, ``out[:, i].copy_(x)``) as dead, so it would delete
what the program computes. Inputs of an erased unshard that become unused stay; the
functional graphs AOTAutograd builds from this one drop them.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import compshard_ops, is_op, unshard_args

__all__ = ["dedupe_unshard"]


def dedupe_unshard(graph: fx.Graph, ctx: PassContext) -> None:
    first: dict[tuple, fx.Node] = {}
    for node in list(graph.nodes):
        if not is_op(node, compshard_ops.unshard, compshard_ops.unshard.default):  # Dynamo records the packet
            continue
        # Not the shard nor the gradient-sync arguments: only a parameter's first read in a
        # forward folds its accumulated gradient in (see compshard.sharding.grad_sync); the merged
        # reads share it.
        args = unshard_args(node)
        key = (
            tuple(args.full_shape),
            args.world_size,
            args.group_name,
            args.param,
            args.param_dtype,
            args.reduce_dtype,
            args.reshard_after_forward,
            args.replicate_group,
        )
        if key in first:
            node.replace_all_uses_with(first[key])
            graph.erase_node(node)
        else:
            first[key] = node
