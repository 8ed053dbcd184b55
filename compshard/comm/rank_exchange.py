"""Values every rank must agree on at compile time, exchanged through the c10d store.

Compiling runs under dispatch modes and locks with which a gloo collective can deadlock,
while store reads and writes cannot; so the compile-time exchanges (the shapes the
estimates use, the coalescing plan, the schedule fingerprints) go through the process
group's store, not a collective.

A wait for the other ranks' values watches them (:mod:`compshard.comm.liveness`): a rank that
published a failure (an error, or that it exited) or stopped beating ends the wait
within seconds with an error naming it, never a ``ScheduleError`` about shapes. A rank
that beats while it waits in a collective of the exchange's process group is running a
graph this rank did not compile (only this rank recompiled: its input shapes or dtypes
changed): it can never reach this exchange, so the wait ends at once with the
``ScheduleError`` saying so. A rank that stops with an error publishes it: the other
ranks, blocked in a collective with it, fail once its process exits and report it
(:func:`raise_if_a_rank_stopped`) instead of a bare transport error. Only a rank that
beats and never arrives is waited for up to :data:`STORE_TIMEOUT` (a rank may reach the
same compile minutes later: a large model's compile on a busy host).
"""

from __future__ import annotations

import datetime
import pickle
import time

import torch.distributed as dist

from compshard.comm import liveness
from compshard.comm.layout import resolve_group
from compshard.compile_plan import ScheduleError

__all__ = ["STORE_TIMEOUT", "exchange_across_ranks", "raise_if_a_rank_stopped"]

STORE_TIMEOUT = datetime.timedelta(seconds=300)
_exchanges: dict[str, int] = {}  # per namespace and process group: exchanges so far (the same on every rank)


def exchange_across_ranks(namespace: str, group_name: str, value: object, what: str) -> tuple[int, list]:
    """Every rank's ``value`` (by group rank), and this exchange's number in ``namespace``.

    A rank that never publishes is a ``ScheduleError`` after ``STORE_TIMEOUT`` naming
    ``what`` this rank compiled, not a hang.

    On a ``"fake"`` process group (``compshard.forecast``: one process stands for rank 0 of
    the world and has no store to exchange through) every rank's value is this rank's:
    rank 0 holds the most rows of every parameter, so its shapes are the largest."""
    group = resolve_group(group_name)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    key = f"{namespace}/{group_name}"
    sequence = _exchanges[key] = _exchanges.get(key, 0) + 1
    if dist.get_backend(group) == dist.Backend.FAKE:
        return sequence, [value] * world_size
    liveness.start()
    default_store = dist.distributed_c10d._get_default_store()
    store = dist.PrefixStore(f"{key}/{sequence}/", default_store)
    store.set(str(rank), pickle.dumps(value))  # type: ignore[arg-type]  # it takes bytes; torch's stubs say str
    try:
        _wait_for_everyone(store, default_store, group, group_name, f"{what} (#{sequence} on this process group)")
    except BaseException as error:
        liveness.publish_error(error)
        raise
    return sequence, [pickle.loads(store.get(str(r))) for r in range(world_size)]


def _wait_for_everyone(
    store: dist.Store, default_store: dist.Store, group: dist.ProcessGroup, group_name: str, what: str
) -> None:
    """Until every rank of ``group`` has set its key in ``store``, watching the missing ones
    (see the module docstring)."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    watch = liveness.PeerWatch(default_store)
    started = time.monotonic()
    pause = 1e-3
    missing = list(range(world_size))

    def blocked_with_this_rank(other: int, blocked_group: str) -> None:
        if blocked_group == group_name:
            raise ScheduleError(
                f"compshard: rank {rank} compiled {what} that rank(s) {missing} did not compile: rank {other} runs a "
                "graph it compiled before and waits for this rank in its collectives. Every rank must compile the "
                "same graphs: when only some ranks' input shapes or dtypes change (a smaller last batch on some "
                "ranks), only those ranks recompile: compile with dynamic=True, or mark the varying dimensions with "
                "torch._dynamo.mark_dynamic, and give every rank inputs of the same dtypes"
            )

    while True:
        missing = [r for r in missing if not store.check([str(r)])]
        if not missing:
            return
        global_ranks = [dist.get_global_rank(group, r) for r in missing]
        watch.check(global_ranks, f"waited for it to compile {what}", blocked_with_this_rank)
        if time.monotonic() - started > STORE_TIMEOUT.total_seconds():
            raise ScheduleError(
                f"compshard: rank {rank} compiled {what} that rank(s) {missing} did not compile within "
                f"{STORE_TIMEOUT}, though they are alive: every rank must compile the same graphs. When only some "
                "ranks' input shapes change (a smaller last batch on some ranks), only those ranks recompile: compile "
                "with dynamic=True, or mark the varying dimensions with torch._dynamo.mark_dynamic"
            )
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def raise_if_a_rank_stopped(error: BaseException) -> None:
    """Raise the failure that another rank published (a ``ScheduleError`` it stopped with
    at compile time, or its error or exit: see the module docstring), chained to
    ``error``, this rank's own failure in a collective with it; return when no rank did."""
    liveness.raise_published(error)
