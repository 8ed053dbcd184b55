"""Gradients of compiled graphs, routed from the local tensors they take to the parameters.

Compiled graphs take each DTensor parameter's local tensor as their input, never the
DTensor (see :mod:`compshard.sharding.reads`). That local tensor is a leaf that requires
gradients, so a compiled backward leaves the parameter's reduced gradient on it;
:func:`move_local_gradients`, which the backend queues at the end of every backward that
runs a compiled backward graph, moves it to the parameter's ``grad`` (a DTensor).
(Not a hook on the tensor: a tensor freed on a communication thread while the
interpreter exits would take its Python hook down with the process.)
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.sharding import initial_values
from compshard.sharding.eager_reductions import accumulate_grad
from compshard.sharding.grad_sync import GradSync

__all__ = ["local_tensor", "move_local_gradients", "register_model", "route_local_gradients", "sharded_models"]

# the gradient-sync state of every live sharded model, whose ``routed`` parameters'
# local tensors compiled graphs take (weakly: a model that is gone is not walked)
_MODELS: weakref.WeakSet[GradSync] = weakref.WeakSet()


def register_model(grad_sync: GradSync) -> None:
    """Walk ``grad_sync.routed`` at the end of each backward from now on, while it lives."""
    _MODELS.add(grad_sync)


def sharded_models() -> list[GradSync]:
    """The gradient-sync state of every live sharded model."""
    return list(_MODELS)


def route_local_gradients(param: nn.Parameter) -> None:
    """Make the local tensor of DTensor ``param`` a leaf that requires gradients, whose
    gradient :func:`move_local_gradients` moves to ``param.grad`` (the parameter is in its
    model's ``GradSync.routed``); call again after a conversion replaced it."""
    local_tensor(param).requires_grad_(True)
    initial_values.mark_sharded(param)


def local_tensor(param: nn.Parameter) -> torch.Tensor:
    """The local tensor of a DTensor parameter."""
    assert isinstance(param, DTensor)
    return param._local_tensor


def move_local_gradients() -> None:
    """Add the gradient each sharded parameter's local tensor holds to the parameter's
    ``grad`` (as a DTensor), leaving the local tensor's own ``grad`` empty."""
    for name, param in [routed for state in list(_MODELS) for routed in state.routed.items()]:
        local = local_tensor(param)
        if local.grad is None:
            continue
        grad, local.grad = local.grad, None
        accumulate_grad(param, grad, name)
