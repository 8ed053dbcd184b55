"""``shard``: replace a module's parameters by this rank's ``Shard(0)`` rows, in place.

At rest each parameter is an ``nn.Parameter`` wrapping a DTensor placed ``Shard(0)`` on a
1-D mesh (``Replicate()`` for 0-d parameters; ``(Replicate(), Shard(0))`` on the 2-D mesh
of ``"hybrid_shard"``; ``Replicate()`` under ``"no_shard"``), so torch optimizers,
``clip_grad_norm_`` and ``torch.distributed.checkpoint`` see ordinary DTensors. With no
process group initialized the world is one rank and parameters stay plain tensors.

Strategies reduce to two process groups per parameter: the *shard group* its rows are
split over and gathered within (one rank for ``"no_shard"``), and the *replica group*
its reduced gradient is all-reduced across afterwards (none for ``"full_shard"`` and
``"shard_grad_op"``). ``"shard_grad_op"`` is ``"full_shard"`` with gathered parameters kept
from forward to backward.

A read of ``module.<name>`` inside the model's forward (and a backward's recompute of it)
goes through ``compshard::unshard`` (a class-level property installed on a per-class
subclass), so Dynamo captures one unshard per access and eager execution gathers for
real; inside ``compshard.step_gather.gathered_for_step`` it returns the tensor gathered
for the step instead. Outside a forward, as with FSDP2, a read is local and cheap: it
returns the stored ``Parameter`` (this rank's ``Shard(0)`` rows as a DTensor), and
``.full_tensor()`` on it is the explicit collective that every rank of the shard group
must call. Were such a read to gather, one rank reading alone (logging a norm, a
debugger) would issue a collective the others do not, pair it with their next one, and
every later step would train on shifted rows. "In forward" is counted by forward hooks
on the module given to ``shard`` and on each sharded module outside a gather unit (a
gather unit's call is its own scope: :mod:`compshard.eager_gather`). Compiled graphs take each DTensor's local tensor
as their input (a leaf whose gradient is moved to the parameter's ``grad``), never the
DTensor. ``state_dict`` and ``named_parameters`` read ``_parameters``
directly and keep the original names. Tied parameters stay tied: one sharded Parameter
is registered under every name the original was.
"""

from __future__ import annotations

import fnmatch
import functools
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from compshard import call_agreement, cost_model, eager_gather, sharded_init, tensor_parallel
from compshard.comm import liveness, ops
from compshard.grad_sync import GradSync
from compshard.module_tree import module_of, outermost_match, repeated_block, repeated_containers
from compshard.torch_compat import constant_lookup

__all__ = [
    "shard",
    "sharding_config",
    "ShardingConfig",
    "ParamSpec",
    "param_specs",
    "is_sharded",
    "plain_class",
    "STRATEGIES",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

Strategy = Literal["full_shard", "shard_grad_op", "no_shard", "hybrid_shard"]
STRATEGIES: tuple[str, ...] = get_args(Strategy)


@dataclass(frozen=True)
class ShardingConfig:
    """How a module was sharded: what ``compshard.sharding_config(module)`` returns.

    ``shard_size`` ranks hold one copy of the parameters between them; ``replicate_size``
    such copies exist (``shard_size * replicate_size`` data-parallel ranks in all).
    ``offload``: ``"off"``, ``"pinned_cpu"`` (shards, gradients and optimizer state in
    pinned CPU memory, the optimizer stepping on CPU) or ``"nothing_to_offload"`` (asked
    for on a CPU-only run, where everything already lives in CPU memory).
    ``gather_units``: the patterns given (``None``: repeated blocks only).
    """

    strategy: str
    shard_size: int
    replicate_size: int
    reshard_after_forward: bool
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    output_dtype: torch.dtype | None
    cast_forward_inputs: bool
    buffer_dtype: torch.dtype | None
    offload: str
    gather_units: tuple[str, ...] | None


@dataclass(frozen=True)
class ParamSpec:
    """What the unshard op needs for one parameter; the same on every rank."""

    fqn: str  # canonical name (the first under which the parameter is registered)
    full_shape: tuple[int, ...]
    world_size: int  # ranks of the shard group
    group_name: str  # the shard group; "" when it is one rank
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    replicate_group: str  # the group gradients are all-reduced across after reduce-scatter; "" when none
    compute_device: torch.device | None  # offload: where the shard is copied to before gathering

    # compshard::unshard's spec argument per gradient sync mode (see compshard.comm.ops'
    # [Note: one spec argument]), derived from the fields above. A stored field, not a
    # method: Dynamo would trace a method's code at every parameter read.
    unshard_specs: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        args = ops.UnshardArgs(
            shard=None,
            full_shape=list(self.full_shape),
            world_size=self.world_size,
            group_name=self.group_name,
            param=self.fqn,
            param_dtype=self.param_dtype,
            reduce_dtype=self.reduce_dtype,
            reshard_after_forward=self.reshard_after_forward,
            replicate_group=self.replicate_group,
            grad_sync="reduce",
            grad_sink=None,
        )
        specs = {mode: args._replace(grad_sync=mode).spec() for mode in ops.GRAD_SYNC_MODES}
        object.__setattr__(self, "unshard_specs", specs)

    def layout(self, rank: int) -> ops.ShardLayout:
        return ops.ShardLayout(self.full_shape, self.world_size, rank)


def _local_rows(param: nn.Parameter) -> torch.Tensor:
    """The rows of ``param`` this rank holds, as ``unshard``'s input. Uncompiled: through
    ``to_local``, whose backward hands the gradient to the DTensor. Compiled: the DTensor's
    local tensor itself, a leaf whose gradient :func:`move_local_gradients` moves to the
    parameter, so the graph takes plain tensors (a DTensor input makes Dynamo and
    AOTAutograd trace it as a tensor subclass: 15 to 25% of a first step's time). A frozen
    parameter's rows are detached either way (its local tensor requires gradients, so
    that unfreezing it later needs nothing more). :func:`_gather_compiled` writes the
    compiled branch out; ``tests/test_compile_time.py`` holds both to the same graph."""
    if not isinstance(param, DTensor):
        return param
    if not param.requires_grad:
        return param._local_tensor.detach()
    return param._local_tensor if torch.compiler.is_compiling() else param.to_local()


def _sharded_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        if torch.compiler.is_compiling() or _in_forward(self):
            return eager_gather.read(self, name, _unshard_read)
        param = self._parameters[name]
        assert param is not None  # shard registered it
        return param

    return property(
        get,
        doc=f"'{name}': in the model's forward gathered to its full shape (compshard::unshard); "
        "elsewhere the stored shard Parameter",
    )


@dataclass
class _ForwardDepth:
    """How many forwards of one sharded model's modules are running (uncompiled: compiled
    graphs gather whatever it says)."""

    depth: int = 0


def _in_forward(module: nn.Module) -> bool:
    """Whether a read of ``module``'s parameters is inside the model's forward."""
    unit = getattr(module, "_compshard_unit", None)
    forward = module._compshard_forward
    assert isinstance(forward, _ForwardDepth)  # _install_forward_scopes'
    return forward.depth > 0 or (unit is not None and bool(unit[0]._compshard_calls)) or eager_gather.recomputing()


def _enter_forward(forward: _ForwardDepth, module: nn.Module, args: Any) -> None:
    forward.depth += 1


def _leave_forward(forward: _ForwardDepth, module: nn.Module, args: Any, output: Any) -> None:
    forward.depth -= 1


def _install_forward_scopes(root: nn.Module) -> None:
    """Count the forwards of ``root`` and of its sharded modules outside gather units
    (see the module docstring), for every sharded module's reads."""
    forward = _ForwardDepth()
    for sub in root.modules():
        if sub is root or hasattr(sub, "_compshard_specs"):
            sub._compshard_forward = forward  # type: ignore[assignment]  # any value; stubs: Tensor | Module
        if sub is root or (hasattr(sub, "_compshard_specs") and not hasattr(sub, "_compshard_unit")):
            sub.register_forward_pre_hook(functools.partial(_enter_forward, forward))
            sub.register_forward_hook(functools.partial(_leave_forward, forward), always_call=True)
    owner = next((sub for sub in root.modules() if getattr(sub, "_compshard_specs", None)), None)
    if owner is not None:  # every rank at the end of each uncompiled forward (compshard.call_agreement)
        name, spec = next(iter(_specs(owner).items()))
        param = owner._parameters[name]
        assert param is not None  # shard registered it
        root.register_forward_hook(functools.partial(_agree_forward_end, spec, param))


def _agree_forward_end(spec: ParamSpec, param: nn.Parameter, root: nn.Module, args: Any, output: Any) -> None:
    if not torch.compiler.is_compiling() and _grad_sync(root).step_gathered is None:
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
    layouts = getattr(module, "_compshard_tensor_parallel", None)
    spec = _specs(module)[name]
    return _Read(spec, layouts is not None and name in layouts, (spec.unshard_specs["reduce"], None))


def _specs(module: nn.Module) -> dict[str, ParamSpec]:
    """The specs ``shard`` recorded for ``module``'s own sharded parameters, by name."""
    specs = module._compshard_specs
    assert isinstance(specs, dict)
    return specs


def _grad_sync(module: nn.Module) -> GradSync:
    state = module._compshard_grad_sync
    assert isinstance(state, GradSync)  # shard's
    return state


def _unshard(module: nn.Module, name: str, state: GradSync) -> torch.Tensor:
    """``module.<name>`` gathered across the shard group; a parameter that a
    tensor-parallel plan placed comes back as the plan's DTensor (:mod:`compshard.tensor_parallel`).
    ``state``: the gradient-sync state of the model (``module._compshard_grad_sync``).
    Compiled, every line here is traced at every parameter read: keep it short."""
    read = _read_of(module, name)
    spec = read.spec
    if state.step_gathered is not None:  # compshard.step_gather: gathered once for the step
        full = state.step_gathered.get(spec.fqn)
        if full is None:
            raise RuntimeError(
                f"compshard: parameter '{spec.fqn}' read after reduce_accumulated_gradients "
                "released it, ending its step (compshard.step_gather.gathered_for_step)"
            )
    else:
        param = module._parameters[name]
        assert param is not None  # shard registered it
        shard = _local_rows(param)
        if spec.compute_device is not None:
            shard = shard.to(spec.compute_device, non_blocking=True)
        # with no gradient sink (no_sync never used), every read claims ("reduce", None)
        if state.sinks:
            grad_sync, grad_sink = state.claim(spec.fqn)
            args = (spec.unshard_specs[grad_sync], grad_sink)
        else:
            args = read.reduce_args
        if torch.compiler.is_compiling():
            full = torch.ops.compshard.unshard(shard, *args)
        else:
            communicates = spec.world_size > 1 or bool(spec.replicate_group)
            full = eager_gather.gather(param, shard, args, state.eager, communicates)
    if not read.placed:
        return full
    layouts = module._compshard_tensor_parallel
    assert isinstance(layouts, dict)  # shard's
    return layouts[name].placed(full)


def _unshard_read(module: nn.Module, name: str) -> torch.Tensor:
    """A read's gather of ``module.<name>`` (outside its unit's call, or without a unit),
    where every rank must be (:mod:`compshard.call_agreement`)."""
    state = _grad_sync(module)
    if not torch.compiler.is_compiling() and state.step_gathered is None:
        spec = _specs(module)[name]
        _agree(spec.fqn, module_of(spec.fqn), spec, module._parameters[name])
    return _unshard(module, name, state)


def _unit_path(unit: nn.Module) -> str:
    """The module path of gather unit ``unit`` in the sharded model."""
    path = unit._compshard_unit_path
    assert isinstance(path, str)  # _install_gather_units'
    return path


def _agree(place: str, module: str, spec: ParamSpec, param: nn.Parameter | None) -> None:
    """:func:`compshard.call_agreement.agree` on the group that ``spec``'s parameter
    (``param``) communicates in: its shard group, or its replica group where it is not
    split (its gradient's reduction is its one collective)."""
    group = spec.group_name if spec.world_size > 1 else spec.replicate_group
    if group:
        assert param is not None  # shard registered it
        call_agreement.agree(place, module, group, spec.compute_device or param.device)


def _gather_members(unit: nn.Module, members: tuple[eager_gather.MemberModule, ...]) -> dict[str, torch.Tensor]:
    """The tensors ``unit`` gathers on entry to a call, by canonical name, in member order.
    The gradient-sync state is read once, from the unit, not once per parameter (each
    extra read of that shared object is a Dynamo guard)."""
    state = _grad_sync(unit)
    if not torch.compiler.is_compiling() and state.step_gathered is None and members:
        first = eager_gather.submodule(unit, members[0].path)
        name = members[0].names[0][0]
        _agree(_unit_path(unit), _unit_path(unit), _specs(first)[name], first._parameters[name])
    if torch.compiler.is_compiling() and state.step_gathered is None and not state.sinks:
        reads = _compiled_reads(unit)
        if reads is not None:
            return _gather_compiled(unit, reads)
    gathered = {}
    for member in members:
        module = eager_gather.submodule(unit, member.path)
        for name, fqn in member.names:
            gathered[fqn] = _unshard(module, name, state)
    return gathered


# a gather unit's member module: its path from the unit and, per parameter it gathers,
# (attribute name, canonical name, compshard::unshard's spec, whether the parameter is a
# DTensor: its rows are its local tensor)
_MemberReads = tuple[tuple[str, ...], tuple[tuple[str, str, str, bool], ...]]


def _unit_reads(unit: nn.Module) -> tuple[_MemberReads, ...] | None:
    """What a compiled call of ``unit`` gathers on entry when no gradient sink is claimed
    and no step gather holds the parameters, fixed by ``shard``; None when a member is
    placed by a tensor-parallel plan or offloaded (those take :func:`_unshard`)."""
    reads = []
    for member in eager_gather.members_of(unit):
        module = eager_gather.submodule(unit, member.path)
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


@constant_lookup
def _compiled_reads(unit: nn.Module) -> tuple[_MemberReads, ...] | None:
    """``unit``'s :func:`_unit_reads`, for Dynamo a constant (guarding the unit's identity)."""
    reads = unit._compshard_compiled_reads
    assert reads is None or isinstance(reads, tuple)  # _install_gather_units'
    return reads


def _gather_compiled(unit: nn.Module, reads: tuple[_MemberReads, ...]) -> dict[str, torch.Tensor]:
    """:func:`_gather_members` while compiling, from ``reads``: what :func:`_unshard` does
    for these parameters (:func:`_local_rows`' compiled branch written out, the arguments
    as constants) in the fewest traced instructions, each of which costs Dynamo time per
    parameter of the model."""
    gathered = {}
    unshard = torch.ops.compshard.unshard  # looked up once, not per parameter
    for path, params in reads:
        module = eager_gather.submodule(unit, path)
        for name, fqn, spec, sharded in params:
            param = module._parameters[name]
            assert param is not None  # shard registered it
            rows = param  # one rank: the parameter is a plain tensor
            if sharded:  # a constant (a DTensor, as ``shard`` found it): Dynamo traces one branch
                local = param._local_tensor  # type: ignore[attr-defined]  # no isinstance: one traced step less
                rows = local if param.requires_grad else local.detach()
            gathered[fqn] = unshard(rows, spec, None)
    return gathered


_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _install_properties(module: nn.Module, names: tuple[str, ...]) -> None:
    base = type(module)
    key = (base, names)
    if key not in _SHARDED_CLASSES:
        attrs: dict[str, Any] = {name: _sharded_property(name) for name in names}
        attrs["_apply"] = _sharded_apply(base)
        _SHARDED_CLASSES[key] = type(f"Sharded{base.__name__}", (base,), attrs)
    module.__class__ = _SHARDED_CLASSES[key]


# [Note: conversions of a sharded module]
# ``module.to(...)``, ``.float()``, ``.bfloat16()``, ``.cpu()``, ``.to_empty(...)`` all run
# ``nn.Module._apply(fn)``, which for a DTensor parameter builds ``Parameter(fn(param))`` and
# swaps it into the existing parameter object (``torch.utils.swap_tensors``): the object an
# optimizer or a framework holds stays the same, its shard is converted. Two things follow.
# The swap refuses a parameter that anything references weakly, so compshard keeps its
# registries of parameters by strong reference (``GradSync.routed``). And the swapped-in
# local tensor is a fresh detached tensor, so each sharded module's ``_apply`` makes it a
# gradient leaf again (:func:`_route_local_gradients`), as FSDP2 refreshes its per-parameter
# record after ``_apply``. What a conversion cannot keep consistent is refused before any
# parameter changes: a move of shards off their mesh's device type (every rank's shards
# live where its mesh's collectives run), or any device move of offloaded shards.
_CONVERTING: list[nn.Module] = []  # the outermost sharded module whose _apply is running


def _sharded_apply(base: type[nn.Module]) -> Any:
    def _apply(self: nn.Module, fn: Any, recurse: bool = True) -> nn.Module:
        outermost = not _CONVERTING
        if outermost:
            _check_conversion(self, fn)
            _CONVERTING.append(self)
        try:
            result = base._apply(self, fn, recurse)
        finally:
            if outermost:
                _CONVERTING.pop()
        for param in self._parameters.values():
            if isinstance(param, DTensor):
                _route_local_gradients(param)
        return result

    _apply.__doc__ = "nn.Module._apply keeping the shards consistent ([Note: conversions of a sharded module])"
    return _apply


def _check_conversion(module: nn.Module, fn: Any) -> None:
    """Refuse ``fn`` (an ``_apply`` conversion) where it would move a sharded parameter off
    the device its shards must live on, naming the parameter and the devices, before any
    parameter of ``module`` changes. ``fn`` is tried on an empty tensor of each parameter's
    dtype and device (conversions act on any tensor alike)."""
    tried: dict[tuple[torch.dtype, torch.device], torch.device] = {}
    for sub in module.modules():
        for name, param in sub._parameters.items():
            spec = getattr(sub, "_compshard_specs", {}).get(name)
            if param is None or spec is None:
                continue
            key = (param.dtype, param.device)
            if key not in tried:
                with torch.no_grad():
                    tried[key] = fn(torch.empty(0, dtype=param.dtype, device=param.device)).device
            moved_to = tried[key]
            if spec.compute_device is not None and moved_to != param.device:
                raise ValueError(
                    f"compshard: a conversion (module.to(), .cuda(), .cpu(), .to_empty()) would move offloaded "
                    f"parameter '{spec.fqn}' from {param.device} to {moved_to}; with offload=True its shard stays "
                    "in pinned CPU memory and is copied to the GPU for each gather. Convert dtypes only, or shard "
                    "without offload"
                )
            if isinstance(param, DTensor) and moved_to.type != param.device_mesh.device_type:
                raise ValueError(
                    f"compshard: a conversion (module.to(), .cuda(), .cpu(), .to_empty()) would move parameter "
                    f"'{spec.fqn}' to {moved_to}, but compshard.shard placed its shards on a "
                    f"{param.device_mesh.device_type!r} device mesh, whose collectives need them there. Move the "
                    "model to its device before compshard.shard, or shard it with a mesh of that device type"
                )


def plain_class(cls: type) -> type | None:
    """The class a module had before ``shard`` gave it sharded parameter attributes (None:
    ``cls`` is not such a class)."""
    return cls.__bases__[0] if cls in _SHARDED_CLASSES.values() else None


def _check_dtype(option: str, value: torch.dtype | None) -> None:
    if value is not None and value not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"compshard.shard: {option}={value!r} is not allowed; use None or one of {allowed}")


def _check_flag(option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"compshard.shard: {option} must be True or False, got {value!r}")


def _default_mesh(module: nn.Module) -> DeviceMesh | None:
    """The default process group as a mesh of the parameters' device type; for a model
    on the meta device, of the device its collectives run on (``"cpu"`` for gloo, the
    current accelerator otherwise)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    devices = _devices(module)
    if not devices:  # all on meta
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        devices = {"cpu" if dist.get_backend() == "gloo" or accelerator is None else accelerator.type}
    device_type = devices.pop() if len(devices) == 1 else "cpu"
    world = dist.group.WORLD
    assert world is not None  # initialized
    return DeviceMesh.from_group(world, device_type)


def _check_mesh(strategy: str, mesh: Any) -> None:
    if strategy == "hybrid_shard":
        if not isinstance(mesh, DeviceMesh) or mesh.ndim != 2:
            raise ValueError(
                "compshard.shard: strategy='hybrid_shard' needs mesh=<2-D DeviceMesh> with dimensions "
                f"(replicate, shard), got {mesh!r}"
            )
    elif mesh is not None and (not isinstance(mesh, DeviceMesh) or mesh.ndim != 1):
        raise ValueError(
            f"compshard.shard: mesh must be a 1-D DeviceMesh or None for strategy={strategy!r} "
            f"(a 2-D mesh is for 'hybrid_shard'), got {mesh!r}"
        )


@dataclass(frozen=True)
class _Groups:
    """Where one parameter copy is split (shard) and across which ranks copies repeat."""

    shard_size: int
    shard_rank: int
    shard_group: str
    replicate_size: int
    replicate_group: str
    placements: tuple | None  # of a sharded parameter's DTensor at rest; None: plain tensors (one rank)


def _groups(strategy: str, mesh: DeviceMesh | None) -> _Groups:
    if mesh is None:
        return _Groups(1, 0, "", 1, "", None)
    if strategy == "hybrid_shard":
        return _Groups(
            mesh.size(1),
            mesh.get_local_rank(1),
            mesh.get_group(1).group_name,
            mesh.size(0),
            mesh.get_group(0).group_name,
            (Replicate(), Shard(0)),
        )
    if strategy == "no_shard":
        return _Groups(1, 0, "", mesh.size(), mesh.get_group().group_name, (Replicate(),))
    return _Groups(mesh.size(), mesh.get_local_rank(), mesh.get_group().group_name, 1, "", (Shard(0),))


def _resolve_reshard(strategy: str, reshard_after_forward: bool | None) -> bool:
    if reshard_after_forward is None:
        return strategy in ("full_shard", "hybrid_shard")
    _check_flag("reshard_after_forward", reshard_after_forward)
    if strategy == "shard_grad_op" and reshard_after_forward:
        raise ValueError(
            "compshard.shard: strategy='shard_grad_op' keeps parameters gathered from forward to "
            "backward; reshard_after_forward=True contradicts it (use 'full_shard', or leave it None)"
        )
    return reshard_after_forward


def _offload_device(offload: bool, module: nn.Module, mesh: DeviceMesh | None) -> tuple[str, torch.device | None]:
    """(the config's ``offload`` value, the compute device shards are copied to)."""
    _check_flag("offload", offload)
    if not offload:
        return "off", None
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            "compshard.shard: offload=True needs the parameters' values (they are copied into pinned CPU memory), "
            "but some are on the meta device: materialize the model first (to_empty, then its initialization), "
            "or shard without offload"
        )
    device_types = _devices(module) | ({mesh.device_type} if mesh is not None else set())
    if device_types <= {"cpu"}:
        warnings.warn(
            "compshard.shard: offload=True has nothing to offload on a CPU-only run: parameter shards, "
            "gradients and optimizer state already live in CPU memory",
            stacklevel=3,
        )
        return "nothing_to_offload", None
    if device_types != {"cuda"}:
        raise ValueError(
            f"compshard.shard: offload=True supports CUDA parameters (or a CPU-only run), got devices "
            f"{sorted(device_types)}"
        )
    return "pinned_cpu", torch.device("cuda", torch.cuda.current_device())


def _devices(module: nn.Module) -> set[str]:
    """The device types of ``module``'s parameters, the meta device aside."""
    return {p.device.type for p in module.parameters() if not p.is_meta}


def is_sharded(module: nn.Module) -> bool:
    return any(hasattr(m, "_compshard_specs") for m in module.modules())


def param_specs(module: nn.Module) -> dict[str, ParamSpec]:
    """Canonical parameter name -> spec, in parameter registration order."""
    specs: dict[str, ParamSpec] = {}
    for sub in module.modules():
        for spec in getattr(sub, "_compshard_specs", {}).values():
            specs.setdefault(spec.fqn, spec)
    return specs


def sharding_config(module: nn.Module) -> ShardingConfig:
    """The :class:`ShardingConfig` ``compshard.shard`` applied to ``module`` (the module it
    was called on)."""
    config = getattr(module, "_compshard_config", None)
    if config is None:
        raise ValueError("compshard.sharding_config: module was not passed to compshard.shard")
    return config


def _cast_floats(dtype: torch.dtype, value: Any) -> Any:
    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if torch.is_floating_point(t) else t

    return torch.utils._pytree.tree_map_only(torch.Tensor, cast, value)


def _install_casts(module: nn.Module, config: ShardingConfig) -> None:
    """Forward hooks of the root module, as FSDP2 does for its root: floating inputs to
    ``param_dtype`` (``cast_forward_inputs``), floating outputs to ``output_dtype``."""
    if config.cast_forward_inputs and config.param_dtype is not None:
        cast_inputs = functools.partial(_cast_floats, config.param_dtype)
        module.register_forward_pre_hook(lambda _, args, kwargs: cast_inputs((args, kwargs)), with_kwargs=True)
    if config.output_dtype is not None:
        cast_output = functools.partial(_cast_floats, config.output_dtype)
        module.register_forward_hook(lambda _, args, output: cast_output(output))


def shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    strategy: Strategy = "full_shard",
    reshard_after_forward: bool | None = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
    cast_forward_inputs: bool = True,
    buffer_dtype: torch.dtype | None = None,
    offload: bool = False,
    gather_units: Sequence[str] | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters across the data-parallel ranks, in place; return it.

    Args:
        mesh: the data-parallel ranks. ``None``: the default process group, or a single
            rank when none is initialized. A 1-D mesh, or for ``"hybrid_shard"`` a 2-D mesh
            whose dimensions are (replicate, shard).
        strategy: ``"full_shard"`` (ZeRO-3): parameters, gradients and optimizer state
            split across the ranks, parameters gathered for each use.
            ``"shard_grad_op"`` (ZeRO-2): as full_shard, but gathered parameters stay from
            forward to backward (one all-gather per step instead of two; the whole model's
            parameters held at the peak). ``"no_shard"`` (DDP): every rank holds everything;
            gradients are all-reduced. ``"hybrid_shard"``: split within each group of the
            mesh's shard dimension, replicated across its replicate dimension: all-gathers
            stay within a shard group; gradients are reduce-scattered within it, then
            all-reduced across replicas.
        reshard_after_forward: free gathered parameters after their last forward use and
            gather them again in backward. ``None``: as the strategy says (``False`` for
            ``"shard_grad_op"``, ``True`` otherwise).
        param_dtype: dtype parameters are gathered and computed in (``None``: their own).
            Shards stay in their dtype: they are the optimizer's master weights.
        reduce_dtype: dtype gradients are reduced (and accumulated, under ``no_sync``) in
            (``None``: the gradient's, i.e. ``param_dtype``'s). Gradients land on the shards
            in the shards' dtype.
        output_dtype: cast the module's floating-point outputs to this dtype (``None``: no
            cast).
        cast_forward_inputs: with ``param_dtype`` set, cast the module's floating-point
            inputs to it (as FSDP2 does).
        buffer_dtype: cast floating-point buffers to this dtype once, here (``None``: they
            keep their dtype). Buffers are never sharded.
        offload: keep parameter shards (and so gradients and optimizer state) in pinned
            CPU memory, the optimizer stepping on CPU; each use copies the shard to the GPU
            first. CUDA only: on a CPU-only run it is accepted with a warning, and
            ``sharding_config(module).offload`` is ``"nothing_to_offload"``.
        gather_units: module-name patterns (``fnmatch``, e.g. ``["moe"]``, ``["layers.*"]``)
            of modules that gather every parameter beneath them on entry to each call
            (the outermost match wins; every pattern must match a module). Beneath the
            other modules, each repeated block (``layers.3``) is such a unit, as FSDP2
            gathers per wrapped block. A module that the data decide to call on some
            ranks only (experts held as modules of a ``ModuleList``, called for the
            tokens routed to them) must lie inside a unit that every rank calls: inside a
            repeated block it does; a lone MoE layer outside any block needs its pattern
            here. The trade-off is memory: a unit's parameters are all gathered while it runs.

    Collective: parameters and buffers are first broadcast from the mesh's first rank (as
    DDP does), so ranks may start from different initializations; the first call on a
    process group also calibrates the cost model on it (a few small collectives, under a
    second). Build the optimizer after this call: the parameters are new objects, and an
    optimizer that holds the old ones raises at its first ``step``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"compshard.shard: module must be an nn.Module, got {type(module).__name__}")
    if is_sharded(module):
        raise ValueError("compshard.shard: module is already sharded")
    if strategy not in STRATEGIES:
        raise ValueError(f"compshard.shard: strategy={strategy!r} is not allowed; use one of {list(STRATEGIES)}")
    reshard_after_forward = _resolve_reshard(strategy, reshard_after_forward)
    for option, dtype in (
        ("param_dtype", param_dtype),
        ("reduce_dtype", reduce_dtype),
        ("output_dtype", output_dtype),
        ("buffer_dtype", buffer_dtype),
    ):
        _check_dtype(option, dtype)
    _check_flag("cast_forward_inputs", cast_forward_inputs)
    _check_mesh(strategy, mesh)
    gather_units = _check_gather_units(module, gather_units)
    _warn_if_compiled_before(module)
    if mesh is None:
        mesh = _default_mesh(module)
    offload_state, compute_device = _offload_device(offload, module, mesh)
    groups = _groups(strategy, mesh)
    tp_layouts = tensor_parallel.layouts(module, mesh, groups.placements)
    if mesh is not None:
        liveness.start()  # from here on, a rank that fails or dies is noticed by the others' waits
        _broadcast_from_first_rank(module, mesh)
    for group_name in (groups.shard_group, groups.replicate_group):
        if group_name and mesh is not None and ops.group_size(group_name) > 1:  # (groups come from a mesh)
            cost_model.calibrate(group_name, torch.device(mesh.device_type))

    grad_sync = GradSync()
    _MODELS.add(grad_sync)
    sharded: dict[int, tuple[nn.Parameter, ParamSpec, tensor_parallel.TensorParallelLayout | None]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        names = tuple(name for name, p in sub._parameters.items() if p is not None)
        if not names or hasattr(sub, "_compshard_specs"):
            continue
        specs: dict[str, ParamSpec] = {}
        layouts: dict[str, tensor_parallel.TensorParallelLayout] = {}
        for name in names:
            original = sub._parameters[name]
            if id(original) not in sharded:
                layout = tp_layouts.get(id(original))
                spec = ParamSpec(
                    fqn=f"{prefix}.{name}" if prefix else name,
                    full_shape=tuple(original.shape if layout is None else original._local_tensor.shape),
                    world_size=groups.shard_size,
                    group_name=groups.shard_group,
                    param_dtype=param_dtype,
                    reduce_dtype=reduce_dtype,
                    reshard_after_forward=reshard_after_forward,
                    replicate_group=groups.replicate_group,
                    compute_device=compute_device,
                )
                at_rest = _shard_param(original, spec, mesh, groups, layout)
                sharded[id(original)] = (at_rest, spec, layout)
                grad_sync.specs[spec.fqn] = spec
                if isinstance(at_rest, DTensor):
                    grad_sync.routed[spec.fqn] = at_rest
                original._compshard_replaced_by_shard = spec.fqn
            new_param, specs[name], layout = sharded[id(original)]
            sub._parameters[name] = new_param
            if layout is not None:
                layouts[name] = layout
        sub._compshard_specs = specs
        if layouts:
            sub._compshard_tensor_parallel = layouts
        sub._compshard_grad_sync = grad_sync
        _install_properties(sub, names)
    _install_gather_units(module, gather_units or ())
    _install_forward_scopes(module)
    if buffer_dtype is not None:
        for sub in module.modules():
            for name, buffer in sub._buffers.items():
                if buffer is not None and torch.is_floating_point(buffer):
                    sub._buffers[name] = buffer.to(buffer_dtype)
    _refuse_stale_optimizers()
    config = ShardingConfig(
        strategy,
        groups.shard_size,
        groups.replicate_size,
        reshard_after_forward,
        param_dtype,
        reduce_dtype,
        output_dtype,
        cast_forward_inputs,
        buffer_dtype,
        offload_state,
        gather_units,
    )
    module._compshard_config = config  # type: ignore[assignment]  # any value; stubs: Tensor | Module
    module._compshard_grad_sync = grad_sync  # type: ignore[assignment]  # any value; stubs: Tensor | Module
    _install_casts(module, config)
    return module


# trainable parameters that a compshard-compiled graph took unsharded while several ranks ran, by id
_COMPILED_UNSHARDED: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()


def note_compiled_before_shard(example_inputs: Sequence[Any]) -> None:
    """Remember the plain trainable parameters among a compshard graph's inputs when a
    process group of several ranks is up: a model compiled and called before ``shard``
    (:func:`_warn_if_compiled_before`). The backend calls it for every graph."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    for value in example_inputs:
        if isinstance(value, nn.Parameter) and value.requires_grad and not isinstance(value, DTensor):
            _COMPILED_UNSHARDED[id(value)] = value


def _warn_if_compiled_before(module: nn.Module) -> None:
    early = [name for name, param in module.named_parameters() if _COMPILED_UNSHARDED.get(id(param)) is param]
    if early:
        warnings.warn(
            f"compshard.shard: the model already ran compiled with backend='compshard' before shard (parameters "
            f"{early[:3]}...): steps taken then trained each rank's own replica unsynchronized, and shard now keeps "
            "the first rank's values (broadcast), discarding the other ranks' updates. Call compshard.shard(model) "
            "before the compiled model's first call",
            stacklevel=3,
        )


def _check_gather_units(module: nn.Module, gather_units: Sequence[str] | None) -> tuple[str, ...] | None:
    if gather_units is None:
        return None
    if isinstance(gather_units, str) or not all(isinstance(p, str) and p for p in gather_units):
        raise TypeError(
            f"compshard.shard: gather_units must be a list of module-name patterns (non-empty strings) "
            f"or None, got {gather_units!r}"
        )
    names = [name for name, _ in module.named_modules() if name]
    unmatched = [p for p in gather_units if not any(fnmatch.fnmatchcase(name, p) for name in names)]
    if unmatched:
        raise ValueError(
            f"compshard.shard: gather_units pattern(s) {unmatched} match no submodule; module names "
            f"look like {names[:6]}"
        )
    return tuple(gather_units)


def _install_gather_units(root: nn.Module, patterns: Sequence[str]) -> None:
    """Give every sharded parameter its gather unit (:mod:`compshard.eager_gather`): the
    outermost module matching ``patterns``, else the outermost repeated block it lies in,
    either covering every parameter beneath it; else its own module, unless that is a
    torch.nn layer that reads each parameter once (a gather at the read is the gather at
    entry) or the root (whose hooks would run outside its compiled forward, as graphs of
    their own)."""
    owners: dict[int, tuple[str, nn.Module]] = {}
    for prefix, sub in root.named_modules(remove_duplicate=False):
        if hasattr(sub, "_compshard_specs"):
            owners.setdefault(id(sub), (prefix, sub))
    containers = repeated_containers(prefix for prefix, _ in owners.values())
    units: dict[int, tuple[nn.Module, str, dict[str, tuple[nn.Module, str]]]] = {}
    for prefix, sub in owners.values():
        block = outermost_match(prefix, patterns) or repeated_block(prefix, containers)
        if block is not None:
            unit, path = root.get_submodule(block), block
        elif sub is not root and eager_gather.needs_call_scope(sub):
            unit, path = sub, prefix
        else:
            continue
        members = units.setdefault(id(unit), (unit, path, {}))[2]
        for name, spec in _specs(sub).items():
            members.setdefault(spec.fqn, (sub, name))
    for unit, path, members in units.values():
        if all(module is unit for module, _ in members.values()) and not eager_gather.needs_call_scope(unit):
            continue  # a block that is one torch.nn layer: it reads each parameter once anyway
        eager_gather.install_call_scope(unit, list(members.values()), _gather_members)
        unit._compshard_unit_path = path  # type: ignore[assignment]  # any value; stubs: Tensor | Module
        unit._compshard_compiled_reads = _unit_reads(unit)  # type: ignore[assignment]  # any value; stubs: Tensor | Module


_BROADCAST_BUCKET_BYTES = 256 * 2**20


def _broadcast_from_first_rank(module: nn.Module, mesh: DeviceMesh) -> None:
    """Give every rank of ``mesh`` the first rank's parameters and buffers, as DDP does at
    construction: ranks initialized differently (no common seed) would otherwise each keep
    rows of their own model. Tensors of a dtype are flattened into buckets of at most
    256 MiB, one broadcast each, along every mesh dimension in turn. A tensor-parallel
    DTensor broadcasts its local piece (the ranks of a dp group share its tp coordinate).
    Tensors on the meta device have no values to broadcast: every rank initializes them
    after ``to_empty`` (alike, with one seed: :mod:`compshard.sharded_init`)."""
    tensors = [
        t._local_tensor if isinstance(t, DTensor) else t
        for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values()
        if not t.is_meta
    ]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for dim in range(mesh.ndim):
        group = mesh.get_group(dim)
        if dist.get_world_size(group) == 1:
            continue
        source = dist.get_global_rank(group, 0)
        for same_kind in by_kind.values():
            bucket: list[torch.Tensor] = []
            pending: list[torch.Tensor | None] = [*same_kind, None]  # None: the end, flush
            for following in pending:
                full = following is None or (
                    sum(t.numel() for t in bucket) * following.element_size() >= _BROADCAST_BUCKET_BYTES
                )
                if bucket and full:
                    flat = torch.cat([t.detach().reshape(-1) for t in bucket])
                    dist.broadcast(flat, source, group=group)
                    with torch.no_grad():
                        for t, piece in zip(bucket, flat.split([t.numel() for t in bucket])):
                            t.copy_(piece.view_as(t))
                    bucket = []
                if following is not None:
                    bucket.append(following)


_STALE_HOOK: list = []  # the one global optimizer pre-step hook, registered on first use


def _refuse_stale_optimizers() -> None:
    """An optimizer stepping a parameter that ``shard`` replaced (marked
    ``_compshard_replaced_by_shard``) raises.

    An optimizer built before ``shard`` holds the replaced parameters, which no longer
    take part in forward or backward: it would step nothing and say nothing. The check
    runs at each optimizer's first ``step`` (one pass over its parameters)."""
    if not _STALE_HOOK:
        _STALE_HOOK.append(register_optimizer_step_pre_hook(_check_optimizer))


_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _CHECKED:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, "_compshard_replaced_by_shard", None)
            if name is not None:
                raise RuntimeError(
                    f"compshard: this {type(optimizer).__name__} holds parameter '{name}' as it was before "
                    "compshard.shard replaced it, so stepping it would train nothing. Build the optimizer after "
                    "compshard.shard(model), from model.parameters()"
                )
    _CHECKED.add(optimizer)


# the gradient-sync state of every live sharded model, whose ``routed`` parameters'
# local tensors compiled graphs take (weakly: a model that is gone is not walked)
_MODELS: weakref.WeakSet[GradSync] = weakref.WeakSet()


def _route_local_gradients(param: nn.Parameter) -> None:
    """Make the local tensor of DTensor ``param`` a leaf that requires gradients: compiled
    graphs take it as their input (see :func:`_local_rows`), and their backward leaves the
    parameter's gradient on it, which :func:`move_local_gradients` moves to ``param.grad``
    (the parameter is in its model's ``GradSync.routed``). (Not a hook on the tensor: a
    tensor freed on a communication thread while the interpreter exits would take its
    Python hook down with the process.)"""
    _local_tensor(param).requires_grad_(True)
    sharded_init.mark_sharded(param)


def _local_tensor(param: nn.Parameter) -> torch.Tensor:
    """The local tensor of a DTensor parameter."""
    assert isinstance(param, DTensor)
    return param._local_tensor


def move_local_gradients() -> None:
    """Add the gradient each sharded parameter's local tensor holds to the parameter's
    ``grad`` (as a DTensor), leaving the local tensor's own ``grad`` empty. The backend
    queues it at the end of every backward pass that runs a compiled backward graph."""
    for name, param in [routed for state in list(_MODELS) for routed in state.routed.items()]:
        local = _local_tensor(param)
        if local.grad is None:
            continue
        grad, local.grad = local.grad, None
        eager_gather.accumulate_grad(param, grad, name)


def _shard_param(
    param: nn.Parameter,
    spec: ParamSpec,
    mesh: DeviceMesh | None,
    groups: _Groups,
    tp_layout: tensor_parallel.TensorParallelLayout | None,
) -> nn.Parameter:
    """This rank's rows of ``param`` (of its tensor-parallel piece, for a parameter a
    plan placed: ``tp_layout``) as the parameter at rest."""
    data = param.detach() if tp_layout is None else _local_tensor(param).detach()
    layout = spec.layout(groups.shard_rank)
    if layout.replicated:
        local = data.clone()
    else:
        start, stop = layout.local_rows
        local = data[start:stop].clone()
    if mesh is not None:
        placements = (Replicate(),) * mesh.ndim if layout.replicated else groups.placements
        shape, stride = data.shape, data.stride()
        if tp_layout is not None:
            mesh, placements = tensor_parallel.at_rest(spec.fqn, mesh, placements, tp_layout)
            shape, stride = tp_layout.shape, tp_layout.stride
        sharded = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
        if spec.compute_device is not None:  # from_local would move a CPU shard to the mesh's device
            sharded = DTensor(local.cpu().pin_memory(), sharded._spec, requires_grad=False)
        at_rest = nn.Parameter(sharded, requires_grad=param.requires_grad)
        _route_local_gradients(at_rest)
        return at_rest
    if spec.compute_device is not None:
        local = local.cpu().pin_memory()
    return nn.Parameter(local, requires_grad=param.requires_grad)
