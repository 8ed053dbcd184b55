"""One record of compshard's state per module that ``shard`` touched.

As FSDP2 keeps one state object per module it manages, every module that ``shard``
touched (each module with sharded parameters, each gather unit, and the module passed to
``shard``: the *root*) carries one :class:`ModuleState`, in its attribute ``_compshard``,
and no other attribute of compshard's. (The parameters that ``shard`` replaced keep one
marker, ``_compshard_replaced_by_shard``, so that an optimizer still holding them is
refused.)

Most fields are fixed by ``shard``; compiled code reads those through
``compshard.torch_compat.constant_lookup`` functions, which Dynamo takes as constants,
guarding only the module's identity. What changes from call to call (a unit's open calls,
the forward depth, the model's :class:`~compshard.sharding.grad_sync.GradSync`) is read
directly, and guarded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from compshard.sharding.spec import ParamSpec, ShardingConfig
from compshard.tensor_parallel import TensorParallelLayout

if TYPE_CHECKING:
    from compshard.sharding.grad_sync import GradSync

__all__ = ["ForwardDepth", "MemberModule", "MemberReads", "ModuleState", "has_state", "is_sharded", "state_of"]


@dataclass
class ForwardDepth:
    """How many forwards of one sharded model's modules are running (uncompiled: compiled
    graphs gather whatever it says). One per model, shared by its modules' states."""

    depth: int = 0


@dataclass(frozen=True)
class MemberModule:
    """A module whose parameters a gather unit gathers on entry: ``path``, the child names
    from the unit to it (so that a compiled trace reaches the module by the same attribute
    path as the model's own code, and Dynamo guards it once), and ``names``, the
    ``(attribute name, canonical name)`` of each of its parameters the unit gathers."""

    path: tuple[str, ...]
    names: tuple[tuple[str, str], ...]


# a gather unit's member module: its path from the unit and, per parameter it gathers,
# (attribute name, canonical name, compshard::unshard's spec, whether the parameter is a
# DTensor: its rows are its local tensor)
MemberReads = tuple[tuple[str, ...], tuple[tuple[str, str, str, bool], ...]]


@dataclass(eq=False)
class ModuleState:
    """compshard's state on one module (see the module docstring).

    Of a module with sharded parameters: ``specs`` (its own, by attribute name),
    ``tensor_parallel`` (the layouts of those a tensor-parallel plan placed), ``unit``
    (the gather unit covering them; None: each read gathers). Of a gather unit:
    ``unit_path`` (its path in the model), ``members`` (what it gathers on entry),
    ``compiled_reads`` (the same, written out for compiled calls; None when a member takes
    the general read path), ``calls`` (the tensors gathered for each open call, innermost
    last). Of an experts module split across ranks: ``expert_layer`` (its key in
    :mod:`compshard.comm.expert_ops`). Of the root: ``config``. Shared by every module of one model: ``grad_sync`` and
    ``forward``."""

    grad_sync: GradSync
    forward: ForwardDepth | None = None
    specs: dict[str, ParamSpec] = field(default_factory=dict)
    tensor_parallel: dict[str, TensorParallelLayout] | None = None
    unit: nn.Module | None = None
    unit_path: str = ""
    members: tuple[MemberModule, ...] = ()
    compiled_reads: tuple[MemberReads, ...] | None = None
    calls: list[dict[str, torch.Tensor]] = field(default_factory=list)
    config: ShardingConfig | None = None
    expert_layer: str | None = None


def has_state(module: nn.Module) -> bool:
    """Whether ``shard`` touched ``module``."""
    return isinstance(module.__dict__.get("_compshard"), ModuleState)


def state_of(module: nn.Module) -> ModuleState:
    """``module``'s state (``shard`` touched it)."""
    state: Any = module._compshard
    assert isinstance(state, ModuleState)  # shard's
    return state


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` or a module beneath it holds parameters that ``shard`` sharded."""
    return any(has_state(m) and bool(state_of(m).specs) for m in module.modules())
