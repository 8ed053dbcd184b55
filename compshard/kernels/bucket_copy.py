"""Copies around bucketed collectives: the public, validated, dispatching API.

Layout contract (layout-agnostic: only flat element ranges matter).  A bucket
holds parameters i = 0..k-1 with ``numel[i]`` elements and a per-rank padded
shard length ``L[i] = shard_numels[i]`` with ``L[i] * world_size >= numel[i]``.
Rank r's shard of parameter i is ``flat(param_i)[r*L[i] : (r+1)*L[i]]``,
zero-padded past ``numel[i]``.  ``S = sum(L)``, ``off[i] = sum(L[:i])``.
Collective buffers are rank-major: rank r's chunk is ``[r*S, (r+1)*S)``.

Dispatch, decided per call (the environment is read at call time):
  * CUDA tensors -> one Triton launch (falls back to the reference, with a
    warning, when triton is not installed);
  * CPU tensors with ``TRITON_INTERPRET=1`` and triton installed -> the same
    kernel run by Triton's interpreter (how the tests check the kernel);
  * everything else (CPU, other devices, tensor subclasses such as FakeTensor,
    calls while torch.compile is tracing) -> the pure-torch reference.

All inputs must be contiguous, of dtype float32/bfloat16/float16, on one
device; anything else raises ``TypeError``/``ValueError`` naming the argument,
before anything is written.  The functions are not differentiable (they run
under ``torch.no_grad``).  Casts round to nearest even and match torch bit for
bit (NaN stays NaN; its payload may differ from torch's, which is itself not
consistent between CPU and CUDA).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from compshard.logs import warn

from . import _triton_launch
from ._checks import (
    check_divide_by,
    check_dtype,
    check_numels,
    check_tensor,
    check_tensor_list,
    check_world_size,
    layout_for,
    numel_of_shape,
)
from .reference import (
    all_gather_copy_in_reference,
    all_gather_copy_out_reference,
    reduce_scatter_copy_in_reference,
    reduce_scatter_copy_out_reference,
)

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "reduce_scatter_copy_out",
    "select_backend",
]

_warned_no_triton = False


def select_backend(device: torch.device, tensors: Sequence[torch.Tensor] = ()) -> str:
    """Which implementation a call with tensors on ``device`` uses: "triton", "interpreter" or "reference"."""
    global _warned_no_triton
    for t in tensors:
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return "reference"  # FakeTensor, DTensor, ...: no raw data pointers
    if torch.compiler.is_compiling():
        return "reference"
    if device.type == "cuda":
        if _triton_launch.triton_available():
            return "triton"
        if not _warned_no_triton:
            _warned_no_triton = True
            warn(
                "compshard.kernels: triton is not installed; bucket copies on CUDA use the slower torch reference",
                RuntimeWarning,
            )
        return "reference"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _triton_launch.triton_available():
        return "interpreter"
    return "reference"


def _check_out_buffer(out: torch.Tensor, numel: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.dim() != 1 or out.numel() != numel or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous 1-D {dtype} tensor of {numel} elements on {device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device} (contiguous={out.is_contiguous()})"
        )


def _empty_bucket_error(name: str) -> ValueError:
    return ValueError(f"{name} is empty; a bucket needs at least one parameter (its device is unknown otherwise)")


@torch.no_grad()
def all_gather_copy_in(
    shards: Sequence[torch.Tensor], shard_numels: Sequence[int], dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack this rank's shards into one all-gather input buffer of length ``S``.

    ``shards[i]`` (any shape, contiguous, at most ``L[i]`` elements, all of one
    dtype) is flattened, cast to ``dtype`` and zero-padded to ``L[i]``; the
    result is a 1-D tensor ``[shard_0 | pad | shard_1 | pad | ...]``: ``out`` when
    given (contiguous, 1-D, ``S`` elements of ``dtype``; e.g. this rank's slot of the
    all-gather output, so the gather runs in place), else a new tensor.
    """
    layout = layout_for(shard_numels)
    dtype = check_dtype("dtype", dtype)
    if not layout.shard_numels:
        raise _empty_bucket_error("shards")
    shards, device = check_tensor_list("shards", shards, len(layout.shard_numels), None)
    numels = [s.numel() for s in shards]
    for i, (n, length) in enumerate(zip(numels, layout.shard_numels)):
        if n > length:
            raise ValueError(f"shards[{i}] has {n} elements, more than shard_numels[{i}] = {length}")
    if out is not None:
        _check_out_buffer(out, layout.total, dtype, device)
    backend = select_backend(device, shards)
    if backend == "reference":
        return all_gather_copy_in_reference(shards, layout.shard_numels, dtype, out=out)
    if out is None:
        out = torch.empty(layout.total, dtype=dtype, device=device)
    base, itemsize = out.data_ptr(), dtype.itemsize
    k = len(shards)
    _triton_launch.launch(
        interpret=backend == "interpreter",
        device=device,
        src_dtype=shards[0].dtype,
        dst_dtype=dtype,
        src_addrs=[s.data_ptr() for s in shards],
        dst_addrs=[base + off * itemsize for off in layout.offsets],
        seg_lens=layout.shard_numels,
        valids=numels,
        src_rank_strides=[0] * k,
        dst_rank_strides=[0] * k,
        num_segments=1,
        pad=True,
    )
    return out


@torch.no_grad()
def all_gather_copy_out(
    gathered: torch.Tensor,
    shard_numels: Sequence[int],
    shapes: Sequence[Sequence[int]],
    world_size: int,
    dtype: torch.dtype | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Unpack an all-gather output (``world_size * S``, rank-major) into full parameters.

    Parameter i is the concatenation over ranks r of
    ``gathered[r*S + off[i] : r*S + off[i] + L[i]]``, truncated to
    ``numel(shapes[i])`` and viewed as ``shapes[i]``, cast to ``dtype``
    (default: ``gathered.dtype``).  With ``out``, writes into those tensors
    (exact shape, that dtype, contiguous, same device) and returns them;
    otherwise returns views of one new flat buffer (one allocation, shared
    storage).
    """
    layout = layout_for(shard_numels)
    world_size = check_world_size(world_size)
    check_tensor("gathered", gathered, None)
    device = gathered.device
    dtype = gathered.dtype if dtype is None else check_dtype("dtype", dtype)
    k = len(layout.shard_numels)
    if gathered.dim() != 1 or gathered.numel() != world_size * layout.total:
        raise ValueError(
            f"gathered must be 1-D with world_size * sum(shard_numels) = {world_size * layout.total} elements, "
            f"got shape {tuple(gathered.shape)}"
        )
    if isinstance(shapes, torch.Tensor) or not isinstance(shapes, Sequence) or len(shapes) != k:
        raise ValueError(f"shapes must be a list of {k} shapes (one per entry of shard_numels), got {shapes!r}")
    dims, numels = [], []
    for i, (shape, length) in enumerate(zip(shapes, layout.shard_numels)):
        d, n = numel_of_shape(f"shapes[{i}]", shape)
        if n > world_size * length:
            raise ValueError(
                f"shapes[{i}] = {d} has {n} elements but shard_numels[{i}] * world_size = {length * world_size}"
            )
        dims.append(d)
        numels.append(n)
    if out is not None:
        out, _ = check_tensor_list("out", out, k, device, dtype)
        for i, (t, d) in enumerate(zip(out, dims)):
            if tuple(t.shape) != d:
                raise ValueError(f"out[{i}] has shape {tuple(t.shape)} but shapes[{i}] is {d}")
    backend = select_backend(device, [gathered, *(out or ())])
    if backend == "reference":
        return all_gather_copy_out_reference(gathered, layout.shard_numels, dims, world_size, dtype, out)
    if out is None:
        flat = torch.empty(sum(numels), dtype=dtype, device=device)
        results = [v.view(d) for v, d in zip(torch.split(flat, numels), dims)]
    else:
        results = list(out)
    base, itemsize = gathered.data_ptr(), gathered.dtype.itemsize
    _triton_launch.launch(
        interpret=backend == "interpreter",
        device=device,
        src_dtype=gathered.dtype,
        dst_dtype=dtype,
        src_addrs=[base + off * itemsize for off in layout.offsets],
        dst_addrs=[t.data_ptr() for t in results],
        seg_lens=layout.shard_numels,
        valids=numels,
        src_rank_strides=[layout.total] * k,
        dst_rank_strides=layout.shard_numels,
        num_segments=world_size,
    )
    return results


@torch.no_grad()
def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    shard_numels: Sequence[int],
    world_size: int,
    dtype: torch.dtype,
    divide_by: float | None = None,
) -> torch.Tensor:
    """Pack full gradients into a reduce-scatter input (``world_size * S``, rank-major).

    Segment (r, i) is ``flat(grads[i])[r*L[i] : (r+1)*L[i]]`` cast to ``dtype``,
    divided by ``divide_by`` when given (``x.to(dtype) / divide_by``, IEEE
    division), zero-padded (+0.0, not divided) to ``L[i]``.  ``grads[i]`` (any
    shape, contiguous, one dtype) has at most ``world_size * L[i]`` elements.
    """
    layout = layout_for(shard_numels)
    world_size = check_world_size(world_size)
    dtype = check_dtype("dtype", dtype)
    divide_by = check_divide_by(divide_by)
    k = len(layout.shard_numels)
    if k == 0:
        raise _empty_bucket_error("grads")
    grads, device = check_tensor_list("grads", grads, k, None)
    numels = [g.numel() for g in grads]
    for i, (n, length) in enumerate(zip(numels, layout.shard_numels)):
        if n > world_size * length:
            raise ValueError(f"grads[{i}] has {n} elements but shard_numels[{i}] * world_size = {length * world_size}")
    backend = select_backend(device, grads)
    if backend == "reference":
        return reduce_scatter_copy_in_reference(grads, layout.shard_numels, world_size, dtype, divide_by)
    out = torch.empty(world_size * layout.total, dtype=dtype, device=device)
    base, itemsize = out.data_ptr(), dtype.itemsize
    _triton_launch.launch(
        interpret=backend == "interpreter",
        device=device,
        src_dtype=grads[0].dtype,
        dst_dtype=dtype,
        src_addrs=[g.data_ptr() for g in grads],
        dst_addrs=[base + off * itemsize for off in layout.offsets],
        seg_lens=layout.shard_numels,
        valids=numels,
        src_rank_strides=layout.shard_numels,
        dst_rank_strides=[layout.total] * k,
        num_segments=world_size,
        pad=True,
        divide_by=divide_by,
    )
    return out


@torch.no_grad()
def reduce_scatter_copy_out(
    reduced: torch.Tensor,
    shard_numels: Sequence[int],
    local_numels: Sequence[int],
    dtype: torch.dtype,
    accumulate_into: Sequence[torch.Tensor] | None = None,
    out: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Unpack a reduce-scatter output (length ``S``) into per-parameter gradient shards.

    Shard i is ``reduced[off[i] : off[i] + local_numels[i]]`` cast to ``dtype``
    (``local_numels[i] <= L[i]``).  With ``accumulate_into``, computes
    ``accumulate_into[i] += shard_i``; with ``out``, writes shard i into ``out[i]``
    (either: same numel, any shape, that dtype, contiguous, same device; not both)
    and returns those tensors; otherwise returns 1-D views of one new flat buffer (one
    allocation, shared storage).
    """
    layout = layout_for(shard_numels)
    k = len(layout.shard_numels)
    local = check_numels("local_numels", local_numels, k)
    dtype = check_dtype("dtype", dtype)
    check_tensor("reduced", reduced, None)
    device = reduced.device
    if reduced.dim() != 1 or reduced.numel() != layout.total:
        raise ValueError(
            f"reduced must be 1-D with sum(shard_numels) = {layout.total} elements, got shape {tuple(reduced.shape)}"
        )
    for i, (n, length) in enumerate(zip(local, layout.shard_numels)):
        if n > length:
            raise ValueError(f"local_numels[{i}] = {n} exceeds shard_numels[{i}] = {length}")
    if accumulate_into is not None and out is not None:
        raise ValueError("reduce_scatter_copy_out takes accumulate_into or out, not both")
    name, destinations = ("out", out) if accumulate_into is None else ("accumulate_into", accumulate_into)
    if destinations is not None:
        destinations, _ = check_tensor_list(name, destinations, k, device, dtype)
        for i, (t, n) in enumerate(zip(destinations, local)):
            if t.numel() != n:
                raise ValueError(f"{name}[{i}] has {t.numel()} elements but local_numels[{i}] is {n}")
    backend = select_backend(device, [reduced, *(destinations or ())])
    if backend == "reference":
        validated = {name: destinations} if destinations is not None else {}
        return reduce_scatter_copy_out_reference(reduced, layout.shard_numels, local, dtype, **validated)
    if destinations is None:
        results = list(torch.split(torch.empty(sum(local), dtype=dtype, device=device), list(local)))
    else:
        results = list(destinations)
    base, itemsize = reduced.data_ptr(), reduced.dtype.itemsize
    _triton_launch.launch(
        interpret=backend == "interpreter",
        device=device,
        src_dtype=reduced.dtype,
        dst_dtype=dtype,
        src_addrs=[base + off * itemsize for off in layout.offsets],
        dst_addrs=[t.data_ptr() for t in results],
        seg_lens=local,
        valids=local,
        src_rank_strides=[0] * k,
        dst_rank_strides=[0] * k,
        num_segments=1,
        accumulate=accumulate_into is not None,
    )
    return results
