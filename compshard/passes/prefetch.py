"""Forward/backward pass: start each bucket's all-gather early enough to hide it.

Before: each bucket's pack + all-gather start sits at its first member's place and its
wait just before first use. The pass first moves every start down to just before its
wait (no two gathers overlap), then
after: bucket ``i``'s pack and start sit just after the wait of bucket ``i - d`` (the
graph's start when ``i - d < 0``), so the gather runs while buckets ``i - d .. i - 1``
compute. ``options.prefetch = d`` fixes the distance; ``"auto"`` picks, per bucket, the
smallest ``d`` that hides the most of the gather's estimated time. What distance ``d``
hides is its compute window (estimated seconds of the nodes between the start and the
wait) less the time the gathers started in between (buckets ``i - d + 1 .. i - 1``)
hold the link first, since collectives run one after another. So once communication
outweighs compute, going further ahead hides nothing more and only holds more memory:
``"auto"`` stays at the nearest distance that hides as much. ``"auto"`` also never raises
the graph's estimated peak (``estimate_memory.live_bytes``, with every gather started
at its wait): a gather whose pack and output bytes would lift the peak anywhere in its
window starts later.
Either way ``d`` shrinks until the bytes of all-gathers in flight at the start (started
and not yet waited, this one included) fit ``max_inflight_mb``; a bucket alone may
exceed it. Waits do not move, so every use still follows its wait; ``ctx.notes`` records
each bucket's distance.

Trade-off: a larger distance hides more latency but holds more gathered bytes at once.
"""

from __future__ import annotations

from torch import fx

from compshard.passes.context import PassContext
from compshard.passes.estimate_costs import SECONDS
from compshard.passes.estimate_memory import live_bytes
from compshard.passes.fx_utils import META_KEY, hoist_before, is_view, nbytes, node_order, schedule_kind

MB = 2**20


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


def prefetch(gm: fx.GraphModule, ctx: PassContext) -> None:
    graph = gm.graph
    gathers = sorted(collective_groups(graph, "all_gather"), key=lambda g: node_order(graph)[g["wait"]])
    last_input = list(graph.find_nodes(op="placeholder"))[-1]
    bound = ctx.options.max_inflight_mb * MB
    for gather in gathers:  # from a known state: every start just before its wait, nothing in flight
        for node in gather["pack"] + [gather["start"]]:
            gather["wait"].prepend(node)
    auto = ctx.options.prefetch == "auto"
    count_inputs = ctx.graph == "backward"
    peak = max(live_bytes(graph, count_inputs)[0].values(), default=0)
    distances = {}
    for i, gather in enumerate(gathers):
        order = node_order(graph)
        nodes = list(graph.nodes)
        prefix = _compute_prefix(graph)  # moving starts shifts positions, not compute
        wait_position = order[gather["wait"]]
        during = live_bytes(graph, count_inputs)[0] if auto else {}
        held = sum(nbytes(n.meta.get("val")) for n in gather["pack"] if not is_view(n))  # the gather fills it in place
        issued_at = order[(gather["pack"] + [gather["start"]])[0]]

        def after(d: int) -> fx.Node:
            """The node the start goes after for distance ``d``."""
            return gathers[i - d]["wait"] if i - d >= 0 else last_input

        allowed = []
        for d in range(1, i + 2):
            position = order[after(d)] + 1
            if position >= order[gather["start"]] or _inflight_bytes(gathers, i, position, order) > bound:
                break
            if auto and max((during[n] for n in nodes[position:issued_at]), default=0) + held > peak:
                break
            allowed.append(d)
        d = 0
        if allowed and auto:
            need = gather["start"].meta[SECONDS]

            def hidden(d: int) -> float:
                window = prefix[wait_position] - prefix[order[after(d)] + 1]
                queued = sum(g["start"].meta[SECONDS] for g in gathers[i - d + 1:i])
                return min(need, window - queued)

            d = allowed[0]
            for further in allowed[1:]:
                if hidden(further) > hidden(d) * (1 + 1e-6):
                    d = further
        elif allowed:
            d = min(ctx.options.prefetch, allowed[-1])
        distances[gather["start"].meta[META_KEY]["bucket"]] = d
        if d == 0:
            continue
        moving = gather["pack"] + [gather["start"]]
        cursor = after(d)
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
