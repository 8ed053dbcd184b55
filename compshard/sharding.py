"""``shard``: replace a module's parameters by this rank's ``Shard(0)`` rows, in place.

At rest each parameter is an ``nn.Parameter`` wrapping a DTensor placed ``Shard(0)`` on a
1-D mesh (``Replicate()`` for 0-d parameters), so torch optimizers, ``clip_grad_norm_``
and ``torch.distributed.checkpoint`` see ordinary DTensors. With no process group
initialized the world is one rank and parameters stay plain tensors.

Every read of ``module.<name>`` goes through ``compshard::unshard`` (a class-level property
installed on a per-class subclass), so Dynamo captures one unshard per access and eager
execution gathers for real. ``state_dict`` and ``named_parameters`` read ``_parameters``
directly and keep the original names. Tied parameters stay tied: one sharded Parameter
is registered under every name the original was.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from compshard import cost_model, ops

__all__ = ["shard", "full_state_dict", "ParamSpec", "param_specs", "is_sharded", "parameters_at_rest"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class ParamSpec:
    """What the unshard op needs for one parameter; the same on every rank."""

    fqn: str  # canonical name (the first under which the parameter is registered)
    full_shape: tuple[int, ...]
    world_size: int
    group_name: str  # "" when no process group is initialized
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool

    def layout(self, rank: int) -> ops.Layout:
        return ops.Layout(self.full_shape, self.world_size, rank)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _sharded_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        spec = self._compshard_specs[name]
        return torch.ops.compshard.unshard(
            _local(self._parameters[name]),
            list(spec.full_shape),
            spec.world_size,
            spec.group_name,
            spec.fqn,
            spec.param_dtype,
            spec.reduce_dtype,
            spec.reshard_after_forward,
        )

    return property(get, doc=f"'{name}' gathered to its full shape (compshard::unshard)")


_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _install_properties(module: nn.Module, names: tuple[str, ...]) -> None:
    base = type(module)
    key = (base, names)
    if key not in _SHARDED_CLASSES:
        attrs = {name: _sharded_property(name) for name in names}
        _SHARDED_CLASSES[key] = type(f"Sharded{base.__name__}", (base,), attrs)
    module.__class__ = _SHARDED_CLASSES[key]


@contextlib.contextmanager
def parameters_at_rest(module: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``module.<name>`` returns the stored shard Parameter (no gather).

    For code that walks a model by ``getattr`` outside forward, such as
    ``torch.distributed.checkpoint.state_dict``, which would otherwise all-gather every
    parameter it names. The sharded modules get their classes back on exit; nothing
    else changes, so compiled code stays valid.
    """
    sharded_classes = set(_SHARDED_CLASSES.values())
    swapped = [(sub, type(sub)) for sub in module.modules() if type(sub) in sharded_classes]
    for sub, cls in swapped:
        sub.__class__ = cls.__bases__[0]
    try:
        yield module
    finally:
        for sub, cls in swapped:
            sub.__class__ = cls


def _check_dtype(option: str, value: torch.dtype | None) -> None:
    if value is not None and value not in _FLOAT_DTYPES:
        allowed = ", ".join(str(d) for d in _FLOAT_DTYPES)
        raise ValueError(f"compshard.shard: {option}={value!r} is not allowed; use None or one of {allowed}")


def _default_mesh(module: nn.Module) -> DeviceMesh | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    devices = {p.device.type for p in module.parameters()}
    device_type = devices.pop() if len(devices) == 1 else "cpu"
    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def is_sharded(module: nn.Module) -> bool:
    return any(hasattr(m, "_compshard_specs") for m in module.modules())


def param_specs(module: nn.Module) -> dict[str, ParamSpec]:
    """Canonical parameter name -> spec, in parameter registration order."""
    specs: dict[str, ParamSpec] = {}
    for sub in module.modules():
        for spec in getattr(sub, "_compshard_specs", {}).values():
            specs.setdefault(spec.fqn, spec)
    return specs


def shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Shard ``module``'s parameters across the data-parallel ranks, in place; return it.

    Args:
        mesh: 1-D device mesh of the data-parallel ranks. ``None``: the default process
            group, or a single rank when none is initialized.
        reshard_after_forward: free gathered parameters after their last forward use and
            gather them again in backward (ZeRO-3: least memory, one more all-gather per
            parameter). ``False`` keeps them gathered from forward to backward.
        param_dtype: dtype parameters are gathered and computed in (``None``: their own).
        reduce_dtype: dtype gradients are reduce-scattered in (``None``: the gradient's).

    Parameters must be identical on every rank before the call (same seed or loaded
    state), as each rank keeps its own rows. Buffers are not sharded. Collective: the
    first call on a process group also calibrates the cost model on it (a few small
    collectives, under a second).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"compshard.shard: module must be an nn.Module, got {type(module).__name__}")
    if is_sharded(module):
        raise ValueError("compshard.shard: module is already sharded")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"compshard.shard: reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    _check_dtype("param_dtype", param_dtype)
    _check_dtype("reduce_dtype", reduce_dtype)
    if mesh is None:
        mesh = _default_mesh(module)
    elif not isinstance(mesh, DeviceMesh) or mesh.ndim != 1:
        raise ValueError(f"compshard.shard: mesh must be a 1-D DeviceMesh or None, got {mesh!r}")
    world_size = mesh.size() if mesh is not None else 1
    rank = mesh.get_local_rank() if mesh is not None else 0
    group_name = mesh.get_group().group_name if mesh is not None else ""
    if world_size > 1:
        cost_model.calibrate(group_name, torch.device(mesh.device_type))

    sharded: dict[int, tuple[nn.Parameter, ParamSpec]] = {}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        names = tuple(name for name, p in sub._parameters.items() if p is not None)
        if not names or hasattr(sub, "_compshard_specs"):
            continue
        specs = {}
        for name in names:
            original = sub._parameters[name]
            if id(original) not in sharded:
                spec = ParamSpec(
                    fqn=f"{prefix}.{name}" if prefix else name,
                    full_shape=tuple(original.shape),
                    world_size=world_size,
                    group_name=group_name,
                    param_dtype=param_dtype,
                    reduce_dtype=reduce_dtype,
                    reshard_after_forward=reshard_after_forward,
                )
                sharded[id(original)] = (_shard_param(original, spec, mesh, rank), spec)
            new_param, specs[name] = sharded[id(original)]
            sub._parameters[name] = new_param
        sub._compshard_specs = specs
        _install_properties(sub, names)
    return module


def _shard_param(param: nn.Parameter, spec: ParamSpec, mesh: DeviceMesh | None, rank: int) -> nn.Parameter:
    data = param.detach()
    layout = spec.layout(rank)
    if mesh is None:
        local = data.clone()
    elif layout.replicated:
        local = DTensor.from_local(data.clone(), mesh, [Replicate()], run_check=False)
    else:
        start, stop = layout.local_rows
        local = DTensor.from_local(
            data[start:stop].clone(), mesh, [Shard(0)], run_check=False, shape=data.shape, stride=data.stride()
        )
    return nn.Parameter(local, requires_grad=param.requires_grad)


def full_state_dict(module: nn.Module, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors under the unsharded model's ``state_dict()`` keys.

    Collective: every rank must call it. With ``rank0_only`` ranks other than 0 return
    an empty dict (they still take part in the gathers).
    """
    gathered: dict[int, torch.Tensor] = {}
    result = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) not in gathered:
            full = value.full_tensor() if isinstance(value, DTensor) else value
            gathered[id(value)] = full.detach().to("cpu", copy=True)
        result[key] = gathered[id(value)]
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    return result if keep else {}
