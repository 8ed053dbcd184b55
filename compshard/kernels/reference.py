"""Pure-torch reference implementations of the bucket copy functions.

These define the semantics the Triton kernels must match bit for bit.  They
assume already-validated arguments (the public functions in
``compshard.kernels.bucket_copy`` validate and then dispatch here or to Triton);
calling them directly with bad arguments gives torch's own errors.

Numerics, precisely:
  * a cast is ``Tensor.to(dtype)`` (round-to-nearest-even, NaN stays NaN);
  * division is ``x.to(dtype) / float(divide_by)`` (torch computes bf16/fp16 in
    fp32 and rounds once; fp32 divides in fp32);
  * accumulation is ``acc += x.to(acc.dtype)`` (again computed in fp32 for
    bf16/fp16 and rounded once);
  * padding is +0.0 and is never divided.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._checks import _layout


def all_gather_copy_in_reference(
    shards: Sequence[torch.Tensor], shard_numels: Sequence[int], dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Flatten, cast and zero-pad shard i to ``shard_numels[i]``; concatenate (length ``S``),
    into ``out`` when given. Each element is written once (the cast happens in the copy)."""
    layout = _layout(tuple(shard_numels))
    if not shards:
        return torch.empty(0, dtype=dtype)
    buffer = torch.empty(layout.total, dtype=dtype, device=shards[0].device) if out is None else out
    for shard, off, length in zip(shards, layout.offsets, shard_numels):
        n = shard.numel()
        buffer[off : off + n].copy_(shard.reshape(-1))
        if n < length:
            buffer[off + n : off + length].zero_()
    return buffer


def all_gather_copy_out_reference(
    gathered: torch.Tensor,
    shard_numels: Sequence[int],
    shapes: Sequence[Sequence[int]],
    world_size: int,
    dtype: torch.dtype | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Parameter i = concat over ranks of its segment in each rank's chunk, first numel(shape)
    elements: into ``out`` when given, else views of one new flat tensor. The whole rows
    (one per rank) are copied as one strided block, the partial last row after it."""
    layout = _layout(tuple(shard_numels))
    dtype = gathered.dtype if dtype is None else dtype
    per_rank = gathered.view(world_size, layout.total)
    numels = [math.prod(shape) for shape in shapes]
    if out is None:
        flat = torch.empty(sum(numels), dtype=dtype, device=gathered.device)
        out = [piece.view(tuple(shape)) for piece, shape in zip(flat.split(numels), shapes)]
    for target, off, length, numel in zip(out, layout.offsets, shard_numels, numels):
        target_flat = target.view(-1)
        rows = numel // length if length else 0
        if rows:
            target_flat[: rows * length].view(rows, length).copy_(per_rank[:rows, off : off + length])
        rest = numel - rows * length
        if rest:
            target_flat[rows * length :].copy_(per_rank[rows, off : off + rest])
    return list(out)


def reduce_scatter_copy_in_reference(
    grads: Sequence[torch.Tensor],
    shard_numels: Sequence[int],
    world_size: int,
    dtype: torch.dtype,
    divide_by: float | None = None,
) -> torch.Tensor:
    """Rank-major ``world_size * S`` buffer; segment (r, i) = grads[i].flat[r*L[i] : (r+1)*L[i]].
    Cast in the copy, then one in-place division of the whole buffer (the zero padding
    stays +0.0, since ``divide_by > 0``)."""
    layout = _layout(tuple(shard_numels))
    device = grads[0].device if len(grads) else None
    buffer = torch.empty(world_size, layout.total, dtype=dtype, device=device)
    for grad, off, length in zip(grads, layout.offsets, shard_numels):
        flat = grad.reshape(-1)
        region = buffer[:, off : off + length]  # rank r's segment of this gradient is row r
        rows = flat.numel() // length if length else world_size
        region[:rows].copy_(flat[: rows * length].view(rows, length))
        if rows < world_size:  # one partial row, then zero padding
            rest = flat.numel() - rows * length
            region[rows, :rest].copy_(flat[rows * length :])
            region[rows, rest:].zero_()
            region[rows + 1 :].zero_()
    if divide_by is not None:
        buffer.div_(float(divide_by))
    return buffer.view(-1)


def reduce_scatter_copy_out_reference(
    reduced: torch.Tensor,
    shard_numels: Sequence[int],
    local_numels: Sequence[int],
    dtype: torch.dtype,
    accumulate_into: Sequence[torch.Tensor] | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Shard i = ``reduced[off[i] : off[i] + local_numels[i]].to(dtype)``, written into
    ``out[i]`` when given, or added into ``accumulate_into[i]``."""
    layout = _layout(tuple(shard_numels))
    results = []
    for i, (off, n) in enumerate(zip(layout.offsets, local_numels)):
        if out is not None:
            out[i].view(-1).copy_(reduced[off : off + n])
            results.append(out[i])
            continue
        value = reduced[off : off + n].to(dtype=dtype, copy=True)
        if accumulate_into is not None:
            accumulate_into[i].view(-1).add_(value)
            value = accumulate_into[i]
        results.append(value)
    return results
