"""The ops the lowering passes insert around each bucket's collective, and how a graph
runner calls them.

``compshard::all_gather_copy_in`` / ``all_gather_copy_out`` / ``reduce_scatter_copy_in`` /
``reduce_scatter_copy_out``
    The pack/unpack work around one bucket's collective, lowered to
    :mod:`compshard.kernels` (one Triton launch per bucket on CUDA, the torch reference
    on CPU). A bucket's parameters are unpacked into one flat tensor (one allocation,
    one free) that the graph views, also when several buckets share one all-gather;
    gradients into one flat tensor each.
``compshard::free(buffer)``
    Releases a gathered buffer's storage, after the last use of every alias of it.

Only the backend inserts these ops, and they are plain copies without autograd, so a
graph runner may call their implementations directly (:func:`direct_call`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from compshard.comm.transport import sum_rows_into_shards

__all__ = ["direct_call"]

# ------------------------------------------------------------------------------- free


def _free(buffer: torch.Tensor) -> None:
    buffer.untyped_storage().resize_(0)


free = torch.library.custom_op("compshard::free", _free, mutates_args=("buffer",))


@free.register_fake
def _(buffer):
    return None


# ------------------------------------------------------------------- bucket pack/unpack


def _kernel(name: str, dtypes: list[torch.dtype], device: torch.device):
    """The copy a compiled graph runs: the public kernel function where it would launch a
    Triton kernel (its checks come first: a kernel must never see metadata that could make
    it write out of bounds), else the torch reference directly (other dtypes; CPU without
    ``TRITON_INTERPRET``): the compiler built the arguments, torch's own ops check their
    bounds, and the public function's checks cost host time per tensor on every call."""
    from compshard import kernels

    supported = all(dtype in kernels.SUPPORTED_DTYPES for dtype in dtypes)
    launches = supported and kernels.select_backend(device) != "reference"
    return getattr(kernels, name if launches else f"{name}_reference")


def _all_gather_copy_in(
    shards: list[torch.Tensor], shard_numels: list[int], dtype: torch.dtype, world_size: int, rank: int
) -> torch.Tensor:
    """The all-gather output buffer (``world_size`` slots of ``sum(shard_numels)``) with this
    rank's slot packed; the gather then fills the other slots in place, so no separate
    input buffer is held while it is in flight (as FSDP2 does)."""
    shards = [s.contiguous() for s in shards]
    slot = sum(shard_numels)
    buffer = shards[0].new_empty(world_size * slot, dtype=dtype)
    copy_in = _kernel("all_gather_copy_in", [dtype, *(s.dtype for s in shards)], buffer.device)
    copy_in(shards, shard_numels, dtype, out=buffer[rank * slot : (rank + 1) * slot])
    return buffer


all_gather_copy_in = torch.library.custom_op("compshard::all_gather_copy_in", _all_gather_copy_in, mutates_args=())


@all_gather_copy_in.register_fake
def _(shards, shard_numels, dtype, world_size, rank):
    return shards[0].new_empty(world_size * sum(shard_numels), dtype=dtype)


def _split_numels(numels: list[int], splits: list[int]) -> list[list[int]]:
    """``numels`` cut into consecutive runs of ``splits[i]`` parameters each."""
    starts = [sum(splits[:i]) for i in range(len(splits))]
    return [numels[start : start + count] for start, count in zip(starts, splits)]


def _all_gather_copy_out(
    gathered: torch.Tensor, shard_numels: list[int], numels: list[int], world_size: int, splits: list[int]
) -> list[torch.Tensor]:
    """The gathered parameters back to back in flat tensors, one per entry of ``splits``
    (how many parameters it holds, in order): each bucket of a coalesced all-gather gets
    its own, so each is freed on its own (the graph views them)."""
    runs = _split_numels(numels, splits)
    flats = [gathered.new_empty(sum(run)) for run in runs]
    outputs = [piece for flat, run in zip(flats, runs) for piece in flat.split(run)]
    copy_out = _kernel("all_gather_copy_out", [gathered.dtype], gathered.device)
    copy_out(gathered, shard_numels, [(n,) for n in numels], world_size, out=outputs)
    return flats


all_gather_copy_out = torch.library.custom_op("compshard::all_gather_copy_out", _all_gather_copy_out, mutates_args=())


@all_gather_copy_out.register_fake
def _(gathered, shard_numels, numels, world_size, splits):
    return [gathered.new_empty(sum(run)) for run in _split_numels(numels, splits)]


def _reduce_scatter_copy_in(
    grads: list[torch.Tensor], shard_numels: list[int], world_size: int, dtype: torch.dtype, divide_by: float | None
) -> torch.Tensor:
    grads = [g.contiguous() for g in grads]
    copy_in = _kernel("reduce_scatter_copy_in", [dtype, *(g.dtype for g in grads)], grads[0].device)
    return copy_in(grads, shard_numels, world_size, dtype, divide_by)


reduce_scatter_copy_in = torch.library.custom_op(
    "compshard::reduce_scatter_copy_in", _reduce_scatter_copy_in, mutates_args=()
)


@reduce_scatter_copy_in.register_fake
def _(grads, shard_numels, world_size, dtype, divide_by):
    return grads[0].new_empty(world_size * sum(shard_numels), dtype=dtype)


def _reduce_scatter_copy_out(
    reduced: torch.Tensor, shard_numels: list[int], local_numels: list[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    """This rank's rows of each parameter, cast to ``dtype``: one tensor each, since a
    custom op's outputs may not alias one another (the kernels' default is views of one
    buffer). ``reduced``: this rank's rows of the reduced buffer, or (2-D) the rows an
    exchange received from every rank (``Transport.reduce_scatters_by_exchange``), summed here
    parameter by parameter (:func:`sum_rows_into_shards`)."""
    if reduced.dim() == 2:
        return sum_rows_into_shards(reduced, shard_numels, local_numels, dtype)
    shards = [reduced.new_empty(n, dtype=dtype) for n in local_numels]
    copy_out = _kernel("reduce_scatter_copy_out", [dtype, reduced.dtype], reduced.device)
    copy_out(reduced, shard_numels, local_numels, dtype, out=shards)
    return shards


reduce_scatter_copy_out = torch.library.custom_op(
    "compshard::reduce_scatter_copy_out", _reduce_scatter_copy_out, mutates_args=()
)


@reduce_scatter_copy_out.register_fake
def _(reduced, shard_numels, local_numels, dtype):
    return [reduced.new_empty(n, dtype=dtype) for n in local_numels]


# [Note: direct calls] A scheduled graph's runner may call these ops' implementations
# directly instead of through the dispatcher: they are plain Python over plain tensors
# with no autograd (the compiled graphs run without it), and the dispatcher's entry to a
# Python custom op costs tens of microseconds a call, which a launch-bound GPU step
# (dozens of bucket copies and frees) pays on its critical path. Under the profiler the
# call still records the op's name, so traces show the same ranges.
_DIRECT_IMPLEMENTATIONS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    torch.ops.compshard.free.default: _free,
    torch.ops.compshard.all_gather_copy_in.default: _all_gather_copy_in,
    torch.ops.compshard.all_gather_copy_out.default: _all_gather_copy_out,
    torch.ops.compshard.reduce_scatter_copy_in.default: _reduce_scatter_copy_in,
    torch.ops.compshard.reduce_scatter_copy_out.default: _reduce_scatter_copy_out,
}


def direct_call(target: Callable) -> Callable:
    """What a graph runner calls for a node of ``target``: the implementation itself for
    compshard's bucket copies and ``free`` (see [Note: direct calls]), else ``target``."""
    if not isinstance(target, torch._ops.OpOverload) or target not in _DIRECT_IMPLEMENTATIONS:
        return target
    implementation = _DIRECT_IMPLEMENTATIONS[target]
    name = target.name()

    def call(*args, **kwargs):
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(name):
                return implementation(*args, **kwargs)
        return implementation(*args, **kwargs)

    return call
