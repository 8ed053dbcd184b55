"""Forward/backward pass: start each all-gather early enough to hide it.

Before: each collective's pack + all-gather start sits at its first member's place and
its wait just before first use. The pass first moves every start down to just before its
wait (no two gathers overlap), then moves each gather's pack and start earlier, in order
of use:

- ``options.prefetch = d``: just after the wait of the gather ``d`` ahead (the graph's
  start when there is none), so the gather runs while those buckets compute.
- ``"auto"``: the nearest node that hides all of the gather's estimated time, else the
  one that hides the most. What a start hides is the estimated compute between it and
  the wait less the time of the gathers still queued ahead of it, since collectives run
  one after another; so once communication outweighs compute, starting earlier hides
  nothing more and only holds more memory. ``"auto"`` also never starts a gather where
  its bytes would raise the graph's estimated peak (``memory_model.live_bytes`` with
  every gather started at its wait) anywhere before its wait.

Either way a gather never starts before the one used before it (issue order = order of
use), and the bytes of all-gathers in flight at its start (started and not yet waited,
this one included) fit ``max_inflight_mb``; a collective alone may exceed it. Waits do
not move, so every use still follows its wait. Returns the
:class:`~compshard.compile_plan.Prefetch`: per bucket, across how many other all-gathers'
uses its gather runs (0: started at its wait).

Trade-off: a longer lead hides more latency but holds more gathered bytes at once.

Cost: positions, live bytes (``memory_model.LiveProfile``) and compute prefix sums
are built once per graph and updated only over the window of positions each gather
moves across, instead of recomputed for every gather; sizes are hints (no guards).
"""

from __future__ import annotations

from torch import fx

from compshard.compile_plan import MiB, Prefetch, node_meta
from compshard.passes.context import PassContext
from compshard.passes.fx_utils import (
    CollectiveGroup,
    aten,
    is_op,
    is_view,
    scheduled_kind,
    start_gathers_at_waits,
    waited,
)
from compshard.passes.memory_model import LiveProfile, backend_scratch_bytes
from compshard.sizes import nbytes

__all__ = ["prefetch"]


def _inflight_bytes(gathers: list[CollectiveGroup], index: int, start_position: int, order: dict) -> int:
    """Bytes in flight if gather ``index`` ran from ``start_position`` to its wait: its own
    plus every other gather whose interval meets that span (an upper bound)."""
    wait_position = order[gathers[index].wait]
    inflight = node_meta(gathers[index].start).bytes
    for k, other in enumerate(gathers):
        if k != index and order[other.start] < wait_position and order[other.wait] >= start_position:
            inflight += node_meta(other.start).bytes
    return inflight


def _seconds(node: fx.Node) -> float:
    return node_meta(node).seconds or 0.0


def _compute_seconds(node: fx.Node) -> float:
    return _seconds(node) if scheduled_kind(node) is None else 0.0


def _compute_prefix(graph: fx.Graph) -> list[float]:
    """``prefix[i]``: estimated compute seconds of the graph's first ``i`` nodes."""
    prefix = [0.0]
    for node in graph.nodes:
        prefix.append(prefix[-1] + _compute_seconds(node))
    return prefix


def _auto_start(
    gathers: list[CollectiveGroup],
    i: int,
    order: dict,
    during: list[int],
    prefix: list[float],
    peak: int,
    bound: float,
    earliest: int,
) -> int:
    """The index gather ``i``'s pack goes to: walking back from where it is issued now,
    the nearest position that hides all of its estimated time, else the one that hides
    the most; never so early that its bytes lift ``peak`` or the in-flight bytes pass
    ``bound`` anywhere on the way."""
    gather = gathers[i]
    issued_at = order[gather.issued]
    wait_position = order[gather.wait]
    need = _seconds(gather.start)
    held = sum(nbytes(n.meta.get("val")) for n in gather.pack if not is_view(n)) + backend_scratch_bytes(
        gather.start
    )  # the output (filled in place) and the backend's own
    best, best_hidden, highest = issued_at, 0.0, 0
    for position in range(issued_at - 1, earliest - 1, -1):
        highest = max(highest, during[position])
        if highest + held > peak or _inflight_bytes(gathers, i, position, order) > bound:
            break
        queued = sum(_seconds(g.start) for g in gathers[:i] if order[g.wait] >= position)
        hidden = min(need, prefix[wait_position] - prefix[position] - queued)
        if hidden > best_hidden * (1 + 1e-6):
            best, best_hidden = position, hidden
        if hidden >= need:
            break
    return best


def _fixed_start(gathers: list[CollectiveGroup], i: int, order: dict, first: int, distance: int, bound: float) -> int:
    """The index gather ``i``'s pack goes to for ``distance`` all-gathers ahead (just after
    the wait of gather ``i - distance``), shortened until the in-flight bytes fit ``bound``."""
    issued_at = order[gathers[i].issued]
    best = issued_at
    for d in range(1, min(distance, i + 1) + 1):
        position = order[gathers[i - d].wait] + 1 if i - d >= 0 else first
        if position >= issued_at or _inflight_bytes(gathers, i, position, order) > bound:
            break
        best = position
    return best


def _shard_chain(shard: fx.Node, moving: list[fx.Node], order: dict, cursor: int, chosen: set) -> list[fx.Node]:
    """The views (and device copies) from a graph input to ``shard`` placed after index
    ``cursor``: they move up with the gather that reads them. Only such nodes move, so
    moving cannot change what any node computes."""
    pending, chain = [shard], []
    while pending:
        current = pending.pop()
        if current.op == "placeholder" or current in moving or current in chosen or order[current] <= cursor:
            continue
        if not (is_view(current) or is_op(current, aten._to_copy.default)):
            raise RuntimeError(f"compshard: cannot move {current.format_node()} above {moving[0].name}: not a view")
        chain.append(current)
        chosen.add(current)
        pending.extend(current.all_input_nodes)
    return sorted(chain, key=order.__getitem__)


def prefetch(graph: fx.Graph, ctx: PassContext) -> Prefetch:
    """One walk over the graph: the positions, live bytes and compute prefix sums are
    built once and updated only inside the window each gather moves across."""
    gathers = start_gathers_at_waits(graph)  # from a known state
    last_input = list(graph.find_nodes(op="placeholder"))[-1]
    bound = ctx.options.max_inflight_mb * MiB
    profile = LiveProfile(graph, count_inputs=ctx.graph == "backward")
    order, nodes = profile.order, profile.nodes
    peak = max(profile.during, default=0)
    prefix = _compute_prefix(graph)
    distances = {}
    placed: set[fx.Node] = set()
    for i, gather in enumerate(gathers):
        moving = gather.pack + [gather.start]
        issued_at = order[moving[0]]
        first = order[last_input] + 1
        earliest = order[gathers[i - 1].start] + 1 if i else first  # keep issue order = order of use
        if ctx.options.prefetch == "auto":
            position = _auto_start(gathers, i, order, profile.during, prefix, peak, bound, earliest)
        else:
            position = _fixed_start(gathers, i, order, first, ctx.options.prefetch, bound)
        # all-gathers ahead: across how many others' uses the gather now runs (0: it starts at its wait)
        distance = (
            0
            if position >= issued_at
            else i - max((j for j in range(i) if order[waited(gathers[j])] < position), default=-1)
        )
        for bucket in node_meta(gather.start).buckets:
            distances[bucket] = distance
        if position < issued_at:
            cursor = nodes[position - 1]
            while cursor.next in placed or is_view(cursor.next):  # keep issue order = order of use
                cursor = cursor.next
            last = max(order[node] for node in moving)
            chosen: set[fx.Node] = set()
            chains = [
                _shard_chain(shard, moving, order, order[cursor], chosen)
                for node in moving
                for shard in node.all_input_nodes
                if shard not in moving
            ]
            for node in [n for chain in chains for n in chain] + moving:
                cursor.append(node)
                cursor = node
            profile.moved(position, last, moving + list(chosen))  # nodes moved within position..last
            for index in range(position, last + 1):
                prefix[index + 1] = prefix[index] + _compute_seconds(nodes[index])
        placed.update(moving)
    return Prefetch(tuple(distances.items()))
