"""Step time: the seconds a forecast puts on a schedule beyond what the passes estimated.

The passes estimate every op and collective of the backend's own (the cost model at the
forecast hardware's constants). Here: a ``"measured"`` machine's timings replace the
compute estimates (each graph also run end to end, its ops scaled to that run); tensor
parallelism's collectives, which the passes leave alone, are priced at their group's
link; the optimizer's data-bound pass is priced (or timed); and the longest waits for
communication are named. The timelines (one compute and one communication stream,
``compshard.timeline``) are simulated again after each change: their length is the
critical path, compute plus the communication it waits for.
"""

from __future__ import annotations

import torch
from torch import fx

from compshard import cost_model
from compshard.compile_plan import COLLECTIVE_KINDS, node_meta, set_node_meta
from compshard.cost_model import collective_seconds
from compshard.inspection import Report
from compshard.inspection.nodes import expert_exchange
from compshard.passes.fx_utils import op_arg, program_collective
from compshard.predict.hardware import Hardware, Measured
from compshard.sizes import nbytes
from compshard.timeline import simulate

__all__ = ["longest_waits", "optimizer_seconds", "price_expert_parallel", "price_tensor_parallel", "price_with_timings"]

_PROGRAM_COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter"}


def price_with_timings(schedule: Report, machine: Hardware | Measured) -> None:
    """Where the machine times ops (``"measured"``), the timings replace the scheduled
    graphs' compute estimates, and the timelines are simulated again. A graph whose every
    compute op was timed is also run end to end, and its ops' timings are scaled to that
    run (what the graph's own code and the ops' cold caches add is spread over its ops in
    proportion). Call inside the fake world: the runs issue its collectives."""
    timed = False
    for gm in schedule.graphs.values():
        timings, untimed = _op_timings(gm, machine)
        run = None if untimed or not timings else machine.graph_seconds(gm)
        scale = run / sum(timings.values()) if run else 1.0
        for node, seconds in timings.items():
            set_node_meta(node, seconds=seconds * scale)
        timed = timed or bool(timings)
    if timed:
        _simulate_again(schedule)


def _op_timings(gm: fx.GraphModule, machine: Hardware | Measured) -> tuple[dict[fx.Node, float], bool]:
    """The machine's seconds for each compute node of ``gm`` it times, and whether an
    operator was left untimed."""
    timings, untimed = {}, False
    for node in gm.graph.nodes:
        if node_meta(node).kind not in (*COLLECTIVE_KINDS, "wait", "free"):
            seconds = machine.op_seconds(node)
            if seconds is not None:
                timings[node] = seconds
            elif isinstance(node.target, torch._ops.OpOverload):
                untimed = True
    return timings, untimed


def price_tensor_parallel(schedule: Report) -> float:
    """Price tensor parallelism's collectives (the program's: ``fx_utils.program_collective``)
    at their group's constants, its full buffer moved (the larger of input and output;
    twice for an all-reduce), and simulate the timelines again; they stay on the compute
    stream, which waits for each (DTensor waits at once). Their seconds in all. Call
    inside the fake world, whose groups' constants ``cost_model.costs_for`` reads."""
    total = 0.0
    for gm in schedule.graphs.values():
        for node in gm.graph.nodes:
            if program_collective(node):
                moved = max(nbytes(value.meta.get("val")) for value in (node, *node.all_input_nodes))
                kind = _PROGRAM_COLLECTIVE_KINDS.get(node.target._opname, "all_gather")
                seconds = collective_seconds(moved, cost_model.costs_for(op_arg(node, "group_name")), kind)
                set_node_meta(node, seconds=seconds)
                total += seconds
    if total:
        _simulate_again(schedule)
    return total


def price_expert_parallel(schedule: Report) -> float:
    """Price expert parallelism's calls (:func:`compshard.inspection.nodes.expert_exchange`):
    their all-to-alls at their group's constants, the bytes an even routing sends (three
    rounds forward, counts included; two backward), and the local experts' matmuls at the
    group's FLOP rate (2 FLOPs per expert weight and routed pair forward; three times that
    backward, which recomputes the forward). They stay on the compute stream (the op waits
    for each round). Returns the all-to-alls' seconds in all. Call inside the fake world."""
    total = 0.0
    for gm in schedule.graphs.values():
        for node in gm.graph.nodes:
            exchange = expert_exchange(node)
            if exchange is None:
                continue
            costs = cost_model.costs_for(exchange.group_name)
            rounds = 2 if exchange.backward else 3
            moved = rounds * costs.alpha + exchange.bytes * costs.beta
            flops = 2 * exchange.pairs * exchange.weights_per_expert * (3 if exchange.backward else 1)
            set_node_meta(node, seconds=moved + flops / costs.flops_per_second)
            total += moved
    if total:
        _simulate_again(schedule)
    return total


def _simulate_again(schedule: Report) -> None:
    schedule.timelines = {kind: simulate(gm.graph) for kind, gm in schedule.graphs.items()}


def longest_waits(schedule: Report, count: int = 3) -> tuple[tuple[str, str, float], ...]:
    """The ``count`` longest waits of compute for a collective: (graph, bucket, seconds)."""
    waits = []
    for kind, timeline in schedule.timelines.items():
        nodes = {node.name: node for node in schedule.graphs[kind].graph.nodes}
        for span in timeline.spans:
            if span.kind == "wait" and span.end > span.start:
                meta = node_meta(nodes[span.name])
                waits.append((kind, meta.bucket or meta.unit, span.end - span.start))
    return tuple(sorted(waits, key=lambda wait: -wait[2])[:count])


def optimizer_seconds(
    machine: Hardware | Measured,
    shards: list[tuple[tuple[int, ...], torch.dtype]],
    params: int,
    states: int,
    bytes_per_second: float,
) -> float:
    """The optimizer step's data-bound seconds over ``shards`` (``params`` bytes): timed by
    a ``Measured`` machine where it can, else one fused AdamW-like pass (read parameter,
    gradient and states; write parameter and states) at ``bytes_per_second``."""
    timed = machine.optimizer_seconds(shards, states) if isinstance(machine, Measured) else None
    if timed is not None:
        return timed
    return (3 + 2 * states) * params / bytes_per_second
