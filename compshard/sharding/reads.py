"""The read path: what ``module.<name>`` returns for a sharded parameter, and when it gathers.

A read of ``module.<name>`` inside the model's forward (and a backward's recompute of it)
goes through ``compshard::unshard`` (a class-level property installed on a per-class
subclass: :func:`sharded_property`), so Dynamo captures one unshard per access and eager
execution gathers for real; inside ``compshard.sharding.step_gather.gathered_for_step``
it returns the tensor gathered for the step instead. Outside a forward, as with FSDP2, a
read is local and cheap: it returns the stored ``Parameter`` (this rank's ``Shard(0)``
rows as a DTensor), and ``.full_tensor()`` on it is the explicit collective that every
rank of the shard group must call. Were such a read to gather, one rank reading alone
(logging a norm, a debugger) would issue a collective the others do not, pair it with
their next one, and every later step would train on shifted rows. "In forward" is
counted by forward hooks on the root and on each sharded module outside a gather unit
(:func:`install_forward_scopes`; a unit's call is its own scope). Compiled graphs take
each DTensor's local tensor as their input (a leaf whose gradient
:mod:`compshard.sharding.grad_routing` moves to the parameter's ``grad``), never the
DTensor.

What gets read may depend on the data: transformers' loop over the experts a batch
routed to reads the 3-D expert weights once per expert hit, and a ``ModuleList`` of
expert modules calls only the experts hit, a different set on each rank. So a *gather
unit* gathers the parameters it covers on entry to each call, and reads inside the call
return those tensors, however often the data read them, or not at all
(:func:`install_gather_units`). Each repeated block (``layers.3``, see
:mod:`compshard.module_tree`) is a unit covering every parameter beneath it, as FSDP2
gathers per wrapped block, so an expert module one rank skips is gathered on every rank
all the same; outside blocks, each module is a unit of its own parameters. The gathered
tensors are dropped when the call returns, as FSDP2 reshards after a module's forward.
The gradients' reductions follow the same discipline
(:mod:`compshard.sharding.eager_reductions`), and every rank is checked to be at the
same gather (:mod:`compshard.sharding.call_agreement`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.module_tree import module_of, outermost_match, repeated_block, repeated_containers
from compshard.sharding import call_agreement, eager_reductions
from compshard.sharding.grad_sync import GradSync
from compshard.sharding.spec import ParamSpec
from compshard.sharding.state import ForwardDepth, MemberModule, MemberReads, ModuleState, has_state, state_of
from compshard.torch_compat import constant_lookup

__all__ = ["install_forward_scopes", "install_gather_units", "needs_call_scope", "sharded_property"]


def _local_rows(param: nn.Parameter) -> torch.Tensor:
    """The rows of ``param`` this rank holds, as ``unshard``'s input. Uncompiled: through
    ``to_local``, whose backward hands the gradient to the DTensor. Compiled: the DTensor's
    local tensor itself, a leaf whose gradient ``grad_routing.move_local_gradients`` moves
    to the parameter, so the graph takes plain tensors (a DTensor input makes Dynamo and
    AOTAutograd trace it as a tensor subclass: 15 to 25% of a first step's time). A frozen
    parameter's rows are detached either way (its local tensor requires gradients, so
    that unfreezing it later needs nothing more). :func:`_gather_compiled` writes the
    compiled branch out; ``tests/test_compile_time.py`` holds both to the same graph."""
    if not isinstance(param, DTensor):
        return param
    if not param.requires_grad:
        return param._local_tensor.detach()
    return param._local_tensor if torch.compiler.is_compiling() else param.to_local()


def sharded_property(name: str) -> property:
    """The class attribute that answers reads of sharded parameter ``name``."""

    def get(self: nn.Module) -> torch.Tensor:
        if torch.compiler.is_compiling() or _in_forward(self):
            return _read(self, name)
        param = self._parameters[name]
        assert param is not None  # shard registered it
        return param

    return property(
        get,
        doc=f"'{name}': in the model's forward gathered to its full shape (compshard::unshard); "
        "elsewhere the stored shard Parameter",
    )


def _in_forward(module: nn.Module) -> bool:
    """Whether a read of ``module``'s parameters is inside the model's forward."""
    state = state_of(module)
    assert state.forward is not None  # install_forward_scopes'
    unit = state.unit
    return state.forward.depth > 0 or (unit is not None and bool(state_of(unit).calls)) or _recomputing()


def _recomputing() -> bool:
    """Whether the model's code runs again inside a backward, where autograd records (a
    reentrant checkpoint's recompute, a reversible block's reconstruction): its reads are
    forward reads, though no forward hook counts them (the recompute may call a module's
    ``forward`` function itself, as transformers' checkpointing does)."""
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1


def _enter_forward(forward: ForwardDepth, module: nn.Module, args: Any) -> None:
    forward.depth += 1


def _leave_forward(forward: ForwardDepth, module: nn.Module, args: Any, output: Any) -> None:
    forward.depth -= 1


def install_forward_scopes(root: nn.Module) -> None:
    """Count the forwards of ``root`` and of its sharded modules outside gather units
    (see the module docstring), for every sharded module's reads; check at the end of
    each uncompiled forward that every rank is there (:mod:`compshard.sharding.call_agreement`)."""
    forward = ForwardDepth()
    for sub in root.modules():
        owns = has_state(sub) and bool(state_of(sub).specs)
        if sub is root or owns:
            state_of(sub).forward = forward
        if sub is root or (owns and state_of(sub).unit is None):
            sub.register_forward_pre_hook(functools.partial(_enter_forward, forward))
            sub.register_forward_hook(functools.partial(_leave_forward, forward), always_call=True)
    owner = next((sub for sub in root.modules() if has_state(sub) and state_of(sub).specs), None)
    if owner is not None:
        name, spec = next(iter(state_of(owner).specs.items()))
        param = owner._parameters[name]
        assert param is not None  # shard registered it
        root.register_forward_hook(functools.partial(_agree_forward_end, spec, param))


def _agree_forward_end(spec: ParamSpec, param: nn.Parameter, root: nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_compiling() and state_of(root).grad_sync.step_gathered is None:
        _agree(call_agreement.FORWARD_END, "", spec, param)


@dataclass(frozen=True)
class _Read:
    """What ``shard`` fixes about the reads of one sharded parameter: its spec, whether a
    tensor-parallel plan placed it (its layout is read from the module: a method call on a
    Dynamo constant cannot be traced), and ``compshard::unshard``'s arguments after the
    shard when no gradient sink is claimed."""

    spec: ParamSpec
    placed: bool
    reduce_args: tuple[str, None]


@constant_lookup
def _read_of(module: nn.Module, name: str) -> _Read:
    """The fixed facts of ``module``'s sharded parameter ``name``. Dynamo takes the result
    as a constant, guarding only the module's identity: guards on each field of the spec
    made compiling slow and added nothing (not with torch 2.11: see ``constant_lookup``)."""
    state = state_of(module)
    spec = state.specs[name]
    placed = state.tensor_parallel is not None and name in state.tensor_parallel
    return _Read(spec, placed, (spec.unshard_specs["reduce"], None))


@constant_lookup
def _canonical_name(module: nn.Module, name: str) -> str:
    """The canonical name of ``module``'s sharded parameter ``name`` (a constant for Dynamo)."""
    return state_of(module).specs[name].fqn


@constant_lookup
def _members_of(unit: nn.Module) -> tuple[MemberModule, ...]:
    """The modules and parameters ``unit`` gathers on entry to each call, in registration
    order (a constant for Dynamo: :func:`install_gather_units` fixes them)."""
    return state_of(unit).members


@constant_lookup
def _compiled_reads(unit: nn.Module) -> tuple[MemberReads, ...] | None:
    """``unit``'s :func:`_unit_reads`, for Dynamo a constant (guarding the unit's identity)."""
    return state_of(unit).compiled_reads


def _read(module: nn.Module, name: str) -> torch.Tensor:
    """``module.<name>`` in the forward: the tensor its unit gathered on entry to the
    current call, or gathered now (a read outside a call of the unit, e.g. by a module of
    another unit, or a read of the root's own parameters: ``shard`` gives the root module
    no call scope, since its hooks would run outside its compiled forward as graphs of
    their own), where every rank must be (:mod:`compshard.sharding.call_agreement`)."""
    state = state_of(module)
    unit = state.unit
    if unit is not None:
        calls = state_of(unit).calls
        if calls:
            return calls[-1][_canonical_name(module, name)]
    grad_sync = state.grad_sync
    if not torch.compiler.is_compiling() and grad_sync.step_gathered is None:
        spec = state.specs[name]
        _agree(spec.fqn, module_of(spec.fqn), spec, module._parameters[name])
    return _unshard(module, name, grad_sync)


def _unshard(module: nn.Module, name: str, state: GradSync) -> torch.Tensor:
    """``module.<name>`` gathered across the shard group; a parameter that a
    tensor-parallel plan placed comes back as the plan's DTensor (:mod:`compshard.tensor_parallel`).
    ``state``: the gradient-sync state of the model. Compiled, every line here is traced
    at every parameter read: keep it short."""
    read = _read_of(module, name)
    spec = read.spec
    if state.step_gathered is not None:  # step_gather: gathered once for the step
        full = state.step_gathered.get(spec.fqn)
        if full is None:
            raise RuntimeError(
                f"compshard: parameter '{spec.fqn}' read after reduce_accumulated_gradients "
                "released it, ending its step (compshard.sharding.gathered_for_step)"
            )
    else:
        param = module._parameters[name]
        assert param is not None  # shard registered it
        shard = _local_rows(param)
        if spec.compute_device is not None:
            shard = shard.to(spec.compute_device, non_blocking=True)
        # with no gradient sink (no_sync never used), every read claims ("reduce", None)
        grad_sync = "reduce"
        if state.sinks:
            grad_sync, grad_sink = state.claim(spec.fqn)
            args = (spec.unshard_specs[grad_sync], grad_sink)
        else:
            args = read.reduce_args
        # "shard_optimizer": the full tensor held between steps (compshard.sharding.held_params)
        held = state.held[spec.fqn] if state.held is not None else None
        if torch.compiler.is_compiling():
            # local gradient norms (compshard.sharding.grad_norms): an accumulated gradient's
            # norm is taken at its sink, a reduced one's in the graph
            norms = state.norms
            norm_sink = norms.sink_for(spec.fqn) if norms is not None and grad_sync != "accumulate" else None
            if norm_sink is not None or held is not None:
                full = torch.ops.compshard.unshard(shard, *args, norm_sink, held)
            else:
                full = torch.ops.compshard.unshard(shard, *args)
        else:
            communicates = spec.world_size > 1 or bool(spec.replicate_group)
            full = eager_reductions.gather(param, shard, args, state.eager, communicates, held)
    if not read.placed:
        return full
    tensor_parallel = state_of(module).tensor_parallel
    assert tensor_parallel is not None  # shard's
    return tensor_parallel[name].placed(full)


def _agree(place: str, module: str, spec: ParamSpec, param: nn.Parameter | None) -> None:
    """:func:`compshard.sharding.call_agreement.agree` on the group that ``spec``'s parameter
    (``param``) communicates in: its shard group, or its replica group where it is not
    split (its gradient's reduction is its one collective)."""
    group = spec.group_name if spec.world_size > 1 else spec.replicate_group
    if group:
        assert param is not None  # shard registered it
        call_agreement.agree(place, module, group, spec.compute_device or param.device)


def _submodule(unit: nn.Module, path: tuple[str, ...]) -> nn.Module:
    """The module at ``path`` (child names) beneath ``unit``."""
    module = unit
    for child in path:
        found = module._modules[child]
        assert found is not None  # install_gather_units found it there
        module = found
    return module


def _gather_members(unit: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors ``unit`` gathers on entry to a call, by canonical name, in member order.
    The gradient-sync state is read once, from the unit, not once per parameter (each
    extra read of that shared object is a Dynamo guard)."""
    members = _members_of(unit)
    unit_state = state_of(unit)
    state = unit_state.grad_sync
    if not torch.compiler.is_compiling() and state.step_gathered is None and members:
        first = _submodule(unit, members[0].path)
        name = members[0].names[0][0]
        path = unit_state.unit_path
        _agree(path, path, state_of(first).specs[name], first._parameters[name])
    if (
        torch.compiler.is_compiling()
        and state.step_gathered is None
        and not state.sinks
        and state.norms is None
        and state.held is None
    ):
        reads = _compiled_reads(unit)
        if reads is not None:
            return _gather_compiled(unit, reads)
    gathered = {}
    for member in members:
        module = _submodule(unit, member.path)
        for name, fqn in member.names:
            gathered[fqn] = _unshard(module, name, state)
    return gathered


def _unit_reads(unit: nn.Module) -> tuple[MemberReads, ...] | None:
    """What a compiled call of ``unit`` gathers on entry when no gradient sink is claimed
    and no step gather holds the parameters, fixed by ``shard``; None when a member is
    placed by a tensor-parallel plan or offloaded (those take :func:`_unshard`)."""
    reads = []
    for member in state_of(unit).members:
        module = _submodule(unit, member.path)
        params = []
        for name, fqn in member.names:
            read = _read_of(module, name)
            if read.placed or read.spec.compute_device is not None:
                return None
            spec, grad_sink = read.reduce_args
            assert grad_sink is None  # no sink claimed: the only case this path takes
            params.append((name, fqn, spec, isinstance(module._parameters[name], DTensor)))
        reads.append((member.path, tuple(params)))
    return tuple(reads)


def _gather_compiled(unit: nn.Module, reads: tuple[MemberReads, ...]) -> dict[str, torch.Tensor]:
    """:func:`_gather_members` while compiling, from ``reads``: what :func:`_unshard` does
    for these parameters (:func:`_local_rows`' compiled branch written out, the arguments
    as constants) in the fewest traced instructions, each of which costs Dynamo time per
    parameter of the model."""
    gathered = {}
    unshard = torch.ops.compshard.unshard  # looked up once, not per parameter
    for path, params in reads:
        module = _submodule(unit, path)
        for name, fqn, spec, sharded in params:
            param = module._parameters[name]
            assert param is not None  # shard registered it
            rows = param  # one rank: the parameter is a plain tensor
            if sharded:  # a constant (a DTensor, as ``shard`` found it): Dynamo traces one branch
                local = param._local_tensor  # type: ignore[attr-defined]  # no isinstance: one traced step less
                rows = local if param.requires_grad else local.detach()
            gathered[fqn] = unshard(rows, spec, None)
    return gathered


def _enter_call(unit: nn.Module, args: Any) -> None:
    state = state_of(unit)
    reductions = None if torch.compiler.is_compiling() else state.grad_sync.eager
    if reductions is not None:
        reductions.open_call = []
    try:
        gathered = _gather_members(unit)
    finally:
        if reductions is not None:
            reductions.open_call = None
    state.calls.append(gathered)


def _exit_call(unit: nn.Module, args: Any, output: Any) -> None:
    calls = state_of(unit).calls
    if calls:
        calls.pop()


# torch.nn modules whose forward reads each parameter exactly once, whatever the data:
# a gather at that read is the gather at call entry, so they need no call scope (and
# compile faster without its hooks: fewer traced calls and guards per module).
_READS_EACH_PARAMETER_ONCE = frozenset(
    cls.forward
    for cls in (
        nn.Linear,
        nn.Bilinear,
        nn.Embedding,
        nn.LayerNorm,
        nn.GroupNorm,
        nn.RMSNorm,
        nn.PReLU,
        nn.Conv1d,
        nn.Conv2d,
        nn.Conv3d,
        nn.ConvTranspose1d,
        nn.ConvTranspose2d,
        nn.ConvTranspose3d,
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
    )
)


def needs_call_scope(module: nn.Module) -> bool:
    """Whether ``module``'s reads of its parameters could differ from one gather each at
    call entry: any module but the torch.nn ones above with their own ``forward``."""
    return type(module).forward not in _READS_EACH_PARAMETER_ONCE


def install_gather_units(root: nn.Module, patterns: Sequence[str]) -> None:
    """Give every sharded parameter its gather unit: the outermost module matching
    ``patterns``, else the outermost repeated block it lies in, either covering every
    parameter beneath it; else its own module, unless that is a torch.nn layer that reads
    each parameter once (a gather at the read is the gather at entry) or the root (whose
    hooks would run outside its compiled forward, as graphs of their own).

    A unit gathers its members (one entry per distinct parameter, in registration order)
    on entry to each call; reads of them inside the call return those tensors, whatever
    the data decide to read. Compiled, the gathers are traced at the call's entry in
    whichever graph holds the call, so a graph break inside the unit's code leaves them
    where they are."""
    owners: dict[int, tuple[str, nn.Module]] = {}
    for prefix, sub in root.named_modules(remove_duplicate=False):
        if has_state(sub) and state_of(sub).specs:
            owners.setdefault(id(sub), (prefix, sub))
    containers = repeated_containers(prefix for prefix, _ in owners.values())
    units: dict[int, tuple[nn.Module, str, dict[str, tuple[nn.Module, str]]]] = {}
    for prefix, sub in owners.values():
        block = outermost_match(prefix, patterns) or repeated_block(prefix, containers)
        if block is not None:
            unit, path = root.get_submodule(block), block
        elif sub is not root and needs_call_scope(sub):
            unit, path = sub, prefix
        else:
            continue
        members = units.setdefault(id(unit), (unit, path, {}))[2]
        for name, spec in state_of(sub).specs.items():
            members.setdefault(spec.fqn, (sub, name))
    for unit, path, members in units.values():
        if all(module is unit for module, _ in members.values()) and not needs_call_scope(unit):
            continue  # a block that is one torch.nn layer: it reads each parameter once anyway
        _install_call_scope(unit, path, list(members.values()))


def _install_call_scope(unit: nn.Module, path: str, members: list[tuple[nn.Module, str]]) -> None:
    """Make ``unit`` (at ``path`` in the model) a gather unit of ``members`` (``(module,
    name)`` pairs, each module beneath ``unit``)."""
    paths: dict[int, tuple[str, ...]] = {}
    for prefix, module in unit.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), tuple(prefix.split(".")) if prefix else ())
    grouped: list[tuple[nn.Module, list[tuple[str, str]]]] = []
    for module, name in members:
        if not grouped or grouped[-1][0] is not module:
            grouped.append((module, []))
        grouped[-1][1].append((name, state_of(module).specs[name].fqn))
        state_of(module).unit = unit
    if not has_state(unit):
        unit._compshard = ModuleState(state_of(members[0][0]).grad_sync)  # type: ignore[assignment]  # any value
    state = state_of(unit)
    state.unit_path = path
    state.members = tuple(MemberModule(paths[id(module)], tuple(names)) for module, names in grouped)
    state.compiled_reads = _unit_reads(unit)
    unit.register_forward_pre_hook(_enter_call)
    unit.register_forward_hook(_exit_call, always_call=True)
