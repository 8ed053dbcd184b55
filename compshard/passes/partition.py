"""Between the joint graph's pass order and the forward's: the partition into a forward and
a backward graph, and the account of what the forward saves for the backward.

The partition is AOTAutograd's min-cut (``min_cut_rematerialization_partition``), which
follows the tags the joint passes set (gathered parameters recomputed, the recompute
policy). Saved values are the backward's inputs other than tangents; each has the name
of the forward node that produced it, and AOTAutograd returns them from the forward
after the user's outputs. The plan gets their number (``saved_count``: the schedule
check finds the saved outputs by it) and their bytes by kind in the recompute plan:
``"activations"``, ``"gathered params"`` (``unshard`` outputs and their views and casts)
and ``"inputs"`` (graph inputs: shards, buffers, the batch, the full parameters that
``"shard_optimizer"`` holds between steps); a storage saved through
several values counts once. The backward's inputs saved from the forward's inputs are
tagged for the memory model (``memory_model.mark_held_outside``).

One repair of AOTAutograd's layout (torch 2.11 to 2.13): when a recomputed region holds
an RNG op (HF gradient checkpointing around attention), the partitioner inserts the RNG
states it saves after the saved opaque objects (the ``DeviceMesh`` that rebuilds DTensor
parameters' gradients), where its runtime expects every saved tensor first; the forward
then fails before it returns. :func:`_saved_tensors_first` restores the layout (tensors,
then opaque objects, then symbolic sizes) on both sides, keeping each kind's order.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef

from compshard.compile_plan import CompilePlan, RecomputePlan
from compshard.passes.fx_utils import compshard_ops, gathered_chain, held_full, is_op
from compshard.passes.memory_model import mark_held_outside
from compshard.sizes import size_hint

__all__ = ["partition"]


def partition(
    joint: fx.GraphModule, joint_inputs: Any, plan: CompilePlan, **kwargs: Any
) -> tuple[fx.GraphModule, fx.GraphModule, CompilePlan]:
    """The forward and backward graphs of ``joint``, and ``plan`` with what is saved."""
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    saved = [node for node in backward.graph.find_nodes(op="placeholder") if not node.name.startswith("tangents")]
    _saved_tensors_first(forward, backward)
    mark_held_outside(forward.graph, backward.graph)
    recompute = replace(plan.recompute or RecomputePlan("none"), saved=_saved_bytes(forward.graph, saved))
    return forward, backward, replace(plan, saved_count=len(saved), recompute=recompute)


def _saved_kind(node: fx.Node) -> int:
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        return 0
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
        return 2
    return 1  # an opaque object


def _saved_tensors_first(forward: fx.GraphModule, backward: fx.GraphModule) -> None:
    """Order the saved values tensors, opaque objects, symbolic sizes: the forward's
    outputs after the user's, and the backward's inputs before the tangents (which take
    the symbolic sizes first), each kind in its own order (see the module docstring)."""
    placeholders = list(backward.graph.find_nodes(op="placeholder"))
    inputs = list(itertools.takewhile(lambda node: not node.name.startswith("tangents"), placeholders))
    output = forward.graph.find_nodes(op="output")[0]
    outputs = list(output.args[0])
    user, saved_outputs = outputs[: len(outputs) - len(inputs)], outputs[len(outputs) - len(inputs) :]
    reordered = sorted(saved_outputs, key=_saved_kind)  # stable: each kind keeps its order
    if reordered == saved_outputs:
        return
    output.args = (tuple(user + reordered),)
    for node in reversed(sorted(inputs, key=lambda n: (_saved_kind(n) + 1) % 3)):  # symbolic sizes first
        first = next(iter(backward.graph.nodes))
        if first is not node:
            first.prepend(node)
    forward.recompile()
    backward.recompile()


def _saved_bytes(forward: fx.Graph, saved: list[fx.Node]) -> dict[str, int]:
    produced = {node.name: node for node in forward.nodes}
    gathered: set[fx.Node] = set()
    held: set[fx.Node] = set()  # the full tensors held between steps (shard_optimizer): inputs
    for node in forward.nodes:
        if is_op(node, compshard_ops.unshard.default):
            (gathered if held_full(node) is None else held).update(gathered_chain(node))
    totals = {"activations": 0, "gathered params": 0, "inputs": 0}
    counted = set()  # storages: a value and its views saved together count once
    for node in saved:
        source = produced.get(node.name)
        if source is None or not isinstance(source.meta.get("val"), torch.Tensor):
            continue
        storage = StorageWeakRef(source.meta["val"].untyped_storage())
        if storage in counted:
            continue
        counted.add(storage)
        if source.op == "placeholder" or source in held:
            kind = "inputs"
        elif source in gathered:
            kind = "gathered params"
        else:
            kind = "activations"
        totals[kind] += size_hint(source.meta["val"].untyped_storage().nbytes())  # symbolic: at its hint
    return totals
