"""Forward/backward/inference pass: let neighbouring buckets share one collective.

Before: ``unshard`` / ``reduce_grad`` markers and the bucket plan (one collective per
bucket). After (graph unchanged): ``ctx.notes["coalesced"]``, for ``"all_gather"`` and
(backward) ``"reduce_scatter"``, the buckets of this graph as lists of names, one list per
collective, which the lowering passes follow.

Why: every collective has a fixed cost, its latency and the rendezvous of all ranks (on
a shared CPU, where communication cannot hide behind compute, this dominates: one
all-gather for the whole GPT of the benchmark steps faster than one per block). Buckets
stay the unit of memory: each bucket is still unpacked into its own tensor and released
after its own last use, so only the transfer is shared.

Rule (``options.coalesce == "auto"``), greedy in the order the collectives are needed
(all-gathers by first use, reduce-scatters by when their last gradient exists): the next
bucket joins the current collective when both have the same collective key (process
group, dtypes), the joined bytes fit ``bucket_mb`` and ``max_inflight_mb``, and the
graph's estimated peak (``estimate_memory.live_bytes`` of a copy lowered with the
candidate plan, every all-gather starting at its wait as ``prefetch`` leaves them before
it moves them) is no higher than with one collective per bucket. In backward the
all-gathers are decided first, then the reduce-scatters with them.

Trade-off: a joined all-gather brings the later bucket's parameters in with the earlier
one (held sooner, and not overlapped with the earlier bucket's compute); a joined
reduce-scatter holds the earlier bucket's gradients until the later ones exist. The
peak bound keeps both under what per-bucket collectives need; ``bucket_mb`` caps what
one transfer may cost in lost overlap. ``"none"``: one collective per bucket.
"""

from __future__ import annotations

from torch import fx

from compshard.ops import ReduceGradArgs, UnshardArgs
from compshard.passes.assign_buckets import Bucket, members_by_bucket
from compshard.passes.context import PassContext
from compshard.passes.estimate_memory import live_bytes
from compshard.passes.fx_utils import MB, compshard_ops, is_op, node_order, reuse_emitted_values
from compshard.passes.lower_reduce_grad import lower_reduce_grads, reduced_in_bucket
from compshard.passes.lower_unshard import gathered_remotely, lower_gathers
from compshard.passes.prefetch import start_gathers_at_waits


def _copy(graph: fx.Graph) -> fx.Graph:
    copied = fx.Graph()
    copied.output(copied.graph_copy(graph, {}))
    return copied


def _estimated_peak(graph: fx.Graph, ctx: PassContext, plan: dict[str, list[list[str]]]) -> int:
    """The peak bytes of ``graph`` lowered with ``plan``, every all-gather started at its wait."""
    trial = _copy(graph)
    trial_ctx = PassContext(ctx.options, ctx.graph, shared=ctx.shared, notes={"coalesced": plan})
    with reuse_emitted_values():  # the trial is only measured: the same op on the same shapes is traced once
        lower_gathers(trial, trial_ctx)
        if ctx.graph == "backward":
            lower_reduce_grads(trial, trial_ctx)
    start_gathers_at_waits(trial)
    return max(live_bytes(trial, count_inputs=ctx.graph == "backward")[0].values(), default=0)


def _key(marker: fx.Node) -> tuple:
    """What buckets sharing a collective must agree on: group, world size and dtypes
    (and, for gradients, the replica group and the shard dtype they are unpacked to)."""
    if is_op(marker, compshard_ops.unshard.default):
        args = UnshardArgs(*marker.args)
        return args.group_name, args.world_size, marker.meta["val"].dtype
    args = ReduceGradArgs(*marker.args)
    return args.group_name, args.world_size, args.reduce_dtype, args.replicate_group, marker.meta["val"].dtype


def _buckets_in_need_order(graph: fx.Graph, ctx: PassContext, kind: str) -> list[tuple[Bucket, list[fx.Node]]]:
    """The buckets with a collective of ``kind`` here: all-gathers by their first use,
    reduce-scatters by their last gradient."""
    order = node_order(graph)
    if kind == "all_gather":
        markers = [n for n in graph.nodes if is_op(n, compshard_ops.unshard.default) and gathered_remotely(n)]
        return sorted(members_by_bucket(markers, ctx),
                      key=lambda pair: min(order[user] for member in pair[1] for user in member.users))
    markers = [n for n in graph.nodes if is_op(n, compshard_ops.reduce_grad.default) and reduced_in_bucket(n)]
    return sorted(members_by_bucket(markers, ctx), key=lambda pair: max(order[member] for member in pair[1]))


def _names(collectives: list[list[tuple[Bucket, list[fx.Node]]]]) -> list[list[str]]:
    return [[bucket.name for bucket, _ in collective] for collective in collectives]


def coalesce_collectives(gm: fx.GraphModule, ctx: PassContext) -> None:
    if ctx.options.coalesce == "none":
        return
    graph = gm.graph
    kinds = ("all_gather", "reduce_scatter") if ctx.graph == "backward" else ("all_gather",)
    buckets = {kind: _buckets_in_need_order(graph, ctx, kind) for kind in kinds}
    plan = {kind: _names([[pair] for pair in pairs]) for kind, pairs in buckets.items()}
    if all(len(pairs) < 2 for pairs in buckets.values()):
        return
    bound = _estimated_peak(graph, ctx, plan)
    cap = min(ctx.options.bucket_mb, ctx.options.max_inflight_mb) * MB
    for kind, pairs in buckets.items():  # all-gathers first: the reduce-scatters are tried with them
        collectives: list[list[tuple[Bucket, list[fx.Node]]]] = []
        for k, pair in enumerate(pairs):
            if collectives and _key(collectives[-1][0][1][0]) == _key(pair[1][0]) \
                    and sum(bucket.nbytes for bucket, _ in collectives[-1]) + pair[0].nbytes <= cap:
                joined = [*collectives[:-1], [*collectives[-1], pair]]
                alone_after = [[later] for later in pairs[k + 1:]]
                if _estimated_peak(graph, ctx, {**plan, kind: _names(joined + alone_after)}) <= bound:
                    collectives = joined
                    continue
            collectives.append([pair])
        plan[kind] = _names(collectives)
    ctx.notes["coalesced"] = plan
