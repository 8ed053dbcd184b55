"""Memory at a scheduled graph's peak, split by what holds it: gradients, activations,
gathered parameters, collective buffers.

The storages and their lifetimes are the memory model's (``passes/memory_model.py``, the
estimate the passes decide by); this module only sorts the storages live at the peak by
the lowering that made them: the gather side holds gathered parameters, the reduce side
gradients (unpacked) or collective buffers (packed, in reduction, backend scratch).
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import fx

from compshard.compile_plan import COLLECTIVE_KINDS, node_meta
from compshard.passes.fx_utils import producer
from compshard.passes.memory_model import backend_scratch_bytes, storages
from compshard.sizes import nbytes

__all__ = ["peak_breakdown"]

_HOLDERS = ("gradients", "activations", "gathered_parameters", "collective_buffers")


def peak_breakdown(gm: fx.GraphModule, count_inputs: bool) -> dict[str, int]:
    """The storages live while the graph's peak node runs (as the memory model counts
    them, inputs counted when ``count_inputs``: a backward's, but for those the caller
    holds, ``memory_model.mark_held_outside``), summed by holder (``_HOLDERS``). Call it
    while the graph's process groups exist: a collective's backend scratch is read from
    its group."""
    events = storages(gm.graph, count_inputs=count_inputs)
    started = {
        meta.collective: meta.kind for node in events.nodes if (meta := node_meta(node)).kind in COLLECTIVE_KINDS
    }
    awaiting_reduction = {
        root
        for node in events.nodes
        if _side(node, started) == "reduce" and _kind(node) == "pack"
        for root in (events.roots.get(i) for i in node.all_input_nodes)
        if root is not None
    }
    spans = []  # (first index live, last index live, bytes, holder)
    for node in events.nodes:
        if events.roots[node] is node:
            spans.append(
                (
                    events.order[producer(node)],
                    events.release_index(node),
                    nbytes(node.meta.get("val")),
                    _holder(node, started, awaiting_reduction),
                )
            )
        scratch = backend_scratch_bytes(node)
        if scratch:
            spans.append((events.order[node], events.order[next(iter(node.users))], scratch, "collective_buffers"))
    change = [0] * (len(events.nodes) + 1)
    for first, last, size, _ in spans:
        change[first] += size
        change[last + 1] -= size
    live, peak, peak_index = 0, 0, 0
    for index in range(len(events.nodes)):
        live += change[index]
        if live > peak:
            peak, peak_index = live, index
    totals = dict.fromkeys(_HOLDERS, 0)
    for first, last, size, holder in spans:
        if first <= peak_index <= last:
            totals[holder] += size
    return totals


def _kind(node: fx.Node) -> str | None:
    return node_meta(node).kind


def _side(node: fx.Node, started: Mapping[str | None, str]) -> str | None:
    """``"gather"`` or ``"reduce"``: which lowering made a scheduled node; None for others.
    A node whose collective never starts is a local cast: of a parameter when it has no
    collective label, else of a gradient."""
    meta = node_meta(node)
    if meta.kind is None:
        return None
    kind = started.get(meta.collective)
    if kind is None:
        return "gather" if meta.collective is None else "reduce"
    return "gather" if kind == "all_gather" else "reduce"


def _holder(root: fx.Node, started: Mapping[str | None, str], awaiting_reduction: set[fx.Node]) -> str:
    if root.op == "placeholder":  # backward inputs: activations saved by forward, tangents
        return "activations"
    side = _side(root, started) or _side(producer(root), started)
    if side == "gather":
        return "gathered_parameters"
    if side == "reduce":
        return "gradients" if (_kind(root) or _kind(producer(root))) == "unpack" else "collective_buffers"
    return "gradients" if root in awaiting_reduction else "activations"
