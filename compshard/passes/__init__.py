"""The pass pipeline: which graph passes run, on which graph, in what order.

Each pass is ``pass_(gm, ctx) -> None``, rewriting ``gm.graph`` in place, in its own
module whose docstring states what holds before and after it.

  dynamo graph   dedupe_unshard
  joint graph    drop_redundant_clones, assign_buckets, tag_gathered_params, recompute,
                 then the min-cut partitioner
  forward        agree_shapes, coalesce_collectives, lower_unshard, agree_lowered_shapes,
                 estimate_costs, prefetch, insert_free, estimate_memory, check_schedule,
                 restore_shapes
  backward       agree_shapes, coalesce_collectives, lower_unshard, lower_reduce_grad,
                 agree_lowered_shapes, estimate_costs, prefetch, bound_reduce_scatters,
                 insert_free, estimate_memory, check_schedule, restore_shapes
  inference      drop_redundant_clones, assign_buckets (no joint graph is made for
                 inference), then as forward
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

from torch import fx

from compshard.passes.agree_shapes import agree_lowered_shapes, agree_shapes, restore_shapes
from compshard.passes.assign_buckets import assign_buckets
from compshard.passes.bound_reduce_scatters import bound_reduce_scatters
from compshard.passes.check_schedule import ScheduleError, check_schedule
from compshard.passes.coalesce_collectives import coalesce_collectives
from compshard.passes.context import PassContext
from compshard.passes.dedupe_unshard import dedupe_unshard
from compshard.passes.drop_redundant_clones import drop_redundant_clones
from compshard.passes.estimate_costs import estimate_costs
from compshard.passes.estimate_memory import estimate_memory
from compshard.passes.insert_free import insert_free
from compshard.passes.lower_reduce_grad import lower_reduce_grad
from compshard.passes.lower_unshard import lower_unshard
from compshard.passes.prefetch import prefetch
from compshard.passes.recompute import recompute
from compshard.passes.tag_gathered_params import tag_gathered_params

Pass = Callable[[fx.GraphModule, PassContext], None]

PIPELINES: dict[str, Sequence[Pass]] = {
    "dynamo": (dedupe_unshard,),
    "joint": (drop_redundant_clones, assign_buckets, tag_gathered_params, recompute),
    "forward": (agree_shapes, coalesce_collectives, lower_unshard, agree_lowered_shapes, estimate_costs, prefetch,
                insert_free, estimate_memory, check_schedule, restore_shapes),
    "backward": (agree_shapes, coalesce_collectives, lower_unshard, lower_reduce_grad, agree_lowered_shapes,
                 estimate_costs, prefetch, bound_reduce_scatters, insert_free, estimate_memory, check_schedule,
                 restore_shapes),
    "inference": (drop_redundant_clones, assign_buckets, agree_shapes, coalesce_collectives, lower_unshard,
                  agree_lowered_shapes, estimate_costs, prefetch, insert_free, estimate_memory, check_schedule,
                  restore_shapes),
}


def run_passes(gm: fx.GraphModule, ctx: PassContext) -> None:
    """Run the pipeline for ``ctx.graph`` on ``gm``; lint after each pass when ``verify``.

    Records each pass's wall seconds in ``ctx.notes["pass_seconds"]`` (pass name ->
    seconds, in pipeline order) and under ``ctx.shared["pass_seconds"][ctx.graph]``, so
    the report sees the joint graph's passes too."""
    seconds: dict[str, float] = {}
    for pass_ in PIPELINES[ctx.graph]:
        started = time.perf_counter()
        pass_(gm, ctx)
        if ctx.options.verify:
            gm.graph.lint()
        seconds[pass_.__name__] = time.perf_counter() - started
    gm.recompile()
    ctx.notes["pass_seconds"] = seconds
    ctx.shared.setdefault("pass_seconds", {})[ctx.graph] = seconds


__all__ = ["PIPELINES", "PassContext", "ScheduleError", "run_passes"]
