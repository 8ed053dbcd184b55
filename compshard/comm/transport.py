"""How bytes move between ranks: which way each collective runs on a process group, and
the collectives the eager paths run that way.

:func:`transport_for` is the one place that decides how a group's collectives run on a
device (its :class:`Transport`); the lowering passes, the eager collectives below and
the memory model read that record and never ask for a backend by name. On gloo,
compshard runs two collectives its own way, as in-place custom ops a compiled graph
starts and waits with ``_c10d_functional.wait_tensor``:

``compshard::gather_rows_(buffer)``
    Starts an all-gather in place: every rank sends its row of the rank-major
    ``buffer`` (its own row filled) to every other rank and receives theirs. Returns
    ``buffer``; ``wait_tensor`` on it waits for every send and receive.
``compshard::exchange_rows_(buffer)``
    Starts the all-to-all of a sum reduce-scatter run as an exchange, in place: row
    ``p`` of the rank-major ``buffer``, what this rank sends rank ``p``, becomes what
    rank ``p`` sends this rank. Returns ``buffer``; ``wait_tensor`` on it waits for the
    exchange.

The eager functions (:func:`all_gather_rows`, :func:`reduce_scatter_sum`,
:func:`sum_over_ranks`) run the collectives a compiled graph would, waited, so an
uncompiled module computes the same bits.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compshard.comm import liveness
from compshard.comm.layout import ShardLayout, group_rank, group_size, padded, resolve_group

__all__ = [
    "Transport",
    "WatchedWork",
    "all_gather_rows",
    "exchange_rows",
    "exchanged_rows",
    "reduce_scatter_sum",
    "simulated_backends",
    "sum_over_ranks",
    "sum_rows",
    "sum_rows_into_shards",
    "transport_for",
]

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class Transport:
    """How the collectives of one process group run on one device (:func:`transport_for`).

    ``all_gathers_by_send_recv``: an all-gather runs in place as sends and receives of the
    rank-major output's rows (``compshard::gather_rows_``): each rank sends its row to
    every other rank and receives theirs into their rows. gloo (torch 2.11 to 2.13)
    receives an all-gather into two temporaries of its output's size and then copies
    them into the output; the sends and receives allocate nothing and copy nothing (the
    same bytes either way, the same gathered bits).

    ``reduce_scatters_by_exchange``: a sum reduce-scatter runs as an all-to-all of the
    rank-major buffer (``compshard::exchange_rows_``, in place) followed by a local sum
    of the ``world_size`` received rows. gloo (torch 2.11 to 2.13) runs
    ``reduce_scatter_tensor`` as an all-reduce of the whole buffer, which moves twice the
    bytes of the all-to-all and reduces every element on every rank. gloo's all-to-all
    receives into a temporary, which the in-place op's wait copies back; eager
    reductions send and receive the rows instead, and read them once
    (:func:`exchanged_rows`). The sum adds the ranks' rows in rank order: at two ranks
    the result is the same bits (addition commutes); with more, the order may differ
    from gloo's.

    ``backend_scratch``: the backend's own collectives allocate scratch buffers while
    they run (gloo's; ``compshard.passes.memory_model.backend_scratch_bytes`` counts
    them); NCCL writes the output in place."""

    all_gathers_by_send_recv: bool
    reduce_scatters_by_exchange: bool
    backend_scratch: bool


_GLOO = Transport(all_gathers_by_send_recv=True, reduce_scatters_by_exchange=True, backend_scratch=True)
_BACKEND_COLLECTIVES = Transport(
    all_gathers_by_send_recv=False, reduce_scatters_by_exchange=False, backend_scratch=False
)


def transport_for(group_name: str, device: torch.device) -> Transport:
    """How the named group's collectives run on ``device``: compshard's own on gloo, else
    the backend's (also when the group is not known here)."""
    return _GLOO if _backend_name(group_name, device) == "gloo" else _BACKEND_COLLECTIVES


_simulated_backends: dict[str, str] = {}  # process group name -> the backend it stands for


@contextlib.contextmanager
def simulated_backends(backend_by_group: dict[str, str]) -> Iterator[None]:
    """Within: these process groups (``compshard.forecast``'s groups on the ``"fake"``
    backend) count as the named backend (``"gloo"``, ``"nccl"``) in :func:`transport_for`:
    the scratch memory of collectives, how a reduce-scatter is run."""
    _simulated_backends.update(backend_by_group)
    try:
        yield
    finally:
        for name in backend_by_group:
            _simulated_backends.pop(name, None)


def _backend_name(group_name: str, device: torch.device) -> str | None:
    """The name of the backend (``"gloo"``, ``"nccl"``, ...) that runs the named group's
    collectives on ``device``; None when the group is not known here."""
    if group_name in _simulated_backends:
        return _simulated_backends[group_name]
    try:
        return resolve_group(group_name)._get_backend(device).name()
    except (RuntimeError, ValueError, KeyError, AttributeError):
        return None


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
    waited: in place, as the compiled graphs gather (by sends and receives where the
    :class:`Transport` says so; else ``all_gather_into_tensor_out``)."""
    if transport_for(group_name, buffer.device).all_gathers_by_send_recv:
        return _c10d.wait_tensor(torch.ops.compshard.gather_rows_(buffer, world_size, group_name))
    rank, slot = group_rank(group_name), buffer.numel() // world_size
    return _c10d.wait_tensor(
        _c10d.all_gather_into_tensor_out(buffer[rank * slot : (rank + 1) * slot], world_size, group_name, out=buffer)
    )


def sum_over_ranks(flat: torch.Tensor, layout: ShardLayout, group_name: str, replicate_group: str) -> torch.Tensor:
    """This rank's rows of ``layout`` (flattened) of the sum of ``flat`` (a full tensor,
    flattened) over the ranks of ``group_name`` and then the replicas of
    ``replicate_group``: ``reduce_grad``'s collectives, waited, without its division and
    casts. ``flat`` itself when there is no other rank; the reduction may overwrite it."""
    if layout.world_size > 1 and layout.replicated:
        flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group_name))
    elif layout.world_size > 1:
        padded_flat = padded(flat, layout.world_size * layout.padded_shard_numel)
        flat = reduce_scatter_sum(padded_flat, layout.world_size, group_name)[: math.prod(layout.local_shape)]
    if group_size(replicate_group) > 1:
        flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", replicate_group))
    return flat


def reduce_scatter_sum(buffer: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """This rank's row of the sum over ranks of the rank-major ``buffer`` (``world_size``
    rows), waited: a reduce-scatter, or the exchange and sum of
    :attr:`Transport.reduce_scatters_by_exchange`, as the compiled backward runs it. The exchange
    may overwrite ``buffer``."""
    if not transport_for(group_name, buffer.device).reduce_scatters_by_exchange:
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
