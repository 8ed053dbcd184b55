"""``shard``'s arguments: each checked (errors name the option and what is allowed), and
what they resolve to (the mesh, the process groups, the offload device)."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from compshard.module_tree import check_patterns_match
from compshard.sharding.experts import ExpertGroups, check_experts_compose, resolve_experts
from compshard.sharding.spec import STRATEGIES, ShardingConfig
from compshard.sharding.state import is_sharded

__all__ = [
    "Groups",
    "Resolved",
    "check_dtype",
    "check_flag",
    "check_gather_units",
    "check_held_parameters",
    "check_mesh",
    "default_mesh",
    "groups",
    "note_compiled_before_shard",
    "offload_device",
    "resolve",
    "resolve_reshard",
    "warn_if_compiled_before",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_dtype(option: str, value: torch.dtype | None) -> None:
    if value is not None and value not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"compshard.shard: {option}={value!r} is not allowed; use None or one of {allowed}")


def check_flag(option: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"compshard.shard: {option} must be True or False, got {value!r}")


def default_mesh(module: nn.Module) -> DeviceMesh | None:
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


def check_mesh(strategy: str, mesh: Any) -> None:
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
class Groups:
    """Where one parameter copy is split (shard) and across which ranks copies repeat."""

    shard_size: int
    shard_rank: int
    shard_group: str
    replicate_size: int
    replicate_group: str
    placements: tuple | None  # of a sharded parameter's DTensor at rest; None: plain tensors (one rank)


def groups(strategy: str, mesh: DeviceMesh | None) -> Groups:
    if mesh is None:
        return Groups(1, 0, "", 1, "", None)
    if strategy == "hybrid_shard":
        return Groups(
            mesh.size(1),
            mesh.get_local_rank(1),
            mesh.get_group(1).group_name,
            mesh.size(0),
            mesh.get_group(0).group_name,
            (Replicate(), Shard(0)),
        )
    if strategy == "no_shard":
        return Groups(1, 0, "", mesh.size(), mesh.get_group().group_name, (Replicate(),))
    return Groups(mesh.size(), mesh.get_local_rank(), mesh.get_group().group_name, 1, "", (Shard(0),))


def resolve_reshard(strategy: str, reshard_after_forward: bool | None) -> bool:
    if reshard_after_forward is None:
        return strategy in ("full_shard", "hybrid_shard")
    check_flag("reshard_after_forward", reshard_after_forward)
    if strategy in ("shard_grad_op", "shard_optimizer") and reshard_after_forward:
        kept = "from forward to backward" if strategy == "shard_grad_op" else "between steps"
        raise ValueError(
            f"compshard.shard: strategy={strategy!r} keeps parameters gathered {kept}; "
            "reshard_after_forward=True contradicts it (use 'full_shard', or leave it None)"
        )
    return reshard_after_forward


def check_held_parameters(module: nn.Module, strategy: str, offload: bool) -> None:
    """``"shard_optimizer"`` holds every full parameter on every rank, so they must have
    values (not the meta device) and stay on the compute device (no offload)."""
    if strategy != "shard_optimizer":
        return
    if offload:
        raise ValueError(
            "compshard.shard: strategy='shard_optimizer' keeps the full parameters on every rank's device, so "
            "offload=True has nothing to offload but the optimizer's rows; use strategy='full_shard' with offload"
        )
    if any(p.is_meta for p in module.parameters()):
        raise ValueError(
            "compshard.shard: strategy='shard_optimizer' keeps every full parameter on every rank, taken from the "
            "model's values, but some are on the meta device: materialize the model first (it must fit on each "
            "rank anyway), or use strategy='full_shard' for meta-device initialization"
        )


def offload_device(offload: bool, module: nn.Module, mesh: DeviceMesh | None) -> tuple[str, torch.device | None]:
    """(the config's ``offload`` value, the compute device shards are copied to)."""
    check_flag("offload", offload)
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
            stacklevel=4,
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


# trainable parameters that a compshard-compiled graph took unsharded while several ranks ran, by id
_COMPILED_UNSHARDED: weakref.WeakValueDictionary[int, nn.Parameter] = weakref.WeakValueDictionary()


def note_compiled_before_shard(example_inputs: Sequence[Any]) -> None:
    """Remember the plain trainable parameters among a compshard graph's inputs when a
    process group of several ranks is up: a model compiled and called before ``shard``
    (:func:`warn_if_compiled_before`). The backend calls it for every graph."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    for value in example_inputs:
        if isinstance(value, nn.Parameter) and value.requires_grad and not isinstance(value, DTensor):
            _COMPILED_UNSHARDED[id(value)] = value


def warn_if_compiled_before(module: nn.Module) -> None:
    early = [name for name, param in module.named_parameters() if _COMPILED_UNSHARDED.get(id(param)) is param]
    if early:
        warnings.warn(
            f"compshard.shard: the model already ran compiled with backend='compshard' before shard (parameters "
            f"{early[:3]}...): steps taken then trained each rank's own replica unsynchronized, and shard now keeps "
            "the first rank's values (broadcast), discarding the other ranks' updates. Call compshard.shard(model) "
            "before the compiled model's first call",
            stacklevel=4,
        )


def check_gather_units(module: nn.Module, gather_units: Sequence[str] | None) -> tuple[str, ...] | None:
    if gather_units is None:
        return None
    if isinstance(gather_units, str) or not all(isinstance(p, str) and p for p in gather_units):
        raise TypeError(
            f"compshard.shard: gather_units must be a list of module-name patterns (non-empty strings) "
            f"or None, got {gather_units!r}"
        )
    check_patterns_match("gather_units", gather_units, [name for name, _ in module.named_modules() if name])
    return tuple(gather_units)


@dataclass(frozen=True)
class Resolved:
    """``shard``'s arguments checked and resolved: the configuration it applies, the mesh
    (None: one rank), its process groups, the device offloaded shards are copied to, and
    where split experts go."""

    config: ShardingConfig
    mesh: DeviceMesh | None
    groups: Groups
    compute_device: torch.device | None
    experts: ExpertGroups | None  # shard(experts=...) over several ranks: the experts split across them


def resolve(
    module: nn.Module,
    mesh: DeviceMesh | None,
    strategy: str,
    reshard_after_forward: bool | None,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    output_dtype: torch.dtype | None,
    cast_forward_inputs: bool,
    buffer_dtype: torch.dtype | None,
    offload: bool,
    gather_units: Sequence[str] | None,
    experts: Sequence[str] | None,
    expert_mesh: DeviceMesh | None,
    expert_capacity_factor: float | None,
) -> Resolved:
    """Check ``shard``'s arguments (as ``compshard.shard`` documents them) for ``module``,
    raising errors that name the option and what is allowed; resolve them (with
    ``experts``, creating the expert-parallel group: collective)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"compshard.shard: module must be an nn.Module, got {type(module).__name__}")
    if is_sharded(module):
        raise ValueError("compshard.shard: module is already sharded")
    if strategy not in STRATEGIES:
        raise ValueError(f"compshard.shard: strategy={strategy!r} is not allowed; use one of {list(STRATEGIES)}")
    reshard = resolve_reshard(strategy, reshard_after_forward)
    for option, dtype in (
        ("param_dtype", param_dtype),
        ("reduce_dtype", reduce_dtype),
        ("output_dtype", output_dtype),
        ("buffer_dtype", buffer_dtype),
    ):
        check_dtype(option, dtype)
    check_flag("cast_forward_inputs", cast_forward_inputs)
    check_mesh(strategy, mesh)
    check_held_parameters(module, strategy, offload)
    units = check_gather_units(module, gather_units)
    warn_if_compiled_before(module)
    if mesh is None:
        mesh = default_mesh(module)
    offload_state, compute_device = offload_device(offload, module, mesh)
    found = groups(strategy, mesh)
    split = resolve_experts(module, experts, expert_mesh, expert_capacity_factor, mesh, strategy, units)
    if split is not None:
        check_experts_compose(compute_device, split)
    splits = split is not None and split.ep_size > 1  # one rank's experts: nothing to split
    config = ShardingConfig(
        strategy,
        found.shard_size,
        found.replicate_size,
        reshard,
        param_dtype,
        reduce_dtype,
        output_dtype,
        cast_forward_inputs,
        buffer_dtype,
        offload_state,
        units,
        None if split is None else split.patterns,
        1 if split is None else split.ep_size,
    )
    return Resolved(config, mesh, found, compute_device, split if splits else None)
