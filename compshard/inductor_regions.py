"""Inductor codegen that keeps compshard's schedule: Inductor compiles the compute only.

Handed a whole scheduled graph, Inductor plans memory again, and not as the passes did:
its peak-memory reordering moves all-gathers (on the benchmark GPT it hoisted the
second forward all-gather to the top of the graph), its buffer-reuse pool keeps a dead
buffer allocated until a later kernel of the same size takes it (the gradients of
the last blocks lived through the whole backward), it keeps a collective's input alive
until the collective's wait, and it has no place for ``compshard::free``: together a
third more peak memory than the fx codegen's on the benchmark GPT.

So Inductor gets only the compute. The scheduled graph is cut at every node compshard
owns (``is_owned``: collective starts and waits, the pack/unpack ops around them, frees)
into regions: maximal runs of the other nodes in graph order. A region that computes
(not only views) is compiled by Inductor as a graph of its own, whose inputs are the
values it reads from before it and whose outputs are the values read after it; a
runner executes the graph in order, owned nodes and view-only regions one node at a
time as the fx codegen does, each compiled region as one call.

What holds:
- Owned nodes run exactly where the passes put them, in graph order: every all-gather,
  wait, free and reduce-scatter keeps its place, and only the runner issues them.
- The runner drops its reference to a value before the step that uses it last;
  regions take their inputs boxed, so Inductor releases an input after its last use
  inside the region. A value outlives its fx-codegen lifetime only inside a region
  (Inductor's own planning there), never across an owned node.
- A region's outputs keep the strides the graph's metadata gives them (marked as user
  outputs, whose strides Inductor keeps), so owned nodes and later regions see the
  layouts the passes traced.

Trade-off: Inductor fuses only within a region, so no fusion crosses a collective,
pack, unpack or free (a few cuts per bucket); and each region is one Inductor compile.
The regions of repeated blocks are the same graph (nodes are renamed canonically), so
Inductor's caches compile their kernels once.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from compshard.comm.bucket_ops import direct_call
from compshard.passes.fx_utils import is_view

__all__ = ["compile_regions", "is_owned"]

_OWNED_NAMESPACES = ("_c10d_functional", "compshard")
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def is_owned(node: fx.Node) -> bool:
    """Whether ``node`` is compshard's to run: a functional collective or wait, a
    compshard op (pack, unpack, free), or an item of such an op's result."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and is_owned(source)
    return isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in _OWNED_NAMESPACES


def _computes(node: fx.Node) -> bool:
    """A node worth compiling: a call that is neither a view, an item of a result, nor
    arithmetic on symbolic sizes."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node):
        return False
    return not isinstance(node.meta.get("val"), _SYMBOLIC)


@dataclass
class _Step:
    """One step of the runner: ``call`` takes the values of the ``inputs`` slots, boxed
    (it may clear the list), and returns the values of the ``outputs`` slots; the
    ``release`` slots (values this step reads last) are cleared before it runs."""

    call: Callable[[list], Sequence[Any]]
    inputs: list[int]
    outputs: list[int]
    release: list[int]


def _runs(graph: fx.Graph) -> list[tuple[bool, list[fx.Node]]]:
    """The graph's call nodes in order, grouped: (True, [node]) for each owned node,
    (False, run) for each maximal run of nodes that are not owned."""
    runs: list[tuple[bool, list[fx.Node]]] = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        if is_owned(node):
            runs.append((True, [node]))
        elif runs and not runs[-1][0]:
            runs[-1][1].append(node)
        else:
            runs.append((False, [node]))
    return runs


def _region_module(
    gm: fx.GraphModule, nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]
) -> fx.GraphModule:
    """``nodes`` as a graph of their own: placeholders for ``inputs``, ``outputs``
    returned as a tuple, the constants they read (``get_attr``) copied in. Names are
    generated afresh, so equal regions are equal graphs."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for index, value in enumerate(inputs):
        env[value] = graph.placeholder(f"input_{index}")
        env[value].meta = dict(value.meta)

    def lookup(value: fx.Node) -> fx.Node:
        if value not in env:  # a constant
            assert isinstance(value.target, str), value.format_node()  # a get_attr node: the attribute's name
            env[value] = graph.get_attr(value.target)
            env[value].meta = dict(value.meta)
        return env[value]

    for node in nodes:
        args, kwargs = fx.map_arg((node.args, node.kwargs), lookup)
        env[node] = graph.create_node(node.op, node.target, args, kwargs)
        env[node].meta = dict(node.meta)
    result = graph.output(tuple(env[value] for value in outputs))
    # Every output keeps the strides of its metadata (what torch.compile's own front end
    # marks for a graph's user outputs): later steps were traced with those layouts.
    result.meta["user_visible_output_idxs"] = list(range(len(outputs)))
    return fx.GraphModule(gm, graph)


def _compile_region(region: fx.GraphModule, inputs: list[fx.Node], kind: str) -> Callable[[list], Sequence[Any]]:
    """Inductor on one region, in a tracing context of its own: the step's context
    describes the whole graph (its donated inputs, static inputs, output strides), which
    must not be read for, or written by, a region's inputs and outputs. Through Inductor's
    FX graph cache, which Inductor skips while AOTAutograd's bundled cache is on (the
    backend turns that on for its own entry, which carries the scheduled graphs, not the
    regions): off here, so equal regions compile once and a warm launch loads them."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor.compile_fx import compile_fx_inner

    example_inputs = [value.meta["val"] for value in inputs]
    with (
        tracing(TracingContext(detect_fake_mode(example_inputs))),
        torch._functorch.config.patch(bundled_autograd_cache=False),
    ):
        return compile_fx_inner(
            region, example_inputs, is_backward=kind == "backward", is_inference=kind == "inference"
        )


def _eager(nodes: list[fx.Node], inputs: list[fx.Node], outputs: list[fx.Node]) -> Callable[[list], list]:
    """Run ``nodes`` one by one, as the fx codegen does (owned nodes, view-only regions);
    compshard's bucket copies and frees without the dispatcher (``bucket_ops.direct_call``)."""
    calls = []
    for node in nodes:
        if node.op != "call_function" or not callable(node.target):
            raise NotImplementedError(f"compshard: codegen 'inductor' cannot run {node.format_node()}")
        calls.append((node, direct_call(node.target)))

    def call(values: list) -> list:
        env = dict(zip(inputs, values))
        values.clear()
        for node, target in calls:
            args, kwargs = fx.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = target(*args, **kwargs)
        return [env[value] for value in outputs]

    return call


def _reads(nodes: list[fx.Node]) -> list[fx.Node]:
    """The values ``nodes`` read that they do not compute, in order of first read."""
    inside = set(nodes)
    return list(dict.fromkeys(value for node in nodes for value in node.all_input_nodes if value not in inside))


class _Slot(int):
    """A graph output's slot in the runner's values (not an int the graph returns)."""


def compile_regions(gm: fx.GraphModule, kind: str) -> tuple[Callable[[list], list], int]:
    """A boxed callable running ``gm`` with its compute compiled by Inductor region by
    region (see the module docstring), and the number of regions Inductor compiled."""
    graph = gm.graph
    slots: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node.op != "output":
            slots[node] = len(slots)  # placeholders first, in order: the arguments' slots
    runs = _runs(graph)
    (output,) = graph.find_nodes(op="output")
    kept = set(output.all_input_nodes)  # graph outputs live to the end
    last_reader: dict[fx.Node, int] = {}  # value -> index of the last step that reads it
    for index, (_, nodes) in enumerate(runs):
        for value in _reads(nodes):
            if value.op != "get_attr":
                last_reader[value] = index

    steps: list[_Step] = []
    compiled = 0
    for index, (owned, nodes) in enumerate(runs):
        reads = _reads(nodes)
        outputs = [node for node in nodes if node in kept or last_reader.get(node, index) > index]
        if not owned and any(_computes(node) for node in nodes):
            reads = [value for value in reads if value.op != "get_attr"]  # copied into the region
            call = _compile_region(_region_module(gm, nodes, reads, outputs), reads, kind)
            compiled += 1
        else:
            call = _eager(nodes, reads, outputs)
        release = [slots[value] for value in reads if last_reader.get(value) == index and value not in kept]
        steps.append(_Step(call, [slots[value] for value in reads], [slots[value] for value in outputs], release))
    result = fx.map_arg(output.args[0], lambda value: _Slot(slots[value]))
    constants = {slots[node]: operator.attrgetter(node.target)(gm) for node in graph.find_nodes(op="get_attr")}
    size = len(slots)

    def run(args: list) -> list:
        values: list[Any] = [None] * size
        values[: len(args)] = args
        args.clear()
        for i, constant in constants.items():
            values[i] = constant
        for step in steps:
            inputs = [values[i] for i in step.inputs]
            for i in step.release:
                values[i] = None
            for i, value in zip(step.outputs, step.call(inputs)):
                values[i] = value
        return list(
            torch.utils._pytree.tree_map(lambda item: values[item] if isinstance(item, _Slot) else item, result)
        )

    run._boxed_call = True  # type: ignore[attr-defined]
    return run, compiled
