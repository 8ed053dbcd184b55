"""``clip_grad_norm_`` for sharded models: the norm of the full gradient, one all-reduce.

Each rank reduces its own ``Shard(0)`` rows to one number (the sum of ``|g|^p``, or the
largest ``|g|`` for the infinity norm), one all-reduce combines the ranks, and
replicated gradients (0-d parameters; plain tensors) are added once, after it. Where
gradients are sharded differently (tensor parallelism: some on the 2-D (dp, tp) mesh,
others on dp alone), each layout's number is all-reduced over the mesh dimensions that
shard it, one all-reduce per dimension (summed once, never over a replicated one). Every
rank then scales its rows by the same coefficient as
``torch.nn.utils.clip_grad_norm_`` computes for the unsharded model:
``min(1, max_norm / (total_norm + 1e-6))``.

``torch.nn.utils.clip_grad_norm_`` on the DTensor gradients also gets the norm right
for finite ``p``, but with one collective per gradient, and for the infinity norm it
fails on a rank that holds no rows of some parameter (dim 0 smaller than the world
size): the local max of an empty tensor has no identity.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["clip_grad_norm_"]

_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_grad_norm_(
    module: nn.Module, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False
) -> torch.Tensor:
    """Scale ``module``'s gradients in place so that their total norm is at most ``max_norm``.

    Returns the total ``norm_type``-norm of the full (unsharded) gradients, before
    clipping: a 0-d tensor, the same on every rank, in the gradients' promoted dtype
    (at least float32). Parameters without a gradient (frozen, or unused) are left
    out; a parameter registered under several names (tied weights) counts once. Works
    for sharded modules at any world size and for plain tensors in one process.
    ``error_if_nonfinite``: raise when the norm is NaN or infinite instead of scaling
    by it. Collective when any gradient is sharded.
    """
    _check_arguments(module, max_norm, norm_type, error_if_nonfinite)
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    total_norm = _total_norm(grads, float(norm_type)).to(dtype)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(
            f"compshard.clip_grad_norm_: the total {norm_type}-norm of the gradients is {total_norm.item()}; "
            "pass error_if_nonfinite=False to scale by it anyway"
        )
    scale = torch.clamp(max_norm / (total_norm + _EPS), max=1.0)
    by_device_and_dtype: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        local = _local(grad)
        by_device_and_dtype.setdefault((local.device, local.dtype), []).append(local)
    for (device, grad_dtype), tensors in by_device_and_dtype.items():
        torch._foreach_mul_(tensors, scale.to(device, grad_dtype))
    return total_norm


def _total_norm(grads: list[torch.Tensor], p: float) -> torch.Tensor:
    """Norm of the full gradients (float64): sharded parts reduced across ranks, replicated
    ones added once."""
    by_layout: dict[tuple[DeviceMesh, tuple[int, ...]], list[torch.Tensor]] = {}  # in parameter order
    replicated = []
    for grad in grads:
        dims = _sharded_dims(grad)
        if isinstance(grad, DTensor) and dims:
            by_layout.setdefault((grad.device_mesh, dims), []).append(_local(grad))
        else:
            replicated.append(_local(grad))
    device = _local(grads[0]).device if grads else torch.device("cpu")
    # float64 accumulation keeps sum(|g|^p) from overflowing for large p
    total = _combine(replicated, p, device)
    for (mesh, dims), tensors in by_layout.items():
        part = _combine(tensors, p, device)
        for dim in dims:
            dist.all_reduce(
                part, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=mesh.get_group(dim)
            )
        total = torch.maximum(total, part) if math.isinf(p) else total + part
    return total if math.isinf(p) else total ** (1.0 / p)


def _combine(tensors: list[torch.Tensor], p: float, device: torch.device) -> torch.Tensor:
    """max |g| over all tensors (p = inf) or sum |g|^p, as a float64 scalar; empty gives 0."""
    result = torch.zeros((), dtype=torch.float64, device=device)
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        norm = torch.linalg.vector_norm(tensor, p).to(device, torch.float64)
        result = torch.maximum(result, norm) if math.isinf(p) else result + norm**p
    return result


def _sharded_dims(grad: torch.Tensor) -> tuple[int, ...]:
    """The mesh dimensions that split ``grad`` (none for a plain tensor)."""
    if not isinstance(grad, DTensor):
        return ()
    return tuple(dim for dim, placement in enumerate(grad.placements) if isinstance(placement, (Shard, _StridedShard)))


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _check_arguments(module: Any, max_norm: Any, norm_type: Any, error_if_nonfinite: Any) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"compshard.clip_grad_norm_: module must be an nn.Module, got {type(module).__name__}")
    number = (int, float)
    if isinstance(max_norm, bool) or not isinstance(max_norm, number) or not max_norm >= 0:
        raise ValueError(f"compshard.clip_grad_norm_: max_norm must be a number >= 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, number) or not norm_type > 0:
        raise ValueError(
            f"compshard.clip_grad_norm_: norm_type must be a number > 0 or float('inf'), got {norm_type!r}"
        )
    if not isinstance(error_if_nonfinite, bool):
        raise TypeError(
            f"compshard.clip_grad_norm_: error_if_nonfinite must be True or False, got {error_if_nonfinite!r}"
        )
