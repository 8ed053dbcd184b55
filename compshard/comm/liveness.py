"""Whether the other ranks are alive, and what stopped them: every wait on peers asks here.

A rank that waits for others (a collective on gloo, a compile-time exchange through the
c10d store) must notice within seconds that the rank it waits for failed or died, and
say which rank and why, whatever the process layout: a killed rank may stay a zombie
until its parent reaps it, and ranks in separate PID namespaces cannot see each other's
processes, so process ids tell nothing. Instead each rank of a job with more than one
rank publishes, from the moment it shards a model or first exchanges:

- a **heartbeat**: a daemon thread bumps a counter every :data:`BEAT_SECONDS` in the
  default store (``compshard/beat/<rank>``). A waiter that sees a peer's counter unchanged
  for :data:`STALE_SECONDS` reports it dead or hung. The store's beat also says whether
  the rank has been waiting in a collective of a process group for over a second
  (:func:`blocked`), which a rank waiting for it at compile time reads: a rank blocked
  in a collective with this rank will never reach this rank's compile, a deadlock that
  is reported as a ``ScheduleError`` within seconds (once the same wait shows over fresh
  beats: :data:`DEADLOCK_SECONDS`) instead of after a timeout.
- its **failure**: the first error a compshard wait raised on it, an uncaught exception
  (``sys.excepthook``), or, at interpreter exit, that it exited
  (``compshard/failed/<rank>`` in the store).
  The first one published is kept: it is the cause, later ones follow from it.

Only a rank that neither beats nor publishes (killed before it sharded anything) is
waited for until the waiter's own timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch.distributed as dist

from compshard.compile_plan import ScheduleError

__all__ = [
    "BEAT_SECONDS",
    "STALE_SECONDS",
    "Failure",
    "RankFailed",
    "PeerWatch",
    "blocked",
    "failures",
    "publish_error",
    "publish_failure",
    "raise_published",
    "start",
]

BEAT_SECONDS = 0.5
# No beat for this long: the rank is dead or hung. Well above a beat's delay on a busy
# host (the thread needs the GIL, which Python hands over every 5 ms), well below the
# 15 s in which a job is to notice.
STALE_SECONDS = 6.0
BLOCKED_SECONDS = 1.0  # a wait in a collective this long is reported in the beat (a shorter one is normal)
# A peer reported blocked in the same wait this long, over fresh heartbeats, waits for the
# watching rank: one reading alone may be a stale beat from a wait that has since ended.
DEADLOCK_SECONDS = 2.0

# What a published failure was, most telling first: where several ranks failed, the one
# to report is the first of these kinds.
KINDS = ("schedule", "error", "exited", "peer")
_FAILED_KEY = "compshard/failed/"
_BEAT_KEY = "compshard/beat/"


class RankFailed(RuntimeError):
    """A rank that this rank waited for failed, exited or stopped beating."""


@dataclass(frozen=True)
class Failure:
    """What a rank published as its failure."""

    rank: int  # global rank
    kind: str  # one of KINDS: "schedule" (a ScheduleError), "error", "exited", "peer" (another rank's failure)
    message: str

    def error(self, context: str) -> RuntimeError:
        """The error to raise on a rank that waited for this one: ``ScheduleError`` for a
        schedule failure (every rank reports the documented error), else :class:`RankFailed`."""
        if self.kind == "schedule":
            return ScheduleError(f"{self.message} [rank {self.rank} stopped with this; this rank {context}]")
        what = "exited" if self.kind == "exited" else f"failed: {self.message}"
        return RankFailed(f"compshard: rank {self.rank} {what} (this rank {context})")


@dataclass
class _Process:
    """This process's publishing state."""

    store: dist.Store
    rank: int
    beats: int = 0
    published: Failure | None = None


_state: _Process | None = None
_blocked: dict[int, tuple[str, float, int]] = {}  # thread id -> (group name, since, wait number)
_waits = itertools.count()
_lock = threading.Lock()


def start() -> None:
    """Start publishing this rank's heartbeat (idempotent; nothing without a process group
    of more than one rank). Collective code calls it before its first wait on peers."""
    global _state
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    store = dist.distributed_c10d._get_default_store()
    with _lock:
        if _state is not None and _state.store is store:
            return
        first = _state is None
        _state = _Process(store, dist.get_rank())
    if first:
        threading.Thread(target=_beat_forever, name="compshard-heartbeat", daemon=True).start()
        atexit.register(_at_exit)
        previous_hook = sys.excepthook

        def publish_then_report(
            kind: type[BaseException], value: BaseException, traceback: types.TracebackType | None
        ) -> None:
            publish_failure(f"{kind.__name__}: {value}", "error")
            previous_hook(kind, value, traceback)

        sys.excepthook = publish_then_report
    _beat_once()


def publish_failure(message: str, kind: str) -> None:
    """Publish this rank's failure (``kind``: one of :data:`KINDS`), unless it published one
    already (that one is the cause)."""
    state = _state
    if state is None:
        return
    with _lock:
        if state.published is not None:
            return
        state.published = Failure(state.rank, kind, message)
    with contextlib.suppress(Exception):  # the store may be gone with its host
        state.store.set(f"{_FAILED_KEY}{state.rank}", f"{kind}|{message}")


def publish_error(error: BaseException) -> None:
    """Publish ``error``, raised by a wait on this rank (or while it compiled), as its
    failure: its type named unless it is compshard's own message."""
    message = str(error) if str(error).startswith("compshard:") else f"{type(error).__name__}: {error}"
    if isinstance(error, ScheduleError):
        publish_failure(message, "schedule")
    else:
        publish_failure(message, "peer" if isinstance(error, RankFailed) else "error")


@contextlib.contextmanager
def blocked(group_name: str) -> Iterator[None]:
    """Within the block this thread waits in a collective of ``group_name``; a wait of over
    :data:`BLOCKED_SECONDS` shows in the heartbeat."""
    _blocked[threading.get_ident()] = (group_name, time.monotonic(), next(_waits))
    try:
        yield
    finally:
        _blocked.pop(threading.get_ident(), None)


def _blocked_on() -> str:
    """``"<group>|<wait number>"`` of a wait in a collective that has lasted over
    :data:`BLOCKED_SECONDS`, else ``""``."""
    now = time.monotonic()
    return next(
        (f"{group}|{wait}" for group, since, wait in list(_blocked.values()) if now - since > BLOCKED_SECONDS), ""
    )


def _beat_once() -> None:
    state = _state
    if state is None or not dist.is_initialized():  # no beat into the store of a destroyed group
        return
    state.beats += 1
    with contextlib.suppress(Exception):
        state.store.set(f"{_BEAT_KEY}{state.rank}", f"{state.beats}|{_blocked_on()}")


def _beat_forever() -> None:
    while True:
        time.sleep(BEAT_SECONDS)
        _beat_once()


def _at_exit() -> None:
    """Publish that this rank exited, waiting at most a second: a store whose host is gone
    must not hold the process at its exit."""
    publishing = threading.Thread(target=publish_failure, args=("exited", "exited"), daemon=True)
    publishing.start()
    publishing.join(timeout=1.0)


def failures(store: dist.Store, ranks: list[int]) -> list[Failure]:
    """The failures ``ranks`` (global) published in ``store``, most telling first."""
    found = []
    for rank in ranks:
        key = f"{_FAILED_KEY}{rank}"
        if store.check([key]):
            kind, _, message = store.get(key).decode().partition("|")
            found.append(Failure(rank, kind, message))
    return sorted(found, key=lambda failure: KINDS.index(failure.kind) if failure.kind in KINDS else len(KINDS))


def raise_published(error: BaseException) -> None:
    """Raise the failure of another rank that caused ``error`` (this rank's own failure in a
    collective with it), chained to ``error``: the failure it published, or, after a
    transport error (a closed connection) with none published, the rank whose heartbeat
    stops within :data:`STALE_SECONDS` (a killed rank publishes nothing). Return when no
    rank failed."""
    state = _state
    if state is None or isinstance(error, (RankFailed, ScheduleError)) or str(error).startswith("compshard:"):
        return  # compshard's own errors name their cause already
    others = [rank for rank in range(dist.get_world_size()) if rank != state.rank]
    watch = PeerWatch(state.store, interval=0.0)
    deadline = time.monotonic() + (STALE_SECONDS + 2 * BEAT_SECONDS if _is_transport_error(error) else 0.0)
    while True:
        try:
            watch.check(others, "failed in a collective with it")
        except (RankFailed, ScheduleError) as cause:
            raise cause from error
        except Exception:  # noqa: BLE001 - the store itself may be gone with that rank; keep the original error
            return
        if time.monotonic() > deadline:
            return
        time.sleep(BEAT_SECONDS / 2)


def _is_transport_error(error: BaseException) -> bool:
    return isinstance(error, dist.DistError) or "gloo" in str(error)


class PeerWatch:
    """A wait's view of the ranks it waits for through the store: their published failures
    and heartbeats, read at most every ``interval`` seconds."""

    def __init__(self, store: dist.Store, interval: float = 0.2) -> None:
        self.store, self.interval = store, interval
        self._seen: dict[int, tuple[str, float]] = {}  # rank -> (its last beat, when it changed)
        self._blocked: dict[int, tuple[str, int, float]] = {}  # rank -> (its wait, first beat and time seen in it)
        self._checked = 0.0

    def check(self, ranks: list[int], context: str, deadlock: Callable[[int, str], None] | None = None) -> None:
        """Raise when one of ``ranks`` (global) failed or stopped beating. ``deadlock(rank,
        group)`` is called for a rank blocked in one wait in a collective of ``group`` over
        two more of its heartbeats and :data:`DEADLOCK_SECONDS` of this watch, and may
        raise."""
        now = time.monotonic()
        if now - self._checked < self.interval:
            return
        self._checked = now
        found = failures(self.store, ranks)
        if found:
            raise found[0].error(context)
        for rank in ranks:
            key = f"{_BEAT_KEY}{rank}"
            if not self.store.check([key]):
                continue  # it never beat (it has not sharded anything yet): only the waiter's timeout applies
            beat = self.store.get(key).decode()
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
            elif now - last[1] > STALE_SECONDS:
                raise RankFailed(
                    f"compshard: rank {rank} stopped: no heartbeat for {now - last[1]:.0f} s "
                    f"(killed, or its process hangs; this rank {context})"
                )
            count, _, wait = beat.partition("|")
            if not wait:
                self._blocked.pop(rank, None)
                continue
            first = self._blocked.get(rank)
            if first is None or first[0] != wait:
                self._blocked[rank] = (wait, int(count), now)
            elif deadlock is not None and int(count) - first[1] >= 2 and now - first[2] >= DEADLOCK_SECONDS:
                deadlock(rank, wait.rpartition("|")[0])
