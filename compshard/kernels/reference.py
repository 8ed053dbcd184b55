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

Speed on CPU, where these run in training: packing is one ``torch.cat`` into the
buffer (its CPU kernel copies input after input without a dispatch per tensor, and it
casts as ``Tensor.to`` does), or, for a reduce-scatter that divides and does not cast,
one ``torch.div`` per gradient into its columns (the division in the same pass);
unpacking is one ``torch._foreach_*`` call over views from one ``split`` (C++ loops, no
Python per parameter), and only a parameter whose elements do not fill its
``world_size`` padded rows (a partial last row) takes Python steps of its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._checks import _layout

__all__ = [
    "all_gather_copy_in_reference",
    "all_gather_copy_out_reference",
    "reduce_scatter_copy_in_reference",
    "reduce_scatter_copy_out_reference",
]


def _segments(flat: torch.Tensor, used: Sequence[int], lengths: Sequence[int]) -> list[torch.Tensor]:
    """``flat`` cut into consecutive segments of ``lengths[i]`` elements: views of the first
    ``used[i]`` elements of each."""
    if list(used) == list(lengths):
        return list(flat.split(list(lengths)))
    return list(flat.split([size for n, length in zip(used, lengths) for size in (n, length - n)])[0::2])


def _filling(numels: Sequence[int], shard_numels: Sequence[int], world_size: int) -> tuple[list[int], list[int]]:
    """Indices of the parameters that fill their ``world_size`` rows of ``shard_numels[i]``
    (one strided block each), and of the others (a partial last row)."""
    full = [i for i, (numel, length) in enumerate(zip(numels, shard_numels)) if numel == world_size * length]
    return full, sorted(set(range(len(numels))) - set(full))


def _padded(flats: Sequence[torch.Tensor], lengths: Sequence[int]) -> list[torch.Tensor]:
    """``flats``, each followed by zeros up to ``lengths[i]`` elements where it is shorter
    (views of one zero tensor): the pieces one ``torch.cat`` packs."""
    pads = [length - flat.numel() for flat, length in zip(flats, lengths)]
    if not any(pads):
        return list(flats)
    zeros = flats[0].new_zeros(max(pads))
    return [piece for flat, pad in zip(flats, pads) for piece in ((flat, zeros[:pad]) if pad else (flat,))]


def all_gather_copy_in_reference(
    shards: Sequence[torch.Tensor], shard_numels: Sequence[int], dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Flatten, cast and zero-pad shard i to ``shard_numels[i]``; concatenate (length ``S``),
    into ``out`` when given. Each element is written once (the cast happens in the copy)."""
    layout = _layout(tuple(shard_numels))
    if not shards:
        return torch.empty(0, dtype=dtype)
    buffer = torch.empty(layout.total, dtype=dtype, device=shards[0].device) if out is None else out
    torch.cat(_padded([shard.view(-1) for shard in shards], shard_numels), out=buffer)
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
    elements: into ``out`` when given, else views of one new flat tensor. A parameter
    filling its rows is one strided block (column i of the ``(world_size, S)`` view);
    a partial last row is copied after its whole rows."""
    dtype = gathered.dtype if dtype is None else dtype
    columns = gathered.view(world_size, -1).split(list(shard_numels), dim=1)
    numels = [math.prod(shape) for shape in shapes]
    if out is None:
        flat = torch.empty(sum(numels), dtype=dtype, device=gathered.device)
        out = [piece.view(tuple(shape)) for piece, shape in zip(flat.split(numels), shapes)]
    full, partial = _filling(numels, shard_numels, world_size)
    if full:
        torch._foreach_copy_([out[i].view(world_size, shard_numels[i]) for i in full], [columns[i] for i in full])
    for i in partial:
        target_flat, length, column = out[i].view(-1), shard_numels[i], columns[i]
        rows, rest = divmod(numels[i], length)
        if rows:
            target_flat[: rows * length].view(rows, length).copy_(column[:rows])
        if rest:
            target_flat[rows * length :].copy_(column[rows, :rest])
    return list(out)


def reduce_scatter_copy_in_reference(
    grads: Sequence[torch.Tensor],
    shard_numels: Sequence[int],
    world_size: int,
    dtype: torch.dtype,
    divide_by: float | None = None,
) -> torch.Tensor:
    """Rank-major ``world_size * S`` buffer; segment (r, i) = grads[i].flat[r*L[i] : (r+1)*L[i]].
    Gradient i is the ``(world_size, L[i])`` block of columns ``off[i]..`` (a gradient short
    of its rows zero-padded first, into a temporary). With a division and no cast, each
    block is divided straight into its columns (one ``torch.div(..., out=)`` per gradient:
    one pass over the buffer instead of a copy and a division); otherwise all blocks are packed
    and cast by one ``torch.cat`` along the columns, then the whole buffer is divided in
    place. Either way each element is ``x.to(dtype) / divide_by`` (the zero padding stays
    +0.0, since ``divide_by > 0``)."""
    layout = _layout(tuple(shard_numels))
    device = grads[0].device if len(grads) else None
    buffer = torch.empty(world_size, layout.total, dtype=dtype, device=device)
    blocks = [
        torch.cat(_padded([grad.reshape(-1)], [world_size * length])).view(world_size, length)
        if grad.numel() < world_size * length
        else grad.view(world_size, length)
        for grad, length in zip(grads, shard_numels)
    ]
    if divide_by is not None and all(block.dtype == dtype for block in blocks):
        for block, columns in zip(blocks, buffer.split(list(shard_numels), dim=1)):
            torch.div(block, float(divide_by), out=columns)
        return buffer.view(-1)
    if blocks:
        torch.cat(blocks, dim=1, out=buffer)
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
    ``out[i]`` when given, added into ``accumulate_into[i]`` (cast first, then added), or
    else into views of one new flat tensor."""
    pieces = _segments(reduced, local_numels, shard_numels)
    if accumulate_into is not None:
        values = pieces if reduced.dtype == dtype else [piece.to(dtype) for piece in pieces]
        torch._foreach_add_([acc.view(-1) for acc in accumulate_into], values)
        return list(accumulate_into)
    if out is None:
        out = list(torch.empty(sum(local_numels), dtype=dtype, device=reduced.device).split(list(local_numels)))
    torch._foreach_copy_([target.view(-1) for target in out], pieces)
    return list(out)
