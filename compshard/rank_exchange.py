"""Values every rank must agree on at compile time, exchanged through the c10d store.

Compiling runs under dispatch modes and locks with which a gloo collective can deadlock,
while store reads and writes cannot; so the compile-time exchanges (the shapes the
estimates use, the coalescing plan, the schedule fingerprints) go through the process
group's store, not a collective.
"""

from __future__ import annotations

import datetime
import pickle

import torch.distributed as dist

from compshard.compile_plan import ScheduleError
from compshard.ops import resolve_group

__all__ = ["STORE_TIMEOUT", "exchange_across_ranks"]

STORE_TIMEOUT = datetime.timedelta(seconds=300)
_exchanges: dict[str, int] = {}  # per namespace and process group: exchanges so far (the same on every rank)


def exchange_across_ranks(namespace: str, group_name: str, value: object, what: str) -> tuple[int, list]:
    """Every rank's ``value`` (by group rank), and this exchange's number in ``namespace``.

    A rank that never publishes is a ``ScheduleError`` after ``STORE_TIMEOUT`` naming
    ``what`` this rank compiled, not a hang."""
    group = resolve_group(group_name)
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    key = f"{namespace}/{group_name}"
    sequence = _exchanges[key] = _exchanges.get(key, 0) + 1
    store = dist.PrefixStore(f"{key}/{sequence}/", dist.distributed_c10d._get_default_store())
    store.set(str(rank), pickle.dumps(value))
    keys = [str(r) for r in range(world_size)]
    try:
        store.wait(keys, STORE_TIMEOUT)
    except Exception as error:  # noqa: BLE001 - re-raised with what it means here
        raise ScheduleError(
            f"compshard: rank {rank} compiled {what} (#{sequence} on this process group) that some rank did not "
            f"compile within {STORE_TIMEOUT}: every rank must compile the same graphs (when only some ranks' "
            "input shapes change, compile with dynamic=True)"
        ) from error
    return sequence, [pickle.loads(store.get(key)) for key in keys]
