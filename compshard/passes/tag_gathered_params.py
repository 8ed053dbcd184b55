"""Joint-graph pass: decide, per parameter, whether its gathered value is saved for backward.

Takes the bucket plan. A parameter whose bucket is not ``keep_gathered`` (see
``assign_buckets``: every bucket but the one used last in forward, with
``reshard_after_forward=True``) has the whole
chain from the shard to its compute users (``unshard`` and the views and dtype casts
applied to its result, and an offloaded shard's copy to the GPU) tagged
``MUST_RECOMPUTE``, so the partitioner saves only the shard (a graph input) and the
backward graph gathers again. A kept parameter's ``unshard`` output is tagged
``MUST_SAVE``: one gather per step, the full parameter held from forward to backward.

The tags follow the bucket plan, which is the same on every rank.
"""

from __future__ import annotations

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from compshard.compile_plan import BucketPlan
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import aten, compshard_ops, gathered_chain, is_op, unshard_args

__all__ = ["tag_gathered_params"]


def _offload_copies(unshard: fx.Node) -> list[fx.Node]:
    """The copy of an offloaded shard to the GPU feeding ``unshard`` (``offload=True``):
    recomputed in backward like the gather, so no GPU copy of a shard is saved."""
    shard = unshard_args(unshard).shard
    return [shard] if is_op(shard, aten._to_copy.default) else []


def tag_gathered_params(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan) -> None:
    for node in graph.nodes:
        if not is_op(node, compshard_ops.unshard.default):
            continue
        if not buckets.bucket_of(unshard_args(node).param).keep_gathered:
            for member in gathered_chain(node) + _offload_copies(node):
                member.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
