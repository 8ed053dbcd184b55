"""Parity helpers: train the unsharded model eagerly (the truth) and the sharded one."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import compshard
from tests.models import make_model

STEPS = 5
# eps well above the rounding noise of gradients that are zero in exact arithmetic (the
# key part of the qkv bias: a softmax ignores a constant added to every key), so Adam does
# not turn that noise into full-size steps. Other hyper-parameters are the usual ones.
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
RTOL = 1e-5


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Norm-wise: ||actual - expected|| / ||expected|| (absolute when expected is 0)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    return diff / scale if scale > 0 else diff


def local_batch(batch: tuple[torch.Tensor, ...], rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    return tuple(t.chunk(world_size)[rank] for t in batch)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **ADAMW)


def train_reference(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    steps: int = STEPS,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    max_grad_norm: float | None = None,
) -> list[float]:
    """Eager training of the unsharded model (with ``optimizer``, a new AdamW when None;
    gradients clipped by torch when ``max_grad_norm`` is given); return the losses."""
    opt = optimizer if optimizer is not None else adamw(model)
    losses = []
    for _ in range(steps):
        loss = model(*batch)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_sharded(
    model: nn.Module,
    batch: tuple[torch.Tensor, ...],
    rank: int,
    world_size: int,
    *,
    compile_options: dict | None = None,
    compiled: bool = True,
    steps: int = STEPS,
    optimizer: torch.optim.Optimizer | None = None,
    max_grad_norm: float | None = None,
) -> tuple[list[float], torch.optim.Optimizer]:
    """Train an already sharded model on this rank's slice (with ``optimizer``, a new
    AdamW when None; gradients clipped by compshard when ``max_grad_norm`` is given);
    return global-mean losses and the optimizer."""
    step_model: Callable = torch.compile(model, backend="compshard", options=compile_options) if compiled else model
    opt = optimizer if optimizer is not None else adamw(model)
    losses = []
    for _ in range(steps):
        loss = step_model(*local_batch(batch, rank, world_size))
        loss.backward()
        if max_grad_norm is not None:
            compshard.clip_grad_norm_(model, max_grad_norm)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= world_size
        losses.append(mean.item())
    return losses, opt


def parity(name: str, rank: int, world_size: int, **shard_kwargs) -> dict:
    """Max relative errors of losses and final parameters, sharded vs. eager truth."""
    reference, batch = make_model(name)
    sharded = compshard.shard(copy.deepcopy(reference), **shard_kwargs.pop("shard", {}))
    expected_losses = train_reference(reference, batch, max_grad_norm=shard_kwargs.get("max_grad_norm"))
    losses, opt = train_sharded(sharded, batch, rank, world_size, **shard_kwargs)
    full = compshard.full_state_dict(sharded)
    expected = reference.state_dict()
    return {
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
        "params": {key: relative_error(full[key], value) for key, value in expected.items()},
        "keys_match": list(full) == list(expected),
        "losses": losses,
        "expected_losses": expected_losses,
        "model": sharded,
        "optimizer": opt,
    }
