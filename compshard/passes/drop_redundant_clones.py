"""Joint/inference-graph pass: remove ``aten.clone`` nodes that only copy.

AOTAutograd's functional graphs keep the clones that eager code asks for (``x.clone()``)
and that decompositions insert (``dropout(x, p=0.0)`` in training mode traces to
``clone(x)``). In a functional graph such a clone changes nothing but memory: when both
the original and the copy are needed by backward, the partitioner saves both (on the GPT
with dropout 0, the attention probabilities twice: +1 MiB per layer at batch 4x128).

Before: ``y = clone(x)`` with users of ``y``.
After: those users read ``x``; the clone is gone. A clone is kept when removing it could
be observed: the copy's strides or offset differ from ``x``'s (later views would
read differently); ``x`` is (a view of) a graph input;
``y`` or a view of it is a graph output (AOTAutograd decided output aliasing before this
pass); or an op that mutates in place touches ``x``, ``y`` or a view of either.
"""

from __future__ import annotations

import torch
from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import aliases, aten, first_arg, is_op, is_view

__all__ = ["drop_redundant_clones"]


def _root(node: fx.Node) -> fx.Node:
    while is_view(node):
        node = first_arg(node)
    return node


def _mutated(nodes: list[fx.Node]) -> bool:
    for node in nodes:
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if schema is not None and schema.is_mutable:
                return True
    return False


def _same_strides(clone: fx.Node) -> bool:
    """The copy has the source's strides and offset, so every later view reads the same."""
    copy, source = clone.meta.get("val"), first_arg(clone).meta.get("val")
    if not (isinstance(copy, torch.Tensor) and isinstance(source, torch.Tensor)):
        return False
    return copy.stride() == source.stride() and copy.storage_offset() == source.storage_offset()


def drop_redundant_clones(graph: fx.Graph, ctx: PassContext) -> None:
    for clone in list(graph.nodes):
        if not is_op(clone, aten.clone.default) or not _same_strides(clone):
            continue
        source = first_arg(clone)
        copy_aliases = aliases(clone)
        if _root(source).op == "placeholder" or any(user.op == "output" for n in copy_aliases for user in n.users):
            continue
        if _mutated(copy_aliases + aliases(_root(source))):
            continue
        clone.replace_all_uses_with(source)
        graph.erase_node(clone)
