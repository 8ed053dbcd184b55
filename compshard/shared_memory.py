"""All-gathers and all-to-alls through shared memory between the ranks of a gloo group on one host.

gloo moves every byte through TCP on the loopback device: the sender's kernel copies it
out of the process, the receiver's copies it in, and gloo's threads take CPU time from
compute for it. Ranks on one host can instead exchange rows through one shared-memory
file that every rank maps: a rank copies its piece into its slot and marks it ready,
the others copy it out (``compshard::gather_rows_`` and ``compshard::exchange_rows_`` use
this where they can).

Protocol, per group: each rank owns two slots of :data:`SLOT_BYTES` and two int64
counters, ``ready`` and ``read``. Rows longer than a slot's piece go in rounds. Round
``k`` uses slot ``k % 2``: a rank first waits until every rank has read its round
``k - 2`` (the last use of that slot), copies its pieces in and sets ``ready = k``;
then, for each other rank, waits for its ``ready >= k`` and copies its piece out; then
sets ``read = k``. An all-gather's piece is the next slot's worth of this rank's row,
the same for every reader; an all-to-all's slot holds one piece for each other rank.
So one rank may fill round ``k + 1`` while the others still read round ``k``. Every
rank runs the same rounds in the same order, as every rank issues the same
collectives. The ordering of the copies and the counters relies on x86-64's stores and
loads staying in program order (TSO), so other machines keep gloo. A wait polls,
yielding the core, for up to :data:`SPIN_SECONDS`, then sleeps in growing steps up to
0.2 ms.

Liveness: beside its counters each rank's header holds a heartbeat, bumped by
:mod:`compshard.liveness`'s thread, a state word with a message (the failure it
published: an error, or that it exited), and, per slot, what it put there (the
exchange's kind, row bytes and offset). A wait raises :class:`~compshard.liveness.RankFailed`
naming the awaited rank as soon as that rank published a failure (``ScheduleError``
for a schedule failure), or once its heartbeat has not moved for
:data:`~compshard.liveness.STALE_SECONDS` (killed, even while a zombie, or hung; no
process ids are read, so ranks in separate PID namespaces are watched alike), and after
:data:`WAIT_SECONDS` when it lives but never reaches the round. Reading a peer's piece,
a rank checks that the peer put the same exchange there: ranks that issued different
collectives (one went on after an exception in the middle of a step) fail at once
instead of mixing rows. A rank whose exchange fails publishes that failure, so every
rank stops.

When: the group's real backend is gloo, it has more than one rank, neither it nor the
job's processes on this host outnumber the cores a rank may run on, the machine is
x86-64, ``COMPSHARD_SHARED_MEMORY`` is not ``0``, and every rank can open the file that
rank 0 creates under ``/dev/shm`` and read back the token rank 0 wrote into it (so they
share it: one host, one ``/dev/shm``). Decided once per group, collectively, on the
group's first exchange (every rank exchanges on each group in the same order). The file
is readable by its owner only (mode 0600); it is unlinked as soon as every rank has
mapped it, and on every error path of the opening (a rank that dies meanwhile included)
by each rank that knows its name, so none is left behind.

Memory: ``2 * SLOT_BYTES`` and a 512-byte header a rank (:func:`held_bytes`), for the
life of the process, whatever the size of the exchanges; the bits exchanged are the
same as gloo's.
The exchanges run on one thread per group, in the order they were started, as gloo's
run on its own threads: the op's start queues it, its ``wait_tensor`` waits for it
(``start_all_gather``, ``start_all_to_all``), so compute goes on meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch
import torch.distributed as dist

from compshard import liveness
from compshard.liveness import Failure, RankFailed

__all__ = ["SLOT_BYTES", "SPIN_SECONDS", "WAIT_SECONDS", "SharedRows", "held_bytes", "processes_on_host", "shared_rows",
           "usable_here"]

SLOT_BYTES = 1 << 18  # 256 KiB: two a rank keep the memory held small beside the gathered buffers
SPIN_SECONDS = 2e-3  # ranks issue the same collectives, so most waits end within this
WAIT_SECONDS = 360.0  # past the compile-time exchange's 300 s: its ScheduleError is published first, never lost
FILE_PREFIX = "/dev/shm/compshard-"  # then rank 0's process id and a random part
# A rank's header, int64 words: its counters, heartbeat and state, and what each slot holds
_READY, _READ, _BEAT, _STATE = range(4)
_SLOT_WORDS = 4  # first word of slot s's description: (kind, row bytes, offset) at 4 + 3 * s
_HEADER_WORDS = 16
_MESSAGE_BYTES = 512 - 8 * _HEADER_WORDS
_ALIGN = 64  # an all-to-all's pieces start on cache lines
_TOKEN_BYTES = 16
_GATHER, _ALL_TO_ALL = 1, 2
_KIND_NAMES = {_GATHER: "an all-gather", _ALL_TO_ALL: "an all-to-all"}

# process group -> its exchange (None: gloo's); weak, since a destroyed group's name may be reused
_opened: "weakref.WeakKeyDictionary[dist.ProcessGroup, SharedRows | None]" = weakref.WeakKeyDictionary()


class SharedRows:
    """The shared slots and headers of one group's ranks (see the module docstring).
    ``ranks``: the group's ranks by their global rank, as errors name them."""

    def __init__(self, storage: torch.Tensor, rank: int, ranks: list[int], group_name: str = "",
                 wait_seconds: float = WAIT_SECONDS, stale_seconds: float = liveness.STALE_SECONDS):
        world_size = len(ranks)
        self.rank, self.world_size, self.ranks, self.group_name = rank, world_size, ranks, group_name
        self.wait_seconds, self.stale_seconds = wait_seconds, stale_seconds
        slots_bytes = world_size * 2 * SLOT_BYTES
        self._slots = storage[:slots_bytes].view(world_size, 2, SLOT_BYTES)
        headers = storage[slots_bytes: slots_bytes + world_size * 8 * _HEADER_WORDS].view(torch.int64)
        self._header = headers.numpy().reshape(world_size, _HEADER_WORDS)  # polled from Python: numpy is cheaper
        at = slots_bytes + world_size * 8 * _HEADER_WORDS
        self._messages = storage[at: at + world_size * _MESSAGE_BYTES].numpy().reshape(world_size, _MESSAGE_BYTES)
        self._round = int(self._header[rank, _READY])
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compshard-shared-memory")
        self._failed: BaseException | None = None
        self._peers = [(rank + step) % world_size for step in range(1, world_size)]

    @staticmethod
    def nbytes(world_size: int) -> int:
        """The shared file's size: the slots, the headers and messages, the token."""
        return world_size * (2 * SLOT_BYTES + 8 * _HEADER_WORDS + _MESSAGE_BYTES) + _TOKEN_BYTES

    def beat(self) -> None:
        """One heartbeat of this rank (:mod:`compshard.liveness`'s thread)."""
        self._header[self.rank, _BEAT] += 1

    def publish(self, failure: Failure) -> None:
        """Tell the other ranks this rank's ``failure``: its message, then its state."""
        text = failure.message.encode()[:_MESSAGE_BYTES - 1]
        self._messages[self.rank, :len(text)] = list(text)
        self._messages[self.rank, len(text)] = 0
        self._header[self.rank, _STATE] = 1 + liveness.KINDS.index(failure.kind)

    def start_all_gather(self, rows: torch.Tensor) -> dist.Work:
        """Start :meth:`all_gather` of ``rows`` on this group's exchange thread, after the
        exchanges started before it (so every rank runs the same rounds in the same
        order); the returned work's ``wait`` waits for it and raises what it raised."""
        return _ExchangeWork(self._thread.submit(self.all_gather, rows))

    def start_all_to_all(self, rows: torch.Tensor) -> dist.Work:
        """:meth:`start_all_gather`, for :meth:`all_to_all`."""
        return _ExchangeWork(self._thread.submit(self.all_to_all, rows))

    def all_gather(self, rows: torch.Tensor) -> None:
        """Fill every other rank's row of ``rows`` (``world_size`` rows, contiguous, this
        rank's filled) with that rank's row, in place; blocking, one call at a time (the
        exchange thread's)."""
        data = self._bytes(rows)
        mine = data[self.rank]

        def fill(slot: torch.Tensor, start: int, length: int) -> None:
            slot[:length].copy_(mine[start:start + length])

        def drain(peer: int, slot: torch.Tensor, start: int, length: int) -> None:
            data[peer, start:start + length].copy_(slot[:length])

        self._exchange(_GATHER, data.shape[1], SLOT_BYTES, fill, drain)

    def all_to_all(self, rows: torch.Tensor) -> None:
        """Replace row ``p`` of ``rows`` (``world_size`` rows, contiguous: row ``p`` is
        what this rank sends rank ``p``) with what rank ``p`` sends this rank, in place:
        afterwards row ``p`` is rank ``p``'s row ``rank`` (an all-to-all of equal splits,
        received in rank order; this rank's own row stays). Blocking, as
        :meth:`all_gather`. Each round's slot holds one piece for each other rank."""
        data = self._bytes(rows)
        others = self.world_size - 1
        piece = SLOT_BYTES // others // _ALIGN * _ALIGN or SLOT_BYTES // others  # unaligned past 4096 ranks

        def place(sender: int, receiver: int) -> int:  # where ``sender``'s slot holds ``receiver``'s piece
            return (receiver - sender - 1) % self.world_size * piece

        def fill(slot: torch.Tensor, start: int, length: int) -> None:
            for peer in self._peers:
                at = place(self.rank, peer)
                slot[at:at + length].copy_(data[peer, start:start + length])

        def drain(peer: int, slot: torch.Tensor, start: int, length: int) -> None:
            at = place(peer, self.rank)  # read before this rank's row is overwritten: fill ran first
            data[peer, start:start + length].copy_(slot[at:at + length])

        self._exchange(_ALL_TO_ALL, data.shape[1], piece, fill, drain)

    def _bytes(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(-1).view(torch.uint8).view(self.world_size, -1)

    def _exchange(self, kind: int, row_bytes: int, piece_bytes: int, fill: Callable[[torch.Tensor, int, int], None],
                  drain: Callable[[int, torch.Tensor, int, int], None]) -> None:
        """Rounds of ``piece_bytes`` of each row (see the module docstring): ``fill(slot,
        start, length)`` puts this rank's pieces into its slot, ``drain(peer, slot, start,
        length)`` takes this rank's from a peer's. After a failed exchange the group's
        rounds are out of step, so every later call raises; the failure is published."""
        if self._failed is not None:
            raise RuntimeError(f"compshard: an earlier shared-memory exchange of this group failed: {self._failed}")
        try:
            for start in range(0, row_bytes, piece_bytes):
                length = min(piece_bytes, row_bytes - start)
                self._round += 1
                round_, slot = self._round, self._round % 2
                for peer in self._peers:  # the slot's last use was round - 2
                    self._wait(peer, _READ, round_ - 2)
                fill(self._slots[self.rank, slot], start, length)
                described = _SLOT_WORDS + 3 * slot
                header = self._header[self.rank]
                header[described], header[described + 1], header[described + 2] = kind, row_bytes, start
                self._header[self.rank, _READY] = round_
                for peer in self._peers:
                    self._wait(peer, _READY, round_)
                    self._check_same_exchange(peer, described, round_)
                    drain(peer, self._slots[peer, slot], start, length)
                self._header[self.rank, _READ] = round_
        except BaseException as error:
            self._failed = error
            liveness.publish_error(error)
            raise

    def _check_same_exchange(self, peer: int, described: int, round_: int) -> None:
        """Raise unless ``peer`` put into its slot of ``round_`` the same piece of the same
        exchange as this rank (scalar reads: this runs every round)."""
        mine, theirs = self._header[self.rank], self._header[peer]
        if (mine[described] == theirs[described] and mine[described + 1] == theirs[described + 1]
                and mine[described + 2] == theirs[described + 2]):
            return
        pieces = [tuple(int(word) for word in header[described:described + 3]) for header in (mine, theirs)]
        raise RuntimeError(
            f"compshard: the ranks issued different collectives: in shared-memory round {round_} rank "
            f"{self.ranks[peer]} exchanged {_describe(pieces[1])} where rank {self.ranks[self.rank]} exchanged "
            f"{_describe(pieces[0])} (a rank that went on after an exception in the middle of a step, skipping the "
            "rest of its collectives, does this)")

    def _wait(self, peer: int, counter: int, value: int) -> None:
        """Until ``peer``'s counter reaches ``value``: polling (yielding the core) for up to
        :data:`SPIN_SECONDS`, then sleeping in growing steps up to 0.2 ms, watching the
        peer's state and heartbeat (see the module docstring)."""
        if self._header[peer, counter] >= value:
            return
        started = time.monotonic()
        pause = 50e-6
        beat, beat_seen = self._header[peer, _BEAT], started
        slow = False
        try:
            while self._header[peer, counter] < value:
                now = time.monotonic()
                waited = now - started
                if waited < SPIN_SECONDS:
                    os.sched_yield()
                    continue
                if not slow:  # from the first sleep on, the heartbeat says this thread waits in a collective
                    slow = True
                    liveness.block(self.group_name)
                self._raise_if_stopped(peer, value)
                if self._header[peer, _BEAT] != beat:
                    beat, beat_seen = self._header[peer, _BEAT], now
                elif now - beat_seen > self.stale_seconds:
                    raise RankFailed(f"compshard: rank {self.ranks[peer]} stopped: no heartbeat for "
                                     f"{now - beat_seen:.0f} s (killed, or its process hangs; this rank waited for "
                                     f"it in shared-memory round {value})")
                if waited > self.wait_seconds:
                    raise RuntimeError(
                        f"compshard: rank {self.ranks[peer]} of a shared-memory exchange is alive but did not reach "
                        f"round {value} within {self.wait_seconds:g} s (the ranks issued different collectives?)")
                time.sleep(pause)
                pause = min(2 * pause, 2e-4)
        finally:
            if slow:
                liveness.unblock()

    def _raise_if_stopped(self, peer: int, value: int) -> None:
        state = int(self._header[peer, _STATE])
        if state:
            message = bytes(self._messages[peer]).split(b"\0", 1)[0].decode(errors="replace")
            failure = Failure(self.ranks[peer], liveness.KINDS[state - 1], message)
            raise failure.error(f"waited for it in shared-memory round {value}")


def _describe(piece: tuple[int, ...]) -> str:  # (kind, row bytes, offset)
    kind, row_bytes, start = piece
    if kind not in _KIND_NAMES:
        return "nothing"
    return f"{_KIND_NAMES[kind]} of {row_bytes} bytes a rank (from byte {start})"


class _ExchangeWork(dist.Work):
    """A queued exchange as a c10d work, so ``wait_tensor`` on its buffer waits for it
    (torch's future-wrapping work would drop the exchange's error, leaving rows unfilled)."""

    def __init__(self, exchange: Future) -> None:
        super().__init__()
        self._exchange = exchange

    def wait(self, timeout: object = None) -> bool:  # noqa: ARG002 - the exchange has its own deadline
        self._exchange.result()
        return True


def held_bytes() -> int:
    """Bytes of shared slots this process holds for its groups (its own slots only: each
    rank's share of the files)."""
    return sum(2 * SLOT_BYTES for rows in _opened.values() if rows is not None)


def shared_rows(group: dist.ProcessGroup) -> SharedRows | None:
    """The shared-memory exchange of ``group``, opened on first use (collective: every
    rank of the group calls it at the same point); None where the group gathers through
    gloo (see the module docstring)."""
    if group not in _opened:
        _opened[group] = _open(group)
    return _opened[group]


def usable_here(world_size: int) -> bool:
    """Whether this process may exchange through shared memory with ``world_size - 1``
    others: not turned off, x86-64, a core for each rank of the group and for each
    process of the job on this host (:func:`processes_on_host`), and room in
    ``/dev/shm`` for the group's file. Rounds in lockstep stall when ranks wait for a
    core: 4 ranks on 2 cores took 4.7 to 9.0 ms for 3.3 MiB and 30 to 181 ms for 26.5
    MiB, against 4.0 and 43 through gloo; groups of 2 among 4 processes on 2 cores (the
    2 x 2 pipeline benchmark's data-parallel groups) stepped the small GPT's pipeline in
    105.8, 108.8 and 110.7 ms against 98.6, 101.7 and 105.0 through gloo."""
    if os.environ.get("COMPSHARD_SHARED_MEMORY", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if max(world_size, processes_on_host()) > len(os.sched_getaffinity(0)):
        return False
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= SharedRows.nbytes(world_size)


def processes_on_host() -> int:
    """The job's processes on this host: torchrun's ``LOCAL_WORLD_SIZE``; without it, the
    default group's size (as if every rank shared this host), or 1 outside a job."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return int(local)
    return dist.get_world_size() if dist.is_initialized() else 1


def _open(group: dist.ProcessGroup) -> SharedRows | None:
    world_size, rank = group.size(), group.rank()
    try:
        backend = group._get_backend(torch.device("cpu")).name()
    except RuntimeError:  # no CPU backend
        return None
    if world_size < 2 or backend != "gloo":
        return None
    liveness.start()
    nbytes = SharedRows.nbytes(world_size)
    if not _agreed(group, usable_here(world_size)):
        return None
    file: list[tuple[str, bytes] | None] = [None]  # (path, token), rank 0's
    storage = None
    try:
        if rank == 0:  # created and stamped before any other rank looks for it
            path, token = f"{FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}", uuid.uuid4().bytes
            file = [(path, token)]
            storage = _map(path, token, nbytes, create=True)
        dist.broadcast_object_list(file, src=dist.get_global_rank(group, 0), group=group)
        if rank != 0 and file[0] is not None:
            storage = _map(*file[0], nbytes, create=False)
        mapped: list[object] = [None] * world_size  # every rank has mapped the file (or failed) once this returns
        dist.all_gather_object(mapped, storage is not None, group=group)
    finally:  # every rank that knows the file's name unlinks it: none is left behind, whoever fails
        if file[0] is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(file[0][0])
    if not all(mapped) or storage is None:
        return None
    rows = SharedRows(storage, rank, [dist.get_global_rank(group, r) for r in range(world_size)], group.group_name)
    liveness.add_sink(weakref.ref(rows))
    return rows


def _map(path: str, token: bytes, nbytes: int, *, create: bool) -> torch.Tensor | None:
    """The file mapped as a byte tensor, its token checked; None where it cannot be. A new
    file is created readable by its owner only, and never over an existing one."""
    try:
        if create:
            descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(descriptor, nbytes)
            finally:
                os.close(descriptor)
        elif not os.path.exists(path):
            return None
        mapped = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    stamp = mapped[nbytes - _TOKEN_BYTES:]
    if create:
        stamp.copy_(torch.frombuffer(bytearray(token), dtype=torch.uint8))
        return mapped
    return mapped if bytes(stamp.numpy()) == token else None


def _agreed(group: dist.ProcessGroup, mine: bool) -> bool:
    """Whether every rank of ``group`` says yes (collective)."""
    everyone: list[object] = [None] * group.size()
    dist.all_gather_object(everyone, bool(mine), group=group)
    return all(everyone)
