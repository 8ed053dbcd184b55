"""Values every rank must agree on at compile time, exchanged through the c10d store.

Compiling runs under dispatch modes and locks with which a gloo collective can deadlock,
while store reads and writes cannot; so the compile-time exchanges (the shapes the
estimates use, the coalescing plan, the schedule fingerprints) go through the process
group's store, not a collective.

A rank that gives up waiting publishes its ``ScheduleError`` in the store before raising
it: the other ranks, typically running a graph they did not need to recompile, then
fail in a collective once that rank's process exits, and report the same error
(:func:`raise_if_a_rank_stopped`) instead of a bare transport error.
"""

from __future__ import annotations

import datetime
import pickle

import torch.distributed as dist

from compshard.compile_plan import ScheduleError
from compshard.ops import resolve_group

__all__ = ["STORE_TIMEOUT", "exchange_across_ranks", "raise_if_a_rank_stopped"]

STORE_TIMEOUT = datetime.timedelta(seconds=300)
_STOPPED_KEY = "compshard/stopped"  # in the default store: the ScheduleError a rank stopped with
_exchanges: dict[str, int] = {}  # per namespace and process group: exchanges so far (the same on every rank)


def exchange_across_ranks(namespace: str, group_name: str, value: object, what: str) -> tuple[int, list]:
    """Every rank's ``value`` (by group rank), and this exchange's number in ``namespace``.

    A rank that never publishes is a ``ScheduleError`` after ``STORE_TIMEOUT`` naming
    ``what`` this rank compiled, not a hang.

    On a ``"fake"`` process group (``compshard.plan``: one process stands for rank 0 of
    the world and has no store to exchange through) every rank's value is this rank's:
    rank 0 holds the most rows of every parameter, so its shapes are the largest."""
    group = resolve_group(group_name)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    key = f"{namespace}/{group_name}"
    sequence = _exchanges[key] = _exchanges.get(key, 0) + 1
    if dist.get_backend(group) == dist.Backend.FAKE:
        return sequence, [value] * world_size
    store = dist.PrefixStore(f"{key}/{sequence}/", dist.distributed_c10d._get_default_store())
    store.set(str(rank), pickle.dumps(value))
    keys = [str(r) for r in range(world_size)]
    try:
        store.wait(keys, STORE_TIMEOUT)
    except Exception as error:  # noqa: BLE001 - re-raised with what it means here
        missing = [r for r in range(world_size) if not store.check([str(r)])]
        message = (
            f"compshard: rank {rank} compiled {what} (#{sequence} on this process group) that rank(s) {missing} did "
            f"not compile within {STORE_TIMEOUT}: every rank must compile the same graphs. When only some ranks' "
            "input shapes change (a smaller last batch on some ranks), only those ranks recompile: compile with "
            "dynamic=True, or mark the varying dimensions with torch._dynamo.mark_dynamic"
        )
        dist.distributed_c10d._get_default_store().set(_STOPPED_KEY, message)
        raise ScheduleError(message) from error
    return sequence, [pickle.loads(store.get(key)) for key in keys]


def raise_if_a_rank_stopped(error: BaseException) -> None:
    """Raise the ``ScheduleError`` that some rank stopped with at compile time (see the
    module docstring), chained to ``error``, this rank's own failure; return when no
    rank did."""
    if not dist.is_initialized():
        return
    try:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([_STOPPED_KEY]):
            return
        message = store.get(_STOPPED_KEY).decode()
    except Exception:  # noqa: BLE001 - the store itself may be gone with that rank; keep the original error
        return
    raise ScheduleError(f"{message} [this rank's collective failed because that rank stopped]") from error
