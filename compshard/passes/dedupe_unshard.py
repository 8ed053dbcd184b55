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
from compshard.passes.fx_utils import compshard_ops, is_op


def dedupe_unshard(gm: fx.GraphModule, ctx: PassContext) -> None:
    first: dict[tuple, fx.Node] = {}
    for node in list(gm.graph.nodes):
        if not is_op(node, compshard_ops.unshard, compshard_ops.unshard.default):  # Dynamo records the packet
            continue
        # Not the gradient-sync arguments: only a parameter's first read in a forward folds
        # its accumulated gradient in (see compshard.grad_sync); the merged reads share it.
        key = tuple(tuple(a) if isinstance(a, list) else a for a in node.args[1:-2])
        if key in first:
            node.replace_all_uses_with(first[key])
            gm.graph.erase_node(node)
        else:
            first[key] = node
