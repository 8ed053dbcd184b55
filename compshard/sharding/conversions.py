"""Sharded classes, and the conversions (``module.to()``, ``.float()``, ``.to_empty()``) of their modules.

``shard`` gives each module with sharded parameters a per-class subclass (``Sharded<Name>``)
whose class attributes answer reads of those parameters (:mod:`compshard.sharding.reads`)
and whose ``_apply`` keeps the shards consistent through conversions.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.sharding.grad_routing import route_local_gradients
from compshard.sharding.held_params import convert_held
from compshard.sharding.reads import sharded_property
from compshard.sharding.state import has_state, state_of

__all__ = ["install_sharded_class", "plain_class"]

_SHARDED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def install_sharded_class(module: nn.Module, names: tuple[str, ...]) -> None:
    """Give ``module`` the sharded subclass of its class for parameters ``names``."""
    base = type(module)
    key = (base, names)
    if key not in _SHARDED_CLASSES:
        attrs: dict[str, Any] = {name: sharded_property(name) for name in names}
        attrs["_apply"] = _sharded_apply(base)
        _SHARDED_CLASSES[key] = type(f"Sharded{base.__name__}", (base,), attrs)
    module.__class__ = _SHARDED_CLASSES[key]


def plain_class(cls: type) -> type | None:
    """The class a module had before ``shard`` gave it sharded parameter attributes (None:
    ``cls`` is not such a class)."""
    return cls.__bases__[0] if cls in _SHARDED_CLASSES.values() else None


# [Note: conversions of a sharded module]
# ``module.to(...)``, ``.float()``, ``.bfloat16()``, ``.cpu()``, ``.to_empty(...)`` all run
# ``nn.Module._apply(fn)``, which for a DTensor parameter builds ``Parameter(fn(param))`` and
# swaps it into the existing parameter object (``torch.utils.swap_tensors``): the object an
# optimizer or a framework holds stays the same, its shard is converted. Two things follow.
# The swap refuses a parameter that anything references weakly, so compshard keeps its
# registries of parameters by strong reference (``GradSync.routed``). And the swapped-in
# local tensor is a fresh detached tensor, so each sharded module's ``_apply`` makes it a
# gradient leaf again (:func:`~compshard.sharding.grad_routing.route_local_gradients`), as FSDP2
# refreshes its per-parameter record after ``_apply``; the full tensors a "shard_optimizer"
# model holds get the same conversion (:mod:`compshard.sharding.held_params`). What a
# conversion cannot keep consistent is refused before any parameter changes: a move of
# shards off their mesh's device type (every rank's shards live where its mesh's
# collectives run), or any device move of offloaded shards.
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
                route_local_gradients(param)
        state = state_of(self) if has_state(self) else None
        if state is not None and state.specs and state.grad_sync.held is not None:
            convert_held(state.grad_sync, [spec.fqn for spec in state.specs.values()], fn)
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
        specs = state_of(sub).specs if has_state(sub) else {}
        for name, param in sub._parameters.items():
            spec = specs.get(name)
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
