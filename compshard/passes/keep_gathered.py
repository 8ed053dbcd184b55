"""Joint-graph planning step: which further buckets stay gathered from forward to backward
(``options.memory_budget_mb``), saving their re-gather in backward.

Before: the bucket plan of ``assign_buckets`` (the bucket used last in forward and the
parameters sharded with ``reshard_after_forward=False`` already kept); no recompute tags.
After (graph unchanged): the bucket plan with the budget's buckets ``keep_gathered``;
``tag_gathered_params`` and ``recompute`` follow it.

- A number: the smallest buckets (then by name) whose gathered bytes, in total, fit that
  many MiB.
- ``"auto"``: the budget is eager FSDP2's peak on the same model: the same schedule (one
  unit per block, the root unit kept) with every block saving what eager autograd saves.
  Room comes from recompute: raising a block to ``"selective"`` or ``"full"`` frees
  activations (with ``recompute="none"``; under any other recompute option its own levels
  free what they free), and a bucket may stay gathered while, at every point of the
  forward, the gathered bytes kept so far are at most the activation bytes freed so far
  (buckets in first-use order, a block's freed bytes counted from its first bucket). A
  bucket kept from its block's forward to its backward is then held only where the
  eager schedule held activations of that block or an earlier one, so the estimated peak
  does not rise above eager's. Among the levels, the one giving every block the same
  raise (none, selective or full) whose kept buckets save the most estimated seconds (a
  re-gather: the all-gather of the bucket and unpacking it; minus the recompute) is
  taken, then each raise the kept buckets do not need is dropped, last block first.

Trade-off: a kept bucket's all-gather is saved in full even where the backward would have
hidden it behind compute (a GPU overlaps it; gloo on CPU takes it from compute), so
``"auto"`` may recompute where the gather was free. A one-rank bucket gathers nothing
and is never kept for time.

Only shapes, dtypes, the module tree, the options and the agreed cost constants decide,
and ranks whose local batches differ (so do their activations) agree on each raise first
(through the store: the least freed bytes and the most recompute seconds of any rank), so
every rank keeps the same buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch import fx

from compshard.comm.layout import resolve_group
from compshard.comm.rank_exchange import exchange_across_ranks
from compshard.compile_plan import BucketPlan, Level, MemoryBudget, MiB
from compshard.cost_model import collective_seconds, costs_for
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import compshard_ops, gathered_chain, is_op, unshard_args, unshard_group
from compshard.passes.recompute_model import BlockRaise, BlockRaises, block_raises

__all__ = ["keep_gathered", "smallest_within"]


def smallest_within(buckets: BucketPlan, budget_bytes: float) -> set[str]:
    """The smallest buckets (then by name) whose gathered bytes fit ``budget_bytes`` in total."""
    kept, used = set(), 0
    for bucket in sorted(buckets, key=lambda b: (b.nbytes, b.name)):
        if used + bucket.nbytes > budget_bytes:
            break
        kept.add(bucket.name)
        used += bucket.nbytes
    return kept


@dataclass(frozen=True)
class _Candidate:
    """A bucket ``auto`` may keep: its gathered bytes, the block whose raise frees its room
    (None: outside the blocks), and the seconds its backward re-gather costs."""

    name: str
    nbytes: int
    block: str | None
    regather_seconds: float


def _candidates(unshards: list[fx.Node], buckets: BucketPlan, block_of: dict[fx.Node, str]) -> list[_Candidate]:
    unshard_of: dict[str, fx.Node] = {}
    for node in unshards:
        unshard_of.setdefault(unshard_args(node).param, node)
    candidates = []
    for bucket in buckets:
        nodes = [unshard_of[param] for param in bucket.params if param in unshard_of]
        users = {block_of.get(user) for node in nodes for member in gathered_chain(node) for user in member.users}
        users.discard(None)
        block = next(iter(users)) if len(users) == 1 else None
        args = unshard_args(nodes[0])
        if bucket.keep_gathered or args.world_size == 1:
            seconds = 0.0  # already held, or nothing to gather
        else:
            costs = costs_for(args.group_name)
            seconds = collective_seconds(bucket.nbytes, costs) + bucket.nbytes / costs.bytes_per_second
        candidates.append(_Candidate(bucket.name, bucket.nbytes, block, seconds))
    return candidates


@dataclass(frozen=True)
class _Choice:
    raises: dict[str, BlockRaise]
    kept: tuple[str, ...]
    regather_seconds: float  # the kept buckets' re-gathers
    recompute_seconds: float  # the raises', counted when the budget chose them

    @property
    def seconds_saved(self) -> float:
        return self.regather_seconds - self.recompute_seconds


def _choose(candidates: list[_Candidate], raises: dict[str, BlockRaise], chosen: bool) -> _Choice:
    """Keep, in first-use order, each bucket whose re-gather costs time and that fits the
    room freed so far. ``chosen``: the raises are the budget's (else the recompute option's)."""
    room, kept, saved, counted = 0, [], 0.0, set()
    for candidate in candidates:
        if candidate.block in raises and candidate.block not in counted:
            counted.add(candidate.block)
            room += raises[candidate.block].freed_bytes
        if candidate.regather_seconds > 0 and candidate.nbytes <= room:
            kept.append(candidate.name)
            room -= candidate.nbytes
            saved += candidate.regather_seconds
    return _Choice(raises, tuple(kept), saved, sum(r.seconds for r in raises.values()) if chosen else 0.0)


def _agreed(trade: BlockRaises, group_name: str) -> BlockRaises:
    """``trade`` with every raise at the least freed bytes and the most seconds of any rank
    of ``group_name`` (ranks' local batches, and so their activations, may differ)."""
    group = resolve_group(group_name) if group_name else None
    if group is None or dist.get_world_size(group) == 1:
        return trade
    figures = {(block, r.level): (r.freed_bytes, r.seconds) for block, raised in trade.raises.items() for r in raised}
    _, everyone = exchange_across_ranks(
        "compshard-memory-budget", group_name, figures, "a joint graph with memory_budget_mb='auto'"
    )

    def agreed(block: str, own: BlockRaise) -> BlockRaise:
        ranks = [rank.get((block, own.level), figures[block, own.level]) for rank in everyone]
        return BlockRaise(own.level, min(freed for freed, _ in ranks), max(seconds for _, seconds in ranks))

    raises = {block: tuple(agreed(block, r) for r in raised) for block, raised in trade.raises.items()}
    return replace(trade, raises=raises)


def _auto(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan) -> BucketPlan:
    unshards = [node for node in graph.nodes if is_op(node, compshard_ops.unshard.default)]
    chains = frozenset(member for node in unshards for member in gathered_chain(node))
    trade = _agreed(block_raises(graph, ctx.options.recompute, chains), unshard_group(graph))
    candidates = _candidates(unshards, buckets, trade.block_of)
    if trade.optional:
        choices = [
            _choose(
                candidates,
                {block: r for block, options in trade.raises.items() for r in options if r.level == level},
                chosen=True,
            )
            for level in (Level.SELECTIVE, Level.FULL)
        ]
        best = max([_choose(candidates, {}, chosen=True), *choices], key=lambda c: c.seconds_saved)
        for block in reversed(list(best.raises)):  # drop the raises the kept buckets do not need
            trial = _choose(candidates, {b: r for b, r in best.raises.items() if b != block}, chosen=True)
            if trial.seconds_saved >= best.seconds_saved:
                best = trial
    else:
        best = _choose(
            candidates, {block: options[0] for block, options in trade.raises.items() if options}, chosen=False
        )
    kept = set(best.kept)
    budget = MemoryBudget(
        kept=best.kept,
        levels={block: r.level for block, r in best.raises.items()},
        eager_saved_bytes=trade.eager_bytes,
        freed_bytes=sum(r.freed_bytes for r in best.raises.values()),
        kept_bytes=sum(c.nbytes for c in candidates if c.name in kept),
        seconds_saved=best.seconds_saved,
    )
    return _keeping(buckets, kept, budget)


def _keeping(buckets: BucketPlan, kept: set[str], budget: MemoryBudget | None = None) -> BucketPlan:
    """``buckets`` with those named in ``kept`` kept gathered."""
    return BucketPlan(tuple(replace(b, keep_gathered=True) if b.name in kept else b for b in buckets), budget=budget)


def keep_gathered(graph: fx.Graph, ctx: PassContext, buckets: BucketPlan) -> BucketPlan:
    budget = ctx.options.memory_budget_mb
    if budget is None:
        return buckets
    if budget == "auto":
        return _auto(graph, ctx, buckets)
    return _keeping(buckets, smallest_within(buckets, budget * MiB))
