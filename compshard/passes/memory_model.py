"""The memory model the scheduling passes decide with: estimated bytes live at each node.

Counts storages the graph allocates and, when asked (backward graphs), its inputs: the
saved activations that the boxed executor releases after their last use (the start of
backward, when they are all still held, is often the step's peak); not the inputs the
caller holds anyway (``mark_held_outside``). A storage is live from
the node that creates it until the last use of any alias of it, or its ``free``; storages
that reach the graph outputs stay live to the end. This is what the FX executor does (it
drops each value after its last use), so the estimate tracks the real allocation order.
Collectives in flight also hold their backend's scratch buffers (gloo's; see
``backend_scratch_bytes``). Sizes are read at their hints (no guards).

``live_bytes`` walks a graph once; ``LiveProfile`` keeps the figures up to date while a
pass moves nodes (prefetch); ``storages`` gives the allocation and release events
themselves (coalescing prices candidate plans from them).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx

from compshard.comm.transport import transport_for
from compshard.passes.fx_utils import (
    c10d,
    compshard_ops,
    first_arg,
    held_full,
    is_op,
    is_view,
    op_arg,
    producer,
    scheduled_kind,
)
from compshard.sizes import nbytes

__all__ = [
    "HELD_OUTSIDE",
    "LiveProfile",
    "Storages",
    "backend_scratch_bytes",
    "live_bytes",
    "mark_held_outside",
    "storages",
]

HELD_OUTSIDE = "compshard_held_outside"  # node.meta key of a backward input held outside it (mark_held_outside)


def mark_held_outside(forward: fx.Graph, backward: fx.Graph) -> None:
    """Tag the backward's inputs that the forward saved from its own inputs' storage
    (parameter shards, buffers, the batch, views of them; the partitioner names each
    backward input after the forward value it saves): at run time the module and the
    caller hold them, so the backward's last use of them frees nothing and the model
    does not count them. Counted as released there, a graph's later points would look
    cheaper than its start by the shards' bytes, and coalescing would join collectives
    that raise the real peak."""
    roots = storages(forward, count_inputs=False).roots
    from_inputs = {
        node.name
        for node in forward.nodes
        if roots[node] is None and not isinstance(node.meta.get("val"), (list, tuple))
    }
    for node in backward.find_nodes(op="placeholder"):
        if node.name in from_inputs:
            node.meta[HELD_OUTSIDE] = True


def _storage_root(node: fx.Node, roots: dict[fx.Node, fx.Node | None], count_inputs: bool) -> fx.Node | None:
    if node.op == "placeholder" and (not count_inputs or node.meta.get(HELD_OUTSIDE)):
        return None
    if isinstance(node.meta.get("val"), (list, tuple)):
        return None  # a multi-output node: its outputs count through their getitems
    held = held_full(node) if is_op(node, compshard_ops.unshard.default) else None
    if held is not None:  # its value is the full tensor held between steps (shard_optimizer)
        return roots.get(held)
    aliased = first_arg(node) if node.target is operator.getitem and is_view(first_arg(node)) else node  # split's
    if is_view(aliased) or is_op(aliased, c10d.wait_tensor.default):
        parent = first_arg(aliased)
        return roots.get(parent) if isinstance(parent, fx.Node) else None
    if "out" in node.kwargs:  # an out= op (the in-place all-gather) writes its out buffer
        return roots.get(op_arg(node, "out"))
    if is_op(node, compshard_ops.gather_rows_.default, compshard_ops.exchange_rows_.default):  # in place, on gloo
        return roots.get(first_arg(node))
    return node


def backend_scratch_bytes(start: fx.Node) -> int:
    """Bytes the process group's backend allocates for itself while the collective
    ``start`` runs, until its wait. Measured with the profiler's allocation events on
    gloo (torch 2.13): an all-gather receives into two temporaries of its output's size,
    then copies them into the output; a reduce-scatter reduces a copy of its input; an
    all-reduce allocates nothing beyond its output. The in-place all-to-all of a
    reduce-scatter run as an exchange (``Transport.reduce_scatters_by_exchange``, gloo only)
    receives into a temporary of its buffer's size. None counted for the
    sends and receives that run compshard's all-gathers on gloo
    (``Transport.all_gathers_by_send_recv``), nor for other backends (NCCL writes the output
    in place)."""
    kind = scheduled_kind(start)
    if kind not in ("all_gather", "reduce_scatter"):
        return 0
    if is_op(start, compshard_ops.exchange_rows_.default):
        return nbytes(start.meta["val"])
    if is_op(start, compshard_ops.gather_rows_.default):  # an all-gather run as sends and receives, in place
        return 0
    if not transport_for(op_arg(start, "group_name"), start.meta["val"].device).backend_scratch:
        return 0
    return 2 * nbytes(start.meta["val"]) if kind == "all_gather" else nbytes(op_arg(start, "input").meta["val"])


@dataclass
class Storages:
    """Where each storage of a graph is allocated and released (the facts ``live_bytes``
    sums): ``roots`` maps a node to the storage its value lives in (None: not counted);
    ``allocates`` maps a node to the bytes it allocates while it runs (new storages of
    the op behind it, a collective's backend scratch); ``released`` maps a node index
    to the bytes released after that node."""

    nodes: list[fx.Node]
    order: dict[fx.Node, int]
    roots: dict[fx.Node, fx.Node | None]
    allocates: dict[fx.Node, int]
    release_at: dict[fx.Node, int]  # storage root -> index of the node after which it dies
    outputs: set[fx.Node]  # storage roots that reach the graph outputs (never released)
    released: dict[int, int]

    def release_index(self, root: fx.Node) -> int:
        """Index of the node after which ``root``'s storage dies (the last node: never)."""
        if root in self.outputs or root not in self.release_at:
            return len(self.nodes) - 1
        return self.release_at[root]


def storages(graph: fx.Graph, count_inputs: bool) -> Storages:
    """The allocation and release of every counted storage of ``graph`` (inputs counted
    when ``count_inputs``)."""
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    roots: dict[fx.Node, fx.Node | None] = {}
    release_at: dict[fx.Node, int] = {}
    allocates: dict[fx.Node, int] = {}
    outputs: set[fx.Node] = set()
    for node in nodes:
        roots[node] = _storage_root(node, roots, count_inputs)
        root = roots[node]
        if root is None:
            continue
        if root is node:  # a new storage, allocated while the op behind it runs
            allocates[producer(node)] = allocates.get(producer(node), 0) + nbytes(node.meta.get("val"))
        for user in node.users:
            if user.op == "output":
                outputs.add(root)
            elif is_op(user, compshard_ops.free.default):
                release_at[root] = order[user]
            else:
                release_at[root] = max(release_at.get(root, order[user]), order[user])
    released: dict[int, int] = {}  # node index -> bytes released after it
    for root, index in release_at.items():
        if root not in outputs:
            released[index] = released.get(index, 0) + nbytes(root.meta.get("val"))
    for node in nodes:
        scratch = backend_scratch_bytes(node)
        if scratch:
            allocates[node] = allocates.get(node, 0) + scratch
            wait = order[next(iter(node.users))]
            released[wait] = released.get(wait, 0) + scratch
    return Storages(nodes, order, roots, allocates, release_at, outputs, released)


def live_bytes(graph: fx.Graph, count_inputs: bool) -> tuple[dict[fx.Node, int], dict[fx.Node, int]]:
    """Estimated bytes live (inputs counted when ``count_inputs``) while each node runs
    (its outputs allocated, nothing released yet; a multi-output op allocates every
    output it hands on; a collective start, its backend's scratch until the wait) and
    after it (its dead inputs released)."""
    events = storages(graph, count_inputs)
    live, during, after = 0, {}, {}
    for index, node in enumerate(events.nodes):
        live += events.allocates.get(node, 0)
        during[node] = live
        live -= events.released.get(index, 0)
        after[node] = live
    return during, after


class LiveProfile:
    """``live_bytes`` kept up to date while a pass moves nodes, without walking the graph
    again: what a node allocates and which storages its users keep alive do not depend
    on the order, so after nodes move within a window of positions only that window's
    positions, the releases of the storages the moved nodes touch, and the bytes live
    inside the window change. ``during[i]`` / ``after[i]``: bytes live while / after the
    node at index ``i`` runs (as ``live_bytes``); ``nodes`` and ``order`` follow the graph."""

    def __init__(self, graph: fx.Graph, count_inputs: bool) -> None:
        events = storages(graph, count_inputs)
        self.graph = graph
        self.nodes, self.order = events.nodes, events.order
        self.allocates = events.allocates
        self.roots = events.roots
        self.outputs = events.outputs
        self.kept_by: dict[fx.Node, list[fx.Node]] = {}  # storage root -> the nodes that use it
        self.freed_by: dict[fx.Node, fx.Node] = {}
        for node in self.nodes:
            root = self.roots[node]
            if root is None or root in self.outputs:
                continue
            for user in node.users:
                if is_op(user, compshard_ops.free.default):
                    self.freed_by[root] = user
                else:
                    self.kept_by.setdefault(root, []).append(user)
        self.dies_after: dict[fx.Node, fx.Node] = {}  # storage root -> node after which it is released
        self.released: dict[fx.Node, int] = {}  # node -> bytes released after it
        for root in set(self.kept_by) | set(self.freed_by):
            self._set_release(root)
        for node in self.nodes:
            scratch = backend_scratch_bytes(node)
            if scratch:
                wait = next(iter(node.users))
                self.released[wait] = self.released.get(wait, 0) + scratch
        self.during = [0] * len(self.nodes)
        self.after = [0] * len(self.nodes)
        self._refresh(0, len(self.nodes) - 1)

    def _set_release(self, root: fx.Node) -> None:
        previous = self.dies_after.get(root)
        if previous is not None:
            self.released[previous] -= nbytes(root.meta.get("val"))
        last = self.freed_by.get(root) or max(self.kept_by[root], key=self.order.__getitem__)
        self.dies_after[root] = last
        self.released[last] = self.released.get(last, 0) + nbytes(root.meta.get("val"))

    def _refresh(self, first: int, last: int) -> None:
        live = self.after[first - 1] if first else 0
        for index in range(first, last + 1):
            node = self.nodes[index]
            live += self.allocates.get(node, 0)
            self.during[index] = live
            live -= self.released.get(node, 0)
            self.after[index] = live

    def moved(self, first: int, last: int, nodes: list[fx.Node]) -> None:
        """``nodes`` moved, all within (old and new) indices ``first..last``."""
        node = self.nodes[first - 1].next if first else next(iter(self.graph.nodes))
        for index in range(first, last + 1):
            self.nodes[index] = node
            self.order[node] = index
            node = node.next
        touched = {self.roots.get(n) for n in nodes}
        touched |= {self.roots.get(i) for n in nodes for i in n.all_input_nodes}
        for root in touched:
            if root in self.kept_by or root in self.freed_by:
                self._set_release(root)
        self._refresh(first, last)
