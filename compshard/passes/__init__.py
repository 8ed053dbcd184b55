"""The pass order: which steps run, on which graph, in what order, and what each
takes and returns.

Each step is a plain function ``step(graph, ctx, *plans) -> plan or None`` in its own
module, whose docstring states what holds before and after it. Its parameters after the
graph and the :class:`PassContext` name the plans it takes, fields of
:class:`~compshard.compile_plan.CompilePlan` (``buckets``, ``recompute``,
``saved_count``) or of the graph's :class:`~compshard.compile_plan.GraphPlan`
(``coalescing``, ...); ``provides`` names the field its return value fills. A planning
step leaves the graph unchanged and returns a plan; a rewriting pass takes plans and
returns None.

  dynamo graph   dedupe_unshard
  joint graph    drop_redundant_clones, assign_buckets -> buckets, keep_gathered(buckets) -> buckets,
                 tag_gathered_params(buckets), recompute(buckets) -> recompute; then the partition
                 (``partition.py``: the min-cut partitioner, -> saved_count and the recompute plan's
                 saved bytes)
  forward        agree_shapes, coalesce_collectives(buckets) -> coalescing,
                 lower_unshard(buckets, coalescing), agree_lowered_shapes, estimate_costs,
                 prefetch -> prefetch, insert_free, estimate_memory -> peak_bytes,
                 check_schedule(buckets, saved_count) -> fingerprint, restore_shapes
  backward       as forward, with lower_reduce_grad(buckets, coalescing) after
                 lower_unshard and bound_gradient_reductions after prefetch
  inference      drop_redundant_clones, assign_buckets -> buckets (no joint graph is made
                 for inference), then as forward
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

from torch import fx

from compshard.compile_plan import CompilePlan, GraphKind, GraphPlan
from compshard.passes.agree_shapes import agree_lowered_shapes, agree_shapes
from compshard.passes.assign_buckets import assign_buckets
from compshard.passes.bound_gradient_reductions import bound_gradient_reductions
from compshard.passes.check_schedule import check_schedule
from compshard.passes.coalesce_collectives import coalesce_collectives
from compshard.passes.context import PassContext
from compshard.passes.dedupe_unshard import dedupe_unshard
from compshard.passes.drop_redundant_clones import drop_redundant_clones
from compshard.passes.estimate_costs import estimate_costs
from compshard.passes.estimate_memory import estimate_memory
from compshard.passes.insert_free import insert_free
from compshard.passes.keep_gathered import keep_gathered
from compshard.passes.lower_reduce_grad import lower_reduce_grad
from compshard.passes.lower_unshard import lower_unshard
from compshard.passes.prefetch import prefetch
from compshard.passes.recompute import recompute
from compshard.passes.restore_shapes import restore_shapes
from compshard.passes.tag_gathered_params import tag_gathered_params

__all__ = ["PASS_ORDER", "PassContext", "Step", "run_passes"]

_COMPILE_FIELDS = frozenset(f.name for f in fields(CompilePlan)) - {"number", "graphs"}
_GRAPH_FIELDS = frozenset(f.name for f in fields(GraphPlan)) - {"kind", "pass_seconds"}


@dataclass(frozen=True)
class Step:
    """One step of a pass order: ``run(graph, ctx, **takes)``, whose result fills the plan
    field ``provides`` (None: the step returns nothing)."""

    run: Callable
    provides: str | None = None

    @property
    def name(self) -> str:
        return self.run.__name__

    @functools.cached_property
    def takes(self) -> tuple[str, ...]:
        """The plan fields the step takes: its parameters after ``graph`` and ``ctx``
        (keyword-only ones with defaults are not plans)."""
        parameters = list(inspect.signature(self.run).parameters.values())[2:]
        return tuple(p.name for p in parameters if p.kind is not inspect.Parameter.KEYWORD_ONLY)

    def __post_init__(self) -> None:
        for name in (*self.takes, *([self.provides] if self.provides else [])):
            if name not in _COMPILE_FIELDS | _GRAPH_FIELDS:
                raise TypeError(
                    f"compshard: step {self.name} names {name!r}, which is not a plan field; plan "
                    f"fields are {sorted(_COMPILE_FIELDS | _GRAPH_FIELDS)}"
                )


# A forward graph's steps; an inference graph (no joint graph was made for it) assigns its
# buckets first, then takes the same steps.
_FORWARD = (
    Step(agree_shapes),
    Step(coalesce_collectives, "coalescing"),
    Step(lower_unshard),
    Step(agree_lowered_shapes),
    Step(estimate_costs),
    Step(prefetch, "prefetch"),
    Step(insert_free),
    Step(estimate_memory, "peak_bytes"),
    Step(check_schedule, "fingerprint"),
    Step(restore_shapes),
)

PASS_ORDER: dict[GraphKind, tuple[Step, ...]] = {
    "dynamo": (Step(dedupe_unshard),),
    "joint": (
        Step(drop_redundant_clones),
        Step(assign_buckets, "buckets"),
        Step(keep_gathered, "buckets"),
        Step(tag_gathered_params),
        Step(recompute, "recompute"),
    ),
    "forward": _FORWARD,
    "backward": (
        Step(agree_shapes),
        Step(coalesce_collectives, "coalescing"),
        Step(lower_unshard),
        Step(lower_reduce_grad),
        Step(agree_lowered_shapes),
        Step(estimate_costs),
        Step(prefetch, "prefetch"),
        Step(bound_gradient_reductions),
        Step(insert_free),
        Step(estimate_memory, "peak_bytes"),
        Step(check_schedule, "fingerprint"),
        Step(restore_shapes),
    ),
    "inference": (Step(drop_redundant_clones), Step(assign_buckets, "buckets"), *_FORWARD),
}


def run_passes(gm: fx.GraphModule, ctx: PassContext, plan: CompilePlan) -> CompilePlan:
    """Run the pass order of ``ctx.graph`` on ``gm``; return ``plan`` with what its steps
    decided and this graph's :class:`GraphPlan` appended (with each step's wall seconds).
    Lints the graph after each step when ``verify``."""
    graph_plan = GraphPlan(ctx.graph)
    seconds: dict[str, float] = {}
    for step in PASS_ORDER[ctx.graph]:
        started = time.perf_counter()
        takes = {name: getattr(plan if name in _COMPILE_FIELDS else graph_plan, name) for name in step.takes}
        result = step.run(gm.graph, ctx, **takes)
        if step.provides in _COMPILE_FIELDS:
            plan = replace(plan, **{step.provides: result})
        elif step.provides is not None:
            graph_plan = replace(graph_plan, **{step.provides: result})
        elif result is not None:
            raise TypeError(f"compshard: step {step.name} returned a value but provides no plan field")
        if ctx.options.verify:
            gm.graph.lint()
        seconds[step.name] = time.perf_counter() - started
    gm.recompile()
    return replace(plan, graphs=(*plan.graphs, replace(graph_plan, pass_seconds=tuple(seconds.items()))))
