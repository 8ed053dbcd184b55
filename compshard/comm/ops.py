"""The parameter-lifecycle vocabulary: ``torch.library`` custom ops the passes match.

``compshard::unshard(shard) -> full``
    All-gathers one parameter's local ``Shard(0)`` rows within its shard group into the
    full tensor (cast to the compute dtype first, when one is set). Its autograd formula
    depends on ``grad_sync`` (a static fact, so a compiled graph has one formula):
    ``"reduce"``: ``reduce_grad``; ``"accumulate"`` (gradient sync off, see
    :mod:`compshard.grad_sync`): the full gradient goes to ``grad_sink``, a full-shape
    compshard-owned leaf whose ``.grad`` autograd accumulates, and no collective runs;
    ``"fold"``: ``grad_sink`` is that accumulated gradient, added to this gradient
    before the one ``reduce_grad``.
``compshard::reduce_grad(full_grad) -> local_grad``
    Reduce-scatters a full gradient to this rank's rows within the shard group
    (all-reduces a replicated one), then all-reduces the result across the replica group
    when there is one (hybrid sharding, or no sharding), divided by the number of ranks
    first, then summed: the average over all data-parallel ranks, as DDP does.
``compshard::gather_rows_(buffer)``
    Starts an all-gather in place on gloo (see :func:`all_gathers_by_send_recv`): every
    rank sends its row of the rank-major ``buffer`` (its own row filled) to every other
    rank and receives theirs. Returns ``buffer``; ``_c10d_functional.wait_tensor`` on it
    waits for every send and receive.
``compshard::exchange_rows_(buffer)``
    Starts the all-to-all of a sum reduce-scatter run as an exchange on gloo (see
    :func:`reduce_scatters_by_exchange`), in place: row ``p`` of the rank-major
    ``buffer``, what this rank sends rank ``p``, becomes what rank ``p`` sends this
    rank. Returns ``buffer``; ``wait_tensor`` on it waits for the exchange.
``compshard::free(buffer)``
    Releases a gathered buffer's storage. Only the backend inserts it, after the last use
    of every alias of the buffer.
``compshard::all_gather_copy_in`` / ``all_gather_copy_out`` / ``reduce_scatter_copy_in`` /
``reduce_scatter_copy_out``
    The pack/unpack work around one bucket's collective, lowered to
    :mod:`compshard.kernels` (one Triton launch per bucket on CUDA, the torch reference
    on CPU). Only the backend inserts them. A bucket's parameters are unpacked into one
    flat tensor (one allocation, one free) that the graph views, also when several
    buckets share one all-gather; gradients into one flat tensor each.

Eagerly the ops communicate for real (so an uncompiled or graph-broken module trains
correctly, one blocking collective per parameter and module call); in a compiled graph they are markers that
the lowering passes replace by asynchronous functional collectives. Besides tensors,
``unshard`` and ``reduce_grad`` take one ``spec`` string (see [Note: one spec
argument]; :class:`UnshardArgs` and :class:`ReduceGradArgs` read it). Parameters are
identified by name (``param``), so every rank sees the same op arguments;
``reshard_after_forward`` tells the partitioning passes whether the gathered tensor may
be saved for backward (it does not change what the op computes).

Shard layout (the contract shared with :mod:`compshard.kernels`): with ``rows = ceil(dim0 / N)``
the padded shard has ``L = rows * row_numel`` elements and rank ``r`` holds the flat slice
``[r * L, (r + 1) * L)`` of the full tensor, clipped to its numel. That is ``torch.chunk``
along dim 0, i.e. DTensor ``Shard(0)``. 0-d parameters are replicated instead.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from compshard.comm import liveness

__all__ = [
    "GRAD_SYNC_MODES",
    "ReduceGradArgs",
    "ShardLayout",
    "UnshardArgs",
    "all_gather_rows",
    "all_gathers_by_send_recv",
    "averaging_ranks",
    "backend_name",
    "direct_call",
    "exchange_rows",
    "exchanged_rows",
    "group_rank",
    "group_size",
    "reduce_scatters_by_exchange",
    "resolve_group",
    "simulated_backends",
    "sum_over_ranks",
    "sum_rows",
    "sum_rows_into_shards",
]

GRAD_SYNC_MODES = ("reduce", "accumulate", "fold")

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class ShardLayout:
    """Static facts of one parameter's sharding. Identical on every rank but ``rank``."""

    full_shape: tuple[int, ...]
    world_size: int
    rank: int

    @property
    def replicated(self) -> bool:
        return len(self.full_shape) == 0

    @property
    def numel(self) -> int:
        return math.prod(self.full_shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.full_shape[1:])

    @property
    def rows_per_rank(self) -> int:
        return -(-self.full_shape[0] // self.world_size) if self.full_shape else 1

    @property
    def padded_shard_numel(self) -> int:
        """``L``: elements each rank contributes to the all-gather."""
        return self.numel if self.replicated else self.rows_per_rank * self.row_numel

    @property
    def local_rows(self) -> tuple[int, int]:
        """``[start, stop)`` rows of dim 0 this rank holds."""
        start = min(self.rank * self.rows_per_rank, self.full_shape[0])
        return start, min(start + self.rows_per_rank, self.full_shape[0])

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.replicated:
            return ()
        start, stop = self.local_rows
        return (stop - start, *self.full_shape[1:])


def group_rank(group_name: str) -> int:
    return dist.get_rank(resolve_group(group_name)) if group_name else 0


def resolve_group(group_name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    # (torch 2.13 types the name as its NewType GroupName, which older torch may not define)
    return _resolve_process_group(group_name)  # type: ignore[arg-type]


def group_size(group_name: str) -> int:
    """Ranks in the named group; 1 for ``""`` (no group)."""
    return dist.get_world_size(resolve_group(group_name)) if group_name else 1


_simulated_backends: dict[str, str] = {}  # process group name -> the backend it stands for


@contextlib.contextmanager
def simulated_backends(backend_by_group: dict[str, str]) -> Iterator[None]:
    """Within: these process groups (``compshard.plan``'s groups on the ``"fake"``
    backend) count as the named backend (``"gloo"``, ``"nccl"``) wherever the backend
    decides something: the scratch memory of collectives, how a reduce-scatter is run."""
    _simulated_backends.update(backend_by_group)
    try:
        yield
    finally:
        for name in backend_by_group:
            _simulated_backends.pop(name, None)


def backend_name(group_name: str, device: torch.device) -> str | None:
    """The name of the backend (``"gloo"``, ``"nccl"``, ...) that runs the named group's
    collectives on ``device``; None when the group is not known here."""
    if group_name in _simulated_backends:
        return _simulated_backends[group_name]
    try:
        return resolve_group(group_name)._get_backend(device).name()
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return None


def reduce_scatters_by_exchange(group_name: str, device: torch.device) -> bool:
    """Whether a sum reduce-scatter on this group is run as an all-to-all of the rank-major
    buffer (``compshard::exchange_rows_``, in place) followed by a local sum of the
    ``world_size`` received rows. gloo (torch 2.11 to 2.13) runs ``reduce_scatter_tensor``
    as an all-reduce of the whole buffer, which moves twice the bytes of the all-to-all
    and reduces every element on every rank. gloo's all-to-all receives into a
    temporary, which the in-place op's wait copies back;
    eager reductions send and receive the rows instead, and read them once
    (:func:`exchanged_rows`).
    The sum adds the ranks' rows in rank order: at two ranks the result is the same
    bits (addition commutes); with more, the order may differ from gloo's."""
    return backend_name(group_name, device) == "gloo"


def all_gathers_by_send_recv(group_name: str, device: torch.device) -> bool:
    """Whether an all-gather on this group runs in place as sends and receives of the
    rank-major output's rows (``compshard::gather_rows_``): each rank sends its row to
    every other rank and receives theirs into their rows. gloo (torch 2.11 to 2.13)
    receives an all-gather into two temporaries of its output's size and then copies
    them into the output; the sends and receives allocate nothing and copy nothing (the
    same bytes either way, the same gathered bits)."""
    return backend_name(group_name, device) == "gloo"


# The point-to-point tag of compshard's row sends: a user's own sends on the same group
# (tag 0 by default) cannot be taken for them.
GATHER_ROWS_TAG = 0x6373
EXCHANGE_ROWS_TAG = GATHER_ROWS_TAG + 1  # eager reductions' sends (exchanged_rows)


def _peers(rank: int, world_size: int) -> Iterator[tuple[int, int]]:
    """``(to, source)`` for each step of a send-and-receive exchange among ``world_size``
    ranks: at step ``s`` this rank sends to rank ``rank + s`` and receives from rank
    ``rank - s`` (modulo ``world_size``), so the sends go out at once and each rank's
    order starts at its next peer."""
    for step in range(1, world_size):
        yield (rank + step) % world_size, (rank - step) % world_size


torch.library.define("compshard::gather_rows_", "(Tensor(a!) buffer, int world_size, str group_name) -> Tensor(a!)")


@torch.library.impl("compshard::gather_rows_", "CompositeExplicitAutograd")
def _gather_rows_(buffer: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    rows = buffer.view(world_size, -1)
    group = resolve_group(group_name)
    rank = group.rank()
    works = []
    for to, source in _peers(rank, world_size):
        works += [group.send([rows[rank]], to, GATHER_ROWS_TAG), group.recv([rows[source]], source, GATHER_ROWS_TAG)]
    torch._C._distributed_c10d._register_work(buffer, WatchedWork(works, group_name))  # wait_tensor(buffer) waits
    return buffer


@torch.library.register_fake("compshard::gather_rows_")
def _(buffer, world_size, group_name):
    return buffer


torch.library.define("compshard::exchange_rows_", "(Tensor(a!) buffer, int world_size, str group_name) -> Tensor(a!)")


@torch.library.impl("compshard::exchange_rows_", "CompositeExplicitAutograd")
def _exchange_rows_(buffer: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    group = resolve_group(group_name)
    received = torch.empty_like(buffer)  # gloo's all-to-all cannot receive into the buffer it sends from
    work = _CopiedBack(WatchedWork([group.alltoall_base(received, buffer, [], [])], group_name), received, buffer)
    torch._C._distributed_c10d._register_work(buffer, work)
    return buffer


@torch.library.register_fake("compshard::exchange_rows_")
def _(buffer, world_size, group_name):
    return buffer


def exchange_rows(buffer: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """``buffer`` (``world_size`` equal rows, row ``p`` for rank ``p``) with row ``p``
    replaced by what rank ``p`` sent this rank, waited: in place, as the compiled
    backward exchanges (``compshard::exchange_rows_``)."""
    return _c10d.wait_tensor(torch.ops.compshard.exchange_rows_(buffer, world_size, group_name))


def exchanged_rows(buffer: torch.Tensor, world_size: int, group_name: str) -> list[torch.Tensor]:
    """The rows rank ``p`` sent this rank (entry ``p``; ``buffer``'s ``world_size`` equal
    rows are what this rank sends), for a caller that reads them once (eager
    reductions): sends and receives on gloo, as the all-gather's
    (``compshard::gather_rows_``): each other rank's row received into a new tensor, this
    rank's own row read where it lies in ``buffer``: gloo's all-to-all would copy the own
    row into its output too, and the in-place op copies all of its output back.
    ``buffer`` may be overwritten."""
    group = resolve_group(group_name)
    rows = buffer.view(world_size, -1)
    rank = group.rank()
    received = rows.new_empty((world_size - 1, rows.shape[1]))  # row s - 1: from rank - s (step s)
    with torch.profiler.record_function("compshard::exchanged_rows"):  # (what profiles count it by)
        works = []
        for row, (to, source) in zip(received, _peers(rank, world_size)):
            works += [group.send([rows[to]], to, EXCHANGE_ROWS_TAG), group.recv([row], source, EXCHANGE_ROWS_TAG)]
        WatchedWork(works, group_name).wait()
    return [rows[rank] if p == rank else received[(rank - p) % world_size - 1] for p in range(world_size)]


class WatchedWork(dist.Work):
    """gloo works waited as one, the wait marked as blocked in a collective of
    ``group_name`` (:func:`compshard.comm.liveness.blocked`: a rank waiting to compile a graph
    this rank does not run learns so at once). A wait that fails raises the failure of the
    rank that caused it (:func:`compshard.comm.liveness.raise_published`), compiled or not."""

    def __init__(self, works: list[dist.Work], group_name: str) -> None:
        super().__init__()
        self._works, self._group_name = works, group_name

    def wait(self, timeout: object = None) -> bool:  # noqa: ARG002 - the process group's own timeout applies
        try:
            with liveness.blocked(self._group_name):
                for work in self._works:
                    work.wait()
        except Exception as error:  # a closed connection: name the rank that failed, as compiled graphs do
            liveness.raise_published(error)
            raise
        return True


class _CopiedBack(dist.Work):
    """A collective's work that, waited, copies what it received into the buffer the
    graph waits on."""

    def __init__(self, work: dist.Work, received: torch.Tensor, buffer: torch.Tensor) -> None:
        super().__init__()
        self._work, self._received, self._buffer = work, received, buffer

    def wait(self, timeout: object = None) -> bool:  # noqa: ARG002 - the process group's own timeout applies
        self._work.wait()
        self._buffer.copy_(self._received)
        return True


def all_gather_rows(buffer: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """``buffer`` (``world_size`` equal rows, this rank's filled) with every rank's row,
    waited: in place, as the compiled graphs gather (by sends and receives on gloo, see
    :func:`all_gathers_by_send_recv`; else ``all_gather_into_tensor_out``)."""
    if all_gathers_by_send_recv(group_name, buffer.device):
        return _c10d.wait_tensor(torch.ops.compshard.gather_rows_(buffer, world_size, group_name))
    rank, slot = group_rank(group_name), buffer.numel() // world_size
    return _c10d.wait_tensor(
        _c10d.all_gather_into_tensor_out(buffer[rank * slot : (rank + 1) * slot], world_size, group_name, out=buffer)
    )


# [Note: one spec argument]
# ``unshard`` and ``reduce_grad`` take their facts other than tensors (shape, group,
# name, dtypes, modes) as ONE string, ``spec``: a JSON object of the fields by name
# (:meth:`UnshardArgs.spec`, :meth:`ReduceGradArgs.spec`), not one argument each. Dynamo
# traces a call of each per parameter of the model, and AOTAutograd traces each again
# (metadata, joint graph, the backward's ``reduce_grad``): every argument costs at every
# step of that, and a string is the cheapest argument there is. The string is the same
# on every rank for a parameter, readable in a printed graph, and decoded once per
# distinct string (cached). Passes and callers read the fields through the named
# tuples below, never the string.


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_named(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a dtype name: {name!r}")
    return dtype


def _encoded(args: NamedTuple, fields: tuple[str, ...]) -> str:
    values = (getattr(args, name) for name in fields)
    return _encoded_values(fields, tuple(tuple(value) if isinstance(value, list) else value for value in values))


@functools.cache
def _encoded_values(fields: tuple[str, ...], values: tuple[Any, ...]) -> str:
    jsonable = [_dtype_name(value) if isinstance(value, torch.dtype) else value for value in values]
    return json.dumps(dict(zip(fields, jsonable)), separators=(",", ":"))


_OPTIONAL_DTYPES = frozenset({"param_dtype", "reduce_dtype"})


@functools.cache
def _decoded(op: str, fields: tuple[str, ...], spec: str) -> tuple[Any, ...]:
    """The values of ``fields`` in ``spec`` (see [Note: one spec argument]); ValueError
    naming ``op`` when it is not such a spec. ``full_shape`` comes back a tuple (cached
    values are shared)."""
    try:
        record = json.loads(spec)
        if not isinstance(record, dict) or tuple(record) != fields:
            raise ValueError(f"expected an object of the fields {list(fields)}")
        values = []
        for name in fields:
            value = record[name]
            if name == "full_shape":
                if not (isinstance(value, list) and all(type(size) is int and size >= 0 for size in value)):
                    raise ValueError(f"full_shape {value!r} is not a list of sizes")
                value = tuple(value)
            elif name.endswith("_dtype"):
                value = None if value is None and name in _OPTIONAL_DTYPES else _dtype_named(value)
            elif name == "grad_sync" and value not in GRAD_SYNC_MODES:
                raise ValueError(f"grad_sync={value!r}; allowed: {list(GRAD_SYNC_MODES)}")
            elif type(value) is not _SPEC_TYPES[name]:
                raise ValueError(f"{name}={value!r}: expected {_SPEC_TYPES[name].__name__}")
            values.append(value)
        return tuple(values)
    except ValueError as error:  # json.JSONDecodeError included
        raise ValueError(f"compshard::{op}: spec {spec!r} is not one compshard wrote: {error}") from None


_SPEC_TYPES: dict[str, type] = {
    "world_size": int,
    "group_name": str,
    "param": str,
    "reshard_after_forward": bool,
    "replicate_group": str,
    "grad_sync": str,
}


class UnshardArgs(NamedTuple):
    """``compshard::unshard``'s arguments by name, its ``spec`` decoded (passes read them
    with ``compshard.passes.fx_utils.unshard_args``). ``shard`` and ``grad_sink`` are
    tensors where the op runs and the nodes computing them in a graph."""

    shard: Any
    full_shape: list[int]
    world_size: int
    group_name: str
    param: str
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    replicate_group: str
    grad_sync: str
    grad_sink: Any

    @classmethod
    def of(cls, shard: Any, spec: str, grad_sink: Any) -> UnshardArgs:
        """The arguments of ``unshard(shard, spec, grad_sink)``."""
        full_shape, *rest = _decoded("unshard", _UNSHARD_SPEC, spec)
        return cls._make((shard, list(full_shape), *rest, grad_sink))

    def spec(self) -> str:
        """The op's ``spec`` argument for these fields."""
        return _encoded(self, _UNSHARD_SPEC)

    def call(self) -> torch.Tensor:
        """``compshard::unshard`` with these arguments."""
        return torch.ops.compshard.unshard(self.shard, self.spec(), self.grad_sink)

    def reduce_args(self, shard_dtype: torch.dtype) -> ReduceGradArgs:
        """The arguments of the ``reduce_grad`` of this gather's gradient (``grad`` None)."""
        return ReduceGradArgs(
            None,
            self.full_shape,
            self.world_size,
            self.group_name,
            self.param,
            self.reduce_dtype,
            shard_dtype,
            self.replicate_group,
        )


class ReduceGradArgs(NamedTuple):
    """``compshard::reduce_grad``'s arguments by name, its ``spec`` decoded (``grad``: a
    tensor, or in a graph the node computing it)."""

    grad: Any
    full_shape: list[int]
    world_size: int
    group_name: str
    param: str
    reduce_dtype: torch.dtype | None
    shard_dtype: torch.dtype
    replicate_group: str

    @classmethod
    def of(cls, grad: Any, spec: str) -> ReduceGradArgs:
        """The arguments of ``reduce_grad(grad, spec)``."""
        full_shape, *rest = _decoded("reduce_grad", _REDUCE_GRAD_SPEC, spec)
        return cls._make((grad, list(full_shape), *rest))

    def spec(self) -> str:
        """The op's ``spec`` argument for these fields."""
        return _encoded(self, _REDUCE_GRAD_SPEC)

    def call(self) -> torch.Tensor:
        """``compshard::reduce_grad`` with these arguments."""
        return torch.ops.compshard.reduce_grad(self.grad, self.spec())


_UNSHARD_SPEC = UnshardArgs._fields[1:-1]
_REDUCE_GRAD_SPEC = ReduceGradArgs._fields[1:]


def _padded(flat: torch.Tensor, numel: int) -> torch.Tensor:
    """``flat`` zero-padded to ``numel`` elements; itself (no copy) when it has them already."""
    return flat if flat.numel() == numel else torch.nn.functional.pad(flat, (0, numel - flat.numel()))


def _shard_layout(full_shape: list[int], world_size: int, group_name: str) -> ShardLayout:
    return ShardLayout(tuple(full_shape), world_size, group_rank(group_name))


# ---------------------------------------------------------------------------- unshard


@torch.library.custom_op("compshard::unshard", mutates_args=())
def unshard(shard: torch.Tensor, spec: str, grad_sink: torch.Tensor | None) -> torch.Tensor:
    args = UnshardArgs.of(shard, spec, grad_sink)
    layout = _shard_layout(args.full_shape, args.world_size, args.group_name)
    flat = shard.reshape(-1).to(args.param_dtype or shard.dtype)
    if layout.replicated or args.world_size == 1:
        return flat.clone().view(args.full_shape)
    buffer = flat.new_empty(args.world_size * layout.padded_shard_numel)
    buffer.view(args.world_size, -1)[layout.rank].copy_(_padded(flat, layout.padded_shard_numel))
    gathered = all_gather_rows(buffer, args.world_size, args.group_name)
    return gathered[: layout.numel].view(args.full_shape).clone()


@unshard.register_fake
def _(shard, spec, grad_sink):
    args = UnshardArgs.of(shard, spec, grad_sink)
    return shard.new_empty(args.full_shape, dtype=args.param_dtype or shard.dtype)


@functools.cache
def _reduce_spec(unshard_spec: str, shard_dtype: torch.dtype) -> str:
    """``reduce_grad``'s spec for the gradient of ``unshard(shard, unshard_spec, ...)``."""
    return UnshardArgs.of(None, unshard_spec, None).reduce_args(shard_dtype).spec()


def _unshard_setup_context(ctx, inputs, output):
    shard, spec, grad_sink = inputs
    args = UnshardArgs.of(shard, spec, grad_sink)
    ctx.grad_sync = args.grad_sync
    ctx.reduce_spec = _reduce_spec(spec, shard.dtype)
    if args.grad_sync == "accumulate":
        ctx.sink_dtype = grad_sink.dtype
    elif args.grad_sync == "fold":
        ctx.save_for_backward(grad_sink)


def _unshard_backward(ctx, grad):
    if ctx.grad_sync == "accumulate":  # autograd adds it to grad_sink.grad; nothing is communicated
        return None, None, grad.to(ctx.sink_dtype)
    if ctx.grad_sync == "fold":
        (accumulated,) = ctx.saved_tensors
        grad = grad.to(accumulated.dtype) + accumulated
    return torch.ops.compshard.reduce_grad(grad, ctx.reduce_spec), None, None


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# ------------------------------------------------------------------------ reduce_grad


@torch.library.custom_op("compshard::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, spec: str) -> torch.Tensor:
    args = ReduceGradArgs.of(grad, spec)
    layout = _shard_layout(args.full_shape, args.world_size, args.group_name)
    ranks = averaging_ranks(args.world_size, args.replicate_group)
    flat = grad.reshape(-1).to(args.reduce_dtype or grad.dtype)
    if ranks == 1:
        return flat.to(args.shard_dtype).view(layout.local_shape).clone()
    flat = sum_over_ranks(flat / ranks, layout, args.group_name, args.replicate_group)
    return flat.to(args.shard_dtype).view(layout.local_shape)


def averaging_ranks(world_size: int, replicate_group: str) -> int:
    """How many ranks a gradient is averaged over (``reduce_grad`` divides by this before
    summing): the shard group's and the replica group's."""
    return world_size * group_size(replicate_group)


def sum_over_ranks(flat: torch.Tensor, layout: ShardLayout, group_name: str, replicate_group: str) -> torch.Tensor:
    """This rank's rows of ``layout`` (flattened) of the sum of ``flat`` (a full tensor,
    flattened) over the ranks of ``group_name`` and then the replicas of
    ``replicate_group``: ``reduce_grad``'s collectives, waited, without its division and
    casts. ``flat`` itself when there is no other rank; the reduction may overwrite it."""
    if layout.world_size > 1 and layout.replicated:
        flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group_name))
    elif layout.world_size > 1:
        padded = _padded(flat, layout.world_size * layout.padded_shard_numel)
        flat = reduce_scatter_sum(padded, layout.world_size, group_name)[: math.prod(layout.local_shape)]
    if group_size(replicate_group) > 1:
        flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", replicate_group))
    return flat


def reduce_scatter_sum(buffer: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's row of the sum over ranks of the rank-major ``buffer`` (``world_size``
    rows), waited: a reduce-scatter, or the exchange and sum of
    :func:`reduce_scatters_by_exchange`, as the compiled backward runs it. The exchange
    may overwrite ``buffer``."""
    if not reduce_scatters_by_exchange(group_name, buffer.device):
        return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(buffer, "sum", world_size, group_name))
    return sum_rows(exchanged_rows(buffer, world_size, group_name))


def sum_rows(rows: torch.Tensor | Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """The sum of ``rows`` (the rows an exchange received, in rank order: a tensor's dim 0
    or a list of equal tensors), into ``out`` when given (cast to its dtype as
    ``Tensor.to`` does); eager and compiled reductions alike
    (:func:`sum_rows_into_shards` unpacks each parameter's columns through it). Two
    rows: one ``add``, much cheaper on CPU than ``sum(0)``, which wins from 3 rows on (a
    list is stacked for it, the same bits as its rows in one tensor). The values are the
    same; only the sign of a zero can differ (``-0.0 + -0.0`` is ``-0.0``, as a
    reduce-scatter gives, where ``sum(0)`` gives ``+0.0``)."""
    if len(rows) == 2:
        return torch.add(rows[0], rows[1], out=out)
    stacked = rows if isinstance(rows, torch.Tensor) else torch.stack(list(rows))
    total = stacked.sum(0)  # (out= would sum in its dtype)
    return total if out is None else out.copy_(total)


def sum_rows_into_shards(
    rows: torch.Tensor | Sequence[torch.Tensor],
    shard_numels: Sequence[int],
    local_numels: Sequence[int],
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Each parameter's shard (``local_numels[i]`` elements, cast to ``dtype``) summed
    straight from its columns of the exchanged ``rows`` (:func:`sum_rows`): no buffer of
    the sums to copy out, so one pass over the bytes fewer."""
    shards = [rows[0].new_empty(n, dtype=dtype) for n in local_numels]
    offset = 0
    for shard, length, numel in zip(shards, shard_numels, local_numels):
        columns = (
            rows[:, offset : offset + numel]
            if isinstance(rows, torch.Tensor)
            else [row[offset : offset + numel] for row in rows]
        )
        sum_rows(columns, out=shard)
        offset += length
    return shards


@reduce_grad.register_fake
def _(grad, spec):
    args = ReduceGradArgs.of(grad, spec)
    layout = _shard_layout(args.full_shape, args.world_size, args.group_name)
    return grad.new_empty(layout.local_shape, dtype=args.shard_dtype)


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
    exchange received from every rank (:func:`reduce_scatters_by_exchange`), summed here
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
