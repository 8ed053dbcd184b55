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
  its bytes would raise the graph's estimated peak (``estimate_memory.live_bytes`` with
  every gather started at its wait) anywhere before its wait.

Either way a gather never starts before the one used before it (issue order = order of
use), and the bytes of all-gathers in flight at its start (started and not yet waited,
this one included) fit ``max_inflight_mb``; a collective alone may exceed it. Waits do
not move, so every use still follows its wait; ``ctx.notes["prefetch"]`` records, per
bucket, across how many other all-gathers' uses its gather runs (0: started at its wait).

Trade-off: a longer lead hides more latency but holds more gathered bytes at once.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.estimate_costs import SECONDS
from compshard.passes.estimate_memory import backend_scratch_bytes, live_bytes
from compshard.passes.fx_utils import MB, META_KEY, hoist_before, is_view, nbytes, node_order, schedule_kind



def collective_groups(graph: fx.Graph, kind: str) -> list[dict]:
    """Each collective of ``kind`` with its pack nodes, start, wait and unpack nodes, in
    order of the start."""
    groups: dict[str, dict] = {}
    for node in graph.nodes:
        meta = node.meta.get(META_KEY)
        if not meta or not meta["collective"]:
            continue
        group = groups.setdefault(meta["collective"], {"pack": [], "unpack": [], "start": None, "wait": None})
        if meta["kind"] == kind:
            group["start"] = node
        elif meta["kind"] in ("pack", "unpack"):
            group[meta["kind"]].append(node)
        elif meta["kind"] == "wait":
            group["wait"] = node
    return [g for g in groups.values() if g["start"] is not None]


def _inflight_bytes(gathers: list[dict], index: int, start_position: int, order: dict) -> int:
    """Bytes in flight if gather ``index`` ran from ``start_position`` to its wait: its own
    plus every other gather whose interval meets that span (an upper bound)."""
    wait_position = order[gathers[index]["wait"]]
    nbytes = gathers[index]["start"].meta[META_KEY]["bytes"]
    for k, other in enumerate(gathers):
        if k != index and order[other["start"]] < wait_position and order[other["wait"]] >= start_position:
            nbytes += other["start"].meta[META_KEY]["bytes"]
    return nbytes


def _compute_prefix(graph: fx.Graph) -> list[float]:
    """``prefix[i]``: estimated compute seconds of the graph's first ``i`` nodes."""
    prefix = [0.0]
    for node in graph.nodes:
        prefix.append(prefix[-1] + (node.meta.get(SECONDS, 0.0) if schedule_kind(node) is None else 0.0))
    return prefix


def start_gathers_at_waits(graph: fx.Graph) -> list[dict]:
    """Move every all-gather's pack and start to just before its wait (nothing in flight
    at once); return the gathers in order of their waits."""
    gathers = sorted(collective_groups(graph, "all_gather"), key=lambda g: node_order(graph)[g["wait"]])
    for gather in gathers:
        for node in gather["pack"] + [gather["start"]]:
            gather["wait"].prepend(node)
    return gathers


def _auto_start(gathers: list[dict], i: int, nodes: list[fx.Node], order: dict, during: dict, prefix: list[float],
                peak: int, bound: float, earliest: int) -> int:
    """The index gather ``i``'s pack goes to: walking back from where it is issued now,
    the nearest position that hides all of its estimated time, else the one that hides
    the most; never so early that its bytes lift ``peak`` or the in-flight bytes pass
    ``bound`` anywhere on the way."""
    gather = gathers[i]
    issued_at = order[(gather["pack"] + [gather["start"]])[0]]
    wait_position = order[gather["wait"]]
    need = gather["start"].meta[SECONDS]
    held = sum(nbytes(n.meta.get("val")) for n in gather["pack"] if not is_view(n)) \
        + backend_scratch_bytes(gather["start"])  # the output (filled in place) and the backend's own
    best, best_hidden, highest = issued_at, 0.0, 0
    for position in range(issued_at - 1, earliest - 1, -1):
        highest = max(highest, during[nodes[position]])
        if highest + held > peak or _inflight_bytes(gathers, i, position, order) > bound:
            break
        queued = sum(g["start"].meta[SECONDS] for g in gathers[:i] if order[g["wait"]] >= position)
        hidden = min(need, prefix[wait_position] - prefix[position] - queued)
        if hidden > best_hidden * (1 + 1e-6):
            best, best_hidden = position, hidden
        if hidden >= need:
            break
    return best


def _fixed_start(gathers: list[dict], i: int, order: dict, first: int, distance: int, bound: float) -> int:
    """The index gather ``i``'s pack goes to for ``distance`` all-gathers ahead (just after
    the wait of gather ``i - distance``), shortened until the in-flight bytes fit ``bound``."""
    issued_at = order[(gathers[i]["pack"] + [gathers[i]["start"]])[0]]
    best = issued_at
    for d in range(1, min(distance, i + 1) + 1):
        position = order[gathers[i - d]["wait"]] + 1 if i - d >= 0 else first
        if position >= issued_at or _inflight_bytes(gathers, i, position, order) > bound:
            break
        best = position
    return best


def prefetch(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    gathers = start_gathers_at_waits(graph)  # from a known state
    last_input = list(graph.find_nodes(op="placeholder"))[-1]
    bound = ctx.options.max_inflight_mb * MB
    count_inputs = ctx.graph == "backward"
    peak = max(live_bytes(graph, count_inputs)[0].values(), default=0)
    distances = {}
    for i, gather in enumerate(gathers):
        order = node_order(graph)
        nodes = list(graph.nodes)
        moving = gather["pack"] + [gather["start"]]
        issued_at = order[moving[0]]
        first = order[last_input] + 1
        earliest = order[gathers[i - 1]["start"]] + 1 if i else first  # keep issue order = order of use
        if ctx.options.prefetch == "auto":
            position = _auto_start(gathers, i, nodes, order, live_bytes(graph, count_inputs)[0],
                                   _compute_prefix(graph), peak, bound, earliest)
        else:
            position = _fixed_start(gathers, i, order, first, ctx.options.prefetch, bound)
        # all-gathers ahead: across how many others' uses the gather now runs (0: it starts at its wait)
        distance = 0 if position >= issued_at else i - max(
            (j for j in range(i) if order[gathers[j]["wait"]] < position), default=-1)
        for bucket in gather["start"].meta[META_KEY]["buckets"]:
            distances[bucket] = distance
        if position >= issued_at:
            continue
        cursor = nodes[position - 1]
        placed = {n for g in gathers[:i] for n in g["pack"] + [g["start"]]}
        while cursor.next in placed or is_view(cursor.next):  # keep issue order = order of use
            cursor = cursor.next
        for node in moving:
            cursor.append(node)
            cursor = node
        for node in moving:
            for shard in node.all_input_nodes:
                if shard not in moving:
                    hoist_before(shard, moving[0])
    ctx.notes["prefetch"] = distances
