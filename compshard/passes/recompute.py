"""Joint-graph pass: the activation recompute (checkpointing) policy, as partitioner tags.

Before: the joint graph, gathered-parameter chains tagged by ``tag_gathered_params``.
After: the forward nodes the policy decides on carry ``meta["recompute"]``: ``MUST_SAVE``
(kept from forward to backward when the backward needs it) or ``MUST_RECOMPUTE`` (run
again in the backward), so the min-cut partitioner produces the policy; returns the plan
(:class:`~compshard.compile_plan.RecomputePlan`), which the partition
(``passes/partition.py``) completes with what the forward really saves.

Policies (``options.recompute``), on the repeated blocks of the module tree (``blocks.3``:
the blocks ``assign_buckets`` buckets by, found from ``nn_module_stack``):

- ``"none"``: no tag; the partitioner's own heuristics choose (the default).
- ``"full"``: a block keeps only its inputs and outputs; everything else its backward
  needs is recomputed from them. Least memory, one more forward of every block.
- ``"selective"``: a block also keeps the outputs of compute-intensive ops (matmuls,
  attention, convolution); pointwise, normalization, copy and view ops are recomputed.
  Most of ``"full"``'s saving on wide models at a fraction of its recompute FLOPs.
- ``{"budget_mb": X}``: the whole forward. Every block starts at "save everything the
  backward needs" (no recompute), as does the code outside blocks; while the planned
  saved activations exceed X MiB, one block is raised (to selective or to full): the
  raise that makes the plan fit at the least added recompute seconds if there is one,
  else the one freeing the most bytes per second of recompute (``cost_model``, the
  agreed constants). Where even every block at full does not fit, the note says so, a
  warning is issued and that plan is used.

Only nodes the backward needs (directly, or through other recomputed nodes) are tagged
``MUST_RECOMPUTE``: the partitioner saves the inputs of every ``MUST_RECOMPUTE`` node,
needed or not. Earlier tags (gathered parameters) are kept.

Random ops (dropout) are never recomputed: their outputs (for dropout, the output and the
mask) are saved, so the backward sees exactly the forward's values under every policy.
Replaying them instead (the partitioner's RNG functionalization, which saves the
generator state) would keep less, but on CPU it gives the saved state a symbolic size
that the later passes cannot price. Views are always recomputed (free; saving one would
keep its base alive).

Decisions use only the graph, the module tree, the options and the agreed cost
constants, so every rank tags the same nodes.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from compshard.compile_plan import BucketPlan, MiB, RecomputePlan
from compshard.logs import warn
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import is_view, producer
from compshard.passes.recompute_model import SavePlan, budget_levels, option_levels, policy_for

__all__ = ["recompute"]


def _tag(plan: SavePlan, save_outside_inputs: bool) -> None:
    """Tag the plan; tags set by earlier passes win."""
    for node in plan.recomputed:
        node.meta.setdefault("recompute", CheckpointPolicy.MUST_RECOMPUTE)
    inputs = [n for n in plan.outside_inputs if not is_view(producer(n))] if save_outside_inputs else []
    for node in plan.saved + inputs:
        producer(node).meta.setdefault("recompute", CheckpointPolicy.MUST_SAVE)


def recompute(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan) -> RecomputePlan:
    option = ctx.options.recompute
    chosen = buckets.budget.levels if option == "none" and buckets.budget is not None else {}
    if option == "none" and not chosen:
        return RecomputePlan("none")
    policy = policy_for(graph)
    if chosen:  # raised by memory_budget_mb="auto"; its other blocks are the partitioner's
        levels = dict(chosen)  # the plan's own dict, not the budget's
        plan = policy.plan(levels, None)
        budget_bytes, fits, policy_name = None, True, "auto"
    elif isinstance(option, Mapping):
        budget_bytes = int(option["budget_mb"] * MiB)
        levels, plan = budget_levels(policy, budget_bytes)
        fits = plan.saved_bytes <= budget_bytes
        if not fits:
            warn(
                f"compshard: recompute budget_mb={option['budget_mb']} (MiB) cannot be met: the least this graph "
                f"saves is {plan.saved_bytes / MiB:.3f} MiB of activations per rank (blocks: "
                f"{', '.join(level.label for level in levels.values()) or 'none found'}); using that"
            )
        policy_name = "budget"
    else:
        levels, _ = option_levels(policy, option)
        plan = policy.plan(levels, None)
        budget_bytes, fits, policy_name = None, True, option
    _tag(plan, save_outside_inputs=not isinstance(option, Mapping))
    return RecomputePlan(
        policy_name,
        budget_bytes=budget_bytes,
        planned_bytes=plan.saved_bytes,
        recompute_seconds=plan.recompute_seconds,
        fits=fits,
        levels=levels,
    )
