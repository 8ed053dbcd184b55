"""Step gathering: a sharded module's parameters gathered once and held for a whole step.

Inside ``with gathered_for_step(module):`` (``module``: the module passed to
``compshard.shard``) every read of one of its sharded parameters, compiled or not,
returns that parameter's full tensor gathered on entry, instead of gathering it
(``compshard::unshard``). So the forwards and backwards of any number of micro-batches
in the block run with no collective at all, and every backward accumulates each
parameter's *full* gradient into the gathered tensor's ``.grad`` (in the gathered dtype).
:func:`compshard.sharding.grad_sync.reduce_accumulated_gradients`, called inside the block,
reduce-scatters those sums once, in buckets, and ends the step: it frees each
trainable gathered parameter's storage as it takes its gradient, before its bucket's
reduction allocates, whatever still references the tensor (the autograd graph of a loss
the caller holds does; no parameter may be read after it). Leaving the block drops what
is left (frozen parameters, and everything when the block ends without a reduction).

Entry gathers in buckets: the parameters in registration order (the same on every rank)
into buckets of consecutive parameters with the same shard group, gathered dtype and
device, each closed before its full parameters would pass ``bucket_bytes`` (a larger
one is a bucket alone): one blocking all-gather per bucket, whatever the block then
reads. Parameters with one shard (0-d ones, or a one-rank shard group) are copied, not
gathered. Each gathered parameter has storage of its own (compiled graphs take them as
separate, non-aliasing inputs) and requires grad as its parameter does.

Trade-off, memory against communication: one all-gather per bucket and step instead of
one (or two, with ``reshard_after_forward``) per bucket and micro-batch, for holding the
module's full parameters (``shard_size`` times its shards) from entry to the reduction,
with its full gradients beside them from the first backward (as
``compshard.no_sync`` holds those). That is what FSDP2 does for a root unit under a
pipeline schedule (gathered once, resharded after the last micro-batch's backward). No
gather overlaps compute: entry waits for every bucket.

Compiled graphs read the gathered tensors as graph inputs (no ``unshard`` op: nothing
to lower, no collective in the graph). Dynamo guards on their metadata (shape, dtype,
``requires_grad``), not on their identity, so each step's new tensors reuse the graphs
compiled in the first step; a module run both inside and outside the block gets one set
of graphs for each.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

from compshard.comm.layout import ShardLayout, group_rank
from compshard.comm.transport import all_gather_rows
from compshard.sharding.grad_sync import DEFAULT_BUCKET_BYTES, consecutive_buckets, grad_sync_state
from compshard.sharding.spec import ParamSpec

__all__ = ["gather_buckets", "gathered_for_step", "shard_buckets"]


class _Shard(NamedTuple):
    """One parameter to gather: its spec, its local rows and the dtype to gather in."""

    spec: ParamSpec
    rows: torch.Tensor  # this rank's rows, on the compute device
    dtype: torch.dtype
    unit: str | None  # parameters of different units are gathered apart (None: any may share)

    @property
    def key(self) -> tuple:
        """What parameters gathered in one collective must share."""
        return (self.spec.world_size, self.spec.group_name, self.dtype, self.rows.device, self.unit)

    @property
    def nbytes(self) -> int:  # gathered
        return math.prod(self.spec.full_shape) * self.dtype.itemsize

    @property
    def communicates(self) -> bool:
        return bool(self.spec.full_shape) and self.spec.world_size > 1


@contextlib.contextmanager
def gathered_for_step(module: nn.Module, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[nn.Module]:
    """Gather ``module``'s parameters once on entry and let every parameter read in the
    block return them (see the module docstring for the memory this holds)::

        with gathered_for_step(model):
            for x, y in micro_batches:
                step_model(x, y).backward()          # no collective
            reduce_accumulated_gradients(model, divide_by=len(micro_batches))

    ``bucket_bytes``: at most this many bytes of full parameters per all-gather. The
    block does not nest. Collective: every rank of the module's shard groups enters it
    at the same point."""
    state = grad_sync_state(module)
    if state.step_gathered is not None:
        raise RuntimeError(
            "compshard.sharding.gathered_for_step: the module's parameters are already gathered for this step"
        )
    state.step_gathered = _gather(module, bucket_bytes)
    try:
        yield module
    finally:
        state.step_gathered = None


def _gather(module: nn.Module, bucket_bytes: int) -> dict[str, torch.Tensor]:
    """Each parameter's full tensor, by canonical name, gathered in buckets."""
    params = dict(module.named_parameters())
    gathered: dict[str, torch.Tensor] = {}
    for bucket in gather_buckets(grad_sync_state(module).specs.values(), params, bucket_bytes):
        gathered.update(_as_leaves(bucket, params))
    return gathered


def gather_buckets(
    specs: Iterable[ParamSpec],
    params: Mapping[str, nn.Parameter],
    bucket_bytes: int,
    unit_of: Callable[[str], str | None] = lambda name: None,
) -> Iterator[list[tuple[ParamSpec, torch.Tensor]]]:
    """The full tensors (in the gathered dtype, without autograd) of the parameters of
    ``specs`` (``params``: canonical name -> parameter), one bucket at a time, as the
    module docstring says: each bucket's all-gather runs when the bucket is taken
    (``unit_of``: as :func:`shard_buckets` takes it)."""
    with torch.no_grad():
        for bucket in shard_buckets(specs, params, bucket_bytes, unit_of):
            if bucket[0].communicates:
                full = _all_gather(bucket)
            else:
                full = [bucket[0].rows.to(bucket[0].dtype, copy=True).view(bucket[0].spec.full_shape)]
            yield [(item.spec, tensor) for item, tensor in zip(bucket, full)]


def shard_buckets(
    specs: Iterable[ParamSpec],
    params: Mapping[str, nn.Parameter],
    bucket_bytes: int,
    unit_of: Callable[[str], str | None] = lambda name: None,
) -> Iterator[list[_Shard]]:
    """The buckets :func:`gather_buckets` gathers (a bucket that does not
    :attr:`~_Shard.communicates` is one parameter, copied); ``unit_of``: parameter name
    -> the unit whose parameters alone may share a bucket (None: any)."""

    def shards() -> Iterator[_Shard]:
        for spec in specs:
            param = params[spec.fqn]
            rows = param.to_local() if hasattr(param, "to_local") else param
            if spec.compute_device is not None:
                rows = rows.to(spec.compute_device, non_blocking=True)
            yield _Shard(spec, rows, spec.param_dtype or rows.dtype, unit_of(spec.fqn))

    yield from consecutive_buckets(shards(), bucket_bytes, alone=lambda item: not item.communicates)


def _all_gather(bucket: list[_Shard]) -> list[torch.Tensor]:
    """The full tensors of ``bucket`` (same :attr:`_Shard.key`) through one all-gather, in
    place into its output buffer, as a compiled graph gathers a bucket: this rank's rows
    packed into its slot (``compshard::all_gather_copy_in``), the others gathered beside
    them, then each parameter unpacked into a flat tensor of its own."""
    first = bucket[0]
    world_size, group_name = first.spec.world_size, first.spec.group_name
    rank = group_rank(group_name)
    layouts = [ShardLayout(item.spec.full_shape, world_size, rank) for item in bucket]
    shard_numels = [layout.padded_shard_numel for layout in layouts]
    buffer = torch.ops.compshard.all_gather_copy_in(
        [item.rows for item in bucket], shard_numels, first.dtype, world_size, rank
    )
    buffer = all_gather_rows(buffer, world_size, group_name)
    flats = torch.ops.compshard.all_gather_copy_out(
        buffer, shard_numels, [layout.numel for layout in layouts], world_size, [1] * len(bucket)
    )
    return [flat.view(item.spec.full_shape) for flat, item in zip(flats, bucket)]


def _as_leaves(
    bucket: list[tuple[ParamSpec, torch.Tensor]], params: dict[str, nn.Parameter]
) -> dict[str, torch.Tensor]:
    """The gathered tensors as autograd leaves that accumulate their parameter's full
    gradient (frozen parameters stay without grad)."""
    return {spec.fqn: tensor.detach().requires_grad_(params[spec.fqn].requires_grad) for spec, tensor in bucket}
