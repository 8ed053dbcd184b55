"""Uncompiled forwards gather the same sharded modules in the same order on every rank:
checked at each gather, not trusted.

What a rank gathers uncompiled depends on which modules its data call: a mixture of
experts outside any gather unit calls only the experts its tokens were routed to, a
different set on each rank. Gathers of different modules then pair up across ranks: of
different sizes, the transport aborts the process (gloo: "Received data size doesn't
match expected size"); of equal sizes (experts alike), they silently mix the ranks'
rows. So before each uncompiled gather event (a gather unit's entry, the gather of a
parameter read outside a unit) and at the end of each uncompiled forward, the ranks of
the group exchange a fingerprint of where they are: one 8-byte all-gather, always of
the same size, so a rank that is elsewhere meets the others in an exchange too, and
every rank sees the mismatch at the same exchange. Every rank then raises the same error
within seconds, naming the modules each rank reached and the ``gather_units`` option
that makes their common parent one unit that every rank calls.

Trade-off: one small collective per gather event (a unit gathers all its parameters
after one) and per forward, on the uncompiled path only; compiled graphs gather at the
same points on every rank by construction (their schedules are compared at compile
time). Where a graph break sends a data-dependent call back to Python between compiled
graphs, the compiled graph's collectives carry no fingerprint: name the module in
``gather_units`` there.
"""

from __future__ import annotations

import functools
import hashlib

import torch
import torch.distributed as dist

from compshard.comm.layout import group_size, resolve_group
from compshard.comm.transport import WatchedWork
from compshard.module_tree import gather_units_hint

__all__ = ["FORWARD_END", "CallMismatchError", "agree"]

FORWARD_END = "<the end of the forward>"


class CallMismatchError(RuntimeError):
    """The ranks reached different sharded modules at the same gather event."""


@functools.cache
def _fingerprint(place: str) -> int:
    return int.from_bytes(hashlib.blake2b(place.encode(), digest_size=8).digest(), "little", signed=True)


def agree(place: str, module: str, group_name: str, device: torch.device) -> None:
    """Check that every rank of ``group_name`` is at ``place`` (a gather unit's module path,
    the canonical name of a parameter read outside a unit, or :data:`FORWARD_END`), in
    ``module`` (the module path of the unit or of the reading module; ``""`` at the end);
    raise :class:`CallMismatchError` on every rank if not. Nothing to do while compiling
    or for a one-rank group."""
    if torch.compiler.is_compiling() or not group_name or group_size(group_name) == 1:
        return
    group = resolve_group(group_name)
    mine = torch.tensor([_fingerprint(place)], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    WatchedWork([dist.all_gather(everyone, mine, group=group, async_op=True)], group_name).wait()
    if all(torch.equal(other, mine) for other in everyone):
        return
    reached: list[tuple[str, str] | None] = [None] * len(everyone)
    dist.all_gather_object(reached, (place, module), group=group)  # every rank is here: all saw the mismatch
    raise CallMismatchError(_message([where or ("?", "") for where in reached]))


def _message(reached: list[tuple[str, str]]) -> str:
    ranks = ", ".join(f"rank {rank} {place!r}" for rank, (place, _) in enumerate(reached))
    return (
        f"compshard: the ranks' uncompiled forwards reached different sharded modules at the same point ({ranks}): "
        "the data decide which modules run on each rank (experts called for the tokens routed to them), and "
        "gathering different modules would pair the ranks' collectives wrongly. "
        + gather_units_hint([module for place, module in reached if place != FORWARD_END])
    )
