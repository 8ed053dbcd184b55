"""Strategy ``"shard_optimizer"`` (ZeRO-1; FairScale's OSS + ShardedDDP): full parameters
held on every rank between steps.

At rest each parameter is still this rank's ``Shard(0)`` rows (a DTensor), so the
optimizer steps only those rows and keeps 1/N of its state, and checkpoints, clipping
and state dicts are those of ``"full_shard"``. Beside them the model holds each
parameter's full tensor (``GradSync.held``, in the compute dtype), which every read in
the forward returns with no collective (:mod:`compshard.sharding.reads`; compiled, the
``unshard`` op takes it as ``held`` and its lowering reads it as is). Gradients are
reduce-scattered as under ``"shard_grad_op"`` (each rank keeps its rows).

The held tensors follow the rows (updated in place, so compiled graphs keep reading the
same inputs):

- after every ``optimizer.step()`` over some of the model's parameters, the rows it
  stepped are all-gathered into them, in buckets (a global optimizer step post-hook);
- after ``load_state_dict`` (and so after ``compshard.checkpoint.load`` and
  ``set_full_state_dict``), all of them (a load-state-dict post-hook of the root);
- a conversion (``module.to()``, ``.float()``) applies to them what it applies to the
  rows, locally (:mod:`compshard.sharding.conversions`).

A change of the rows made otherwise (an in-place write under ``no_grad``) reaches the
held tensors at the next optimizer step. Every rank steps and loads at the same points,
so the refresh gathers are the same collectives on every rank.

Trade-off, against ``"full_shard"``: no gather in forward or backward and no re-gather
in backward, for the full parameters on every rank (``N`` times the rows, plus the rows
themselves) and one all-gather of the stepped parameters per step, after the step and
not overlapped with compute.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from compshard import cost_model
from compshard.module_tree import module_of, repeated_block, repeated_containers
from compshard.sharding.grad_sync import DEFAULT_BUCKET_BYTES, GradSync
from compshard.sharding.spec import ParamSpec
from compshard.sharding.step_gather import gather_buckets, shard_buckets

__all__ = ["StepGather", "convert_held", "hold_full_parameter", "install_refreshes", "refresh_held", "step_gathers"]

# the gradient-sync state of every live model sharded with "shard_optimizer"
_HOLDING: weakref.WeakSet[GradSync] = weakref.WeakSet()
_STEP_HOOK: list = []  # the one global optimizer step post-hook, registered on first use


def hold_full_parameter(original: nn.Parameter, spec: ParamSpec) -> torch.Tensor:
    """The full tensor held for ``original`` (the parameter ``shard`` replaces, its value
    the first rank's), in the compute dtype."""
    with torch.no_grad():
        return original.detach().to(spec.param_dtype or original.dtype, copy=True)


def install_refreshes(root: nn.Module, grad_sync: GradSync) -> None:
    """Keep ``grad_sync.held`` equal to the rows after optimizer steps and loads (see
    the module docstring)."""
    _HOLDING.add(grad_sync)
    if not _STEP_HOOK:
        _STEP_HOOK.append(register_optimizer_step_post_hook(_refresh_stepped))
    root.register_load_state_dict_post_hook(functools.partial(_refresh_loaded, weakref.ref(grad_sync)))


def refresh_held(grad_sync: GradSync, names: list[str], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """All-gather the rows of parameters ``names`` (in registration order) into their held
    tensors, one bucket at a time (:func:`step_gathers` lists them). Collective."""
    held = grad_sync.held
    assert held is not None  # a "shard_optimizer" model's
    specs, unit_of = _refresh_plan(grad_sync, names)
    for bucket in gather_buckets(specs, grad_sync.routed, bucket_bytes, unit_of):
        for spec, full in bucket:
            held[spec.fqn].copy_(full)


_REST = ""  # the unit of the parameters outside repeated blocks


def _refresh_plan(grad_sync: GradSync, names: Iterable[str]) -> tuple[list[ParamSpec], Callable[[str], str]]:
    """(the specs of parameters ``names`` in refresh order, parameter name -> its unit),
    as :func:`~compshard.sharding.step_gather.shard_buckets` takes them. A unit is a
    repeated block (``blocks.3``), whose parameters a refresh gathers together as a
    compiled backward reduces them together (one bucket per block, as
    ``passes/assign_buckets.py`` plans them), or the pooled rest, bucketed by size. The
    order groups ``names`` by unit, the units in order of their first parameter (the
    rest usually first: embeddings), each unit's in registration order."""
    containers = repeated_containers(module_of(name) for name in grad_sync.specs)

    def unit_of(name: str) -> str:
        return repeated_block(module_of(name), containers) or _REST

    units: dict[str, list[str]] = {}
    for name in names:
        units.setdefault(unit_of(name), []).append(name)
    return [grad_sync.specs[name] for members in units.values() for name in members], unit_of


@dataclass(frozen=True)
class StepGather:
    """One all-gather of the refresh after each optimizer step: its bucket's name (the
    repeated block, or ``rest.<k>``), the parameters it gathers (registration order),
    their full bytes and the group it runs in."""

    bucket: str
    params: tuple[str, ...]
    nbytes: int
    group_name: str
    seconds: float  # estimated by the cost model calibrated on the group


def step_gathers(grad_sync: GradSync, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> tuple[StepGather, ...]:
    """The all-gathers an optimizer step over all of the model's parameters is followed
    by (none but for ``"shard_optimizer"``; a parameter that is not split is copied, not
    gathered)."""
    if grad_sync.held is None:
        return ()
    specs, unit_of = _refresh_plan(grad_sync, grad_sync.specs)
    rest = itertools.count()
    gathers: list[StepGather] = []
    for bucket in shard_buckets(specs, grad_sync.routed, bucket_bytes, unit_of):
        if bucket[0].communicates:
            unit = bucket[0].unit
            name = unit if unit else f"rest.{next(rest)}"
            nbytes = sum(item.nbytes for item in bucket)
            group = bucket[0].spec.group_name
            seconds = cost_model.collective_seconds(nbytes, cost_model.costs_for(group))
            gathers.append(StepGather(name, tuple(item.spec.fqn for item in bucket), nbytes, group, seconds))
    return tuple(gathers)


def convert_held(grad_sync: GradSync, names: list[str], fn: Any) -> None:
    """Apply ``fn`` (a conversion of ``nn.Module._apply``) to the held tensors of
    parameters ``names``, keeping a compute dtype the configuration fixed."""
    held = grad_sync.held
    assert held is not None  # a "shard_optimizer" model's
    with torch.no_grad():
        for name in names:
            spec = grad_sync.specs[name]
            converted = fn(held[name])
            held[name] = converted.to(spec.param_dtype) if spec.param_dtype is not None else converted


def _refresh_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _HOLDING:  # (the hook stays registered: every optimizer's step passes here)
        return
    stepped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    for grad_sync in list(_HOLDING):
        names = [name for name, param in grad_sync.routed.items() if id(param) in stepped]
        if names:
            refresh_held(grad_sync, names)


def _refresh_loaded(grad_sync: weakref.ref[GradSync], module: nn.Module, incompatible_keys: Any) -> None:
    state = grad_sync()
    if state is not None:
        refresh_held(state, list(state.routed))
