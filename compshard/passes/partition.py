"""Between the joint graph's pipeline and the forward's: the partition into a forward and
a backward graph, and the account of what the forward saves for the backward.

The partition is AOTAutograd's min-cut (``min_cut_rematerialization_partition``), which
follows the tags the joint passes set (gathered parameters recomputed, the recompute
policy). Saved values are the backward's inputs other than tangents; each has the name
of the forward node that produced it, and AOTAutograd returns them from the forward
after the user's outputs. The plan gets their number (``saved_count``: the schedule
check finds the saved outputs by it) and their bytes by kind in the recompute plan:
``"activations"``, ``"gathered params"`` (``unshard`` outputs and their views and casts)
and ``"inputs"`` (graph inputs: shards, buffers, the batch); a storage saved through
several values counts once.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import fx
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.multiprocessing.reductions import StorageWeakRef

from compshard.compile_plan import CompilePlan, RecomputePlan
from compshard.passes.fx_utils import compshard_ops, gathered_chain, is_op

__all__ = ["partition"]


def partition(joint: fx.GraphModule, joint_inputs: Any, plan: CompilePlan,
              **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule, CompilePlan]:
    """The forward and backward graphs of ``joint``, and ``plan`` with what is saved."""
    forward, backward = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
    saved = [node for node in backward.graph.find_nodes(op="placeholder") if not node.name.startswith("tangents")]
    recompute = replace(plan.recompute or RecomputePlan("none"), saved=_saved_bytes(forward.graph, saved))
    return forward, backward, replace(plan, saved_count=len(saved), recompute=recompute)


def _saved_bytes(forward: fx.Graph, saved: list[fx.Node]) -> dict[str, int]:
    produced = {node.name: node for node in forward.nodes}
    gathered = {member for node in forward.nodes if is_op(node, compshard_ops.unshard.default)
                for member in gathered_chain(node)}
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
        if source.op == "placeholder":
            kind = "inputs"
        elif source in gathered:
            kind = "gathered params"
        else:
            kind = "activations"
        totals[kind] += source.meta["val"].untyped_storage().nbytes()
    return totals
