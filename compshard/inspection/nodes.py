"""How the report names and filters a scheduled graph's nodes: operator names, the group
of a tensor-parallel collective, and the nodes that only view a tensor. Shared by the
report's records and its trace."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx

from compshard.comm.expert_ops import EXPERT_OPS, registered_layer
from compshard.comm.layout import resolve_group
from compshard.passes.fx_utils import is_view, op_arg, program_collective

__all__ = ["ExpertExchange", "expert_exchange", "only_views", "op_name", "program_group"]


def op_name(node: fx.Node) -> str:
    """The operator's name without namespace and overload (``all_gather_into_tensor_out``)."""
    target = node.target
    return target._opname if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", str(target))


@dataclass(frozen=True)
class ExpertExchange:
    """A call of expert parallelism's all-to-alls (:mod:`compshard.comm.expert_ops`):
    the experts module, its group (``group_name``; ``group``: ``"all_to_all on group 3
    (ranks 0, 1)"``), its expert parameters, whether it is the backward's, the
    ``(token, slot)`` pairs it routes, the weights of one expert, and the bytes it sends
    other ranks when the routing is even (the data decide the real number)."""

    layer: str
    group_name: str
    group: str
    params: tuple[str, ...]
    backward: bool
    pairs: int
    weights_per_expert: int
    bytes: int


def expert_exchange(node: fx.Node) -> ExpertExchange | None:
    """The expert all-to-all ``node`` calls; None for any other node."""
    backward = EXPERT_OPS.get(node.target) if node.op == "call_function" else None  # type: ignore[call-overload]
    if backward is None:
        return None
    layer = registered_layer(op_arg(node, "layer"))
    hidden = op_arg(node, "hidden").meta["val"]
    pairs = op_arg(node, "top_k_index").meta["val"].numel()
    row_bytes = hidden.shape[-1] * hidden.dtype.itemsize
    weights = sum(value.meta["val"].numel() for value in op_arg(node, "weights"))
    return ExpertExchange(
        layer=layer.fqn,
        group_name=layer.group_name,
        group=f"all_to_all on group {layer.group_name}{_ranks(layer.group_name)}",
        params=tuple(f"{layer.fqn}.{name}" for name in layer.experts),
        backward=backward,
        pairs=pairs,
        weights_per_expert=weights // layer.experts_per_rank,
        bytes=layer.expected_bytes(pairs, row_bytes, backward),
    )


def _ranks(group_name: str) -> str:
    """`` (ranks 0, 1)``: the global ranks of ``group_name`` where this process knows it."""
    try:
        return f" (ranks {', '.join(map(str, dist.get_process_group_ranks(resolve_group(group_name))))})"
    except (RuntimeError, ValueError):
        return ""


def program_group(node: fx.Node) -> str:
    """For a collective of the program (tensor parallelism's, ``fx_utils.program_collective``):
    its operator and group, with the group's global ranks where this process knows the group
    (``"all_reduce on group 3 (ranks 0, 1)"``); ``""`` for any other node."""
    if not program_collective(node):
        return ""
    name = op_arg(node, "group_name")
    return f"{op_name(node)} on group {name}{_ranks(name)}"


def only_views(node: fx.Node) -> bool:
    """A node that does no work of its own: a view of a tensor or an item of a tuple."""
    return node.target is operator.getitem or is_view(node)
