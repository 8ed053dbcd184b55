"""Joint-graph pass: decide, per parameter, whether its gathered value is saved for backward.

For ``reshard_after_forward=True`` the whole chain from the shard to its compute users
(``unshard`` and the views and dtype casts applied to its result) is tagged
``MUST_RECOMPUTE``, so the partitioner saves only the shard (a graph input) and the
backward graph gathers again. For ``False`` the ``unshard`` output is tagged ``MUST_SAVE``:
one gather per step, the full parameter held from forward to backward.

The tags are decided from the op arguments alone, identically on every rank.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from compshard.passes.context import PassContext
from compshard.passes.fx_utils import aten, compshard_ops, is_op, is_view

_CASTS = (aten._to_copy.default, torch.ops.prims.convert_element_type.default)


def gathered_chain(unshard: fx.Node) -> list[fx.Node]:
    """``unshard`` and the views and casts fed by it alone, transitively."""
    chain, stack = [unshard], [unshard]
    while stack:
        for user in stack.pop().users:
            if user not in chain and (is_view(user) or is_op(user, *_CASTS)) and user.args[0] in chain:
                chain.append(user)
                stack.append(user)
    return chain


def tag_gathered_params(gm: fx.GraphModule, ctx: PassContext) -> None:
    for node in gm.graph.nodes:
        if not is_op(node, compshard_ops.unshard.default):
            continue
        reshard_after_forward = node.args[7]
        if reshard_after_forward:
            for member in gathered_chain(node):
                member.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
