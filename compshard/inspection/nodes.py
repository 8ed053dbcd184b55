"""How the report names and filters a scheduled graph's nodes: operator names, the group
of a tensor-parallel collective, and the nodes that only view a tensor. Shared by the
report's records and its trace."""

from __future__ import annotations

import operator

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.distributed_c10d import _resolve_process_group

from compshard.passes.fx_utils import is_view, op_arg, program_collective

__all__ = ["only_views", "op_name", "program_group"]


def op_name(node: fx.Node) -> str:
    """The operator's name without namespace and overload (``all_gather_into_tensor_out``)."""
    target = node.target
    return target._opname if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


def program_group(node: fx.Node) -> str:
    """For a collective of the program (tensor parallelism's, ``fx_utils.program_collective``):
    its operator and group, with the group's global ranks where this process knows the group
    (``"all_reduce on group 3 (ranks 0, 1)"``); ``""`` for any other node."""
    if not program_collective(node):
        return ""
    name = op_arg(node, "group_name")
    try:
        ranks = f" (ranks {', '.join(map(str, dist.get_process_group_ranks(_resolve_process_group(name))))})"
    except (RuntimeError, ValueError):
        ranks = ""
    return f"{op_name(node)} on group {name}{ranks}"


def only_views(node: fx.Node) -> bool:
    """A node that does no work of its own: a view of a tensor or an item of a tuple."""
    return node.target is operator.getitem or is_view(node)
