"""What the framework integrations share: finding the sharded module behind what a framework
holds, and the full (unsharded) form of a sharded model's optimizer state in torch's own
``state_dict`` format.

``full_optimizer_state`` / ``sharded_optimizer_state`` convert an ``Optimizer.state_dict()``
(``{"state": {index: {...}}, "param_groups": [{"params": [index, ...], ...}]}``) between
this rank's ``Shard(0)`` rows and the full tensors, keeping the format: the full form is
what the unsharded model's optimizer would return, so a framework that writes one file
from the first rank and reads it back on every rank (Accelerate's ``save_state``) writes
a file that means the same at any world size. Gathering is collective and every rank must
convert the same state; slicing back is local (each rank keeps its rows of the full
tensor, as DTensor places them).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from compshard.sharding import is_sharded

__all__ = ["sharded_module", "full_optimizer_state", "sharded_optimizer_state", "tie_aliases"]


def sharded_module(model: nn.Module) -> nn.Module | None:
    """The module ``compshard.shard`` sharded, behind a ``torch.compile`` wrapper if there is
    one; ``None`` when ``model`` is not sharded."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    return model if isinstance(model, nn.Module) and is_sharded(model) else None


def _params_by_index(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[Any, torch.Tensor]:
    """The optimizer's parameter for each index of ``state_dict`` (groups and their
    parameters in order, as ``Optimizer.state_dict`` numbers them)."""
    found: dict[Any, torch.Tensor] = {}
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        if len(group["params"]) != len(saved["params"]):
            raise ValueError(
                "compshard: an optimizer state dict whose parameter groups do not match the optimizer's "
                f"({len(saved['params'])} parameters in a group of {len(group['params'])})"
            )
        found.update(zip(saved["params"], group["params"]))
    return found


def full_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (``optimizer.state_dict()``) with every DTensor state entry gathered to a
    full CPU tensor, in parameter order. Collective. The optimizer's own state is untouched:
    ``state_dict()`` shares its per-parameter dicts, so they are replaced, not edited."""
    params = _params_by_index(optimizer, state_dict)
    state = {}
    for index in params:  # parameter order: every rank gathers in the same order
        if index not in state_dict["state"]:
            continue
        state[index] = {
            key: value.full_tensor().cpu() if isinstance(value, DTensor) else value
            for key, value in state_dict["state"][index].items()
        }
    return {**state_dict, "state": state}


def sharded_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with full tensors (as :func:`full_optimizer_state` writes them) cut to
    this rank's rows of each DTensor parameter, placed as the parameter is: what
    ``optimizer.load_state_dict`` then loads. Entries that are not the parameter's shape
    (AdamW's ``step``) are kept as they are. Local: no collective."""
    params = _params_by_index(optimizer, state_dict)
    state = {}
    for index, entries in state_dict["state"].items():
        param = params.get(index)
        state[index] = {key: _rows(param, value) for key, value in entries.items()}
    return {**state_dict, "state": state}


def _rows(param: torch.Tensor | None, value: Any) -> Any:
    if not isinstance(param, DTensor) or not torch.is_tensor(value) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(param.shape):
        return value
    local = value.to(param.device_mesh.device_type)
    return distribute_tensor(local, param.device_mesh, param.placements, src_data_rank=None)


def tie_aliases(module: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` (full tensors by ``state_dict`` key) with every name of a tied parameter
    filled in from the one that is present: safetensors files keep one name per shared
    tensor."""
    names: dict[int, list[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    filled = dict(weights)
    for keys in names.values():
        present = next((key for key in keys if key in weights), None)
        if present is not None:
            filled.update({key: weights[present] for key in keys if key not in weights})
    return filled
