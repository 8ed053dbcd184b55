"""All-gathers and all-to-alls through shared memory (compshard.shared_memory): the same
bits as gloo's at 2 and 4 ranks (the all-to-all in place and read once), in rounds of several slots, fp32 and bf16; the decision
per group (COMPSHARD_SHARED_MEMORY=0 keeps gloo); waits that end with an error naming the
rank, never a hang, when a rank is late, stops beating, published a failure, or issued a
different collective; the file private to its owner."""

from __future__ import annotations

import concurrent.futures
import os
import stat
import threading
import time

import pytest
import torch
import torch.distributed as dist

from compshard import ops, shared_memory
from compshard.compile_plan import ScheduleError
from compshard.liveness import Failure, RankFailed
from compshard.shared_memory import SLOT_BYTES, SharedRows
from tests.distributed import run_distributed

# (dtype, elements a row): one element; two and a half slots; a bf16 row of odd bytes
# (not a whole number of 4-byte words) that still spans three rounds
CASES = [(torch.float32, 1), (torch.float32, 5 * SLOT_BYTES // 8), (torch.bfloat16, SLOT_BYTES + 3)]


def _row(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """What rank ``rank`` contributes."""
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + rank)).to(dtype)


def _gather(group: dist.ProcessGroup, dtype: torch.dtype, numel: int) -> torch.Tensor:
    world_size, rank = group.size(), group.rank()
    buffer = torch.full((world_size, numel), float("nan"), dtype=dtype)
    buffer[rank] = _row(rank, dtype, numel)
    return ops.all_gather_rows(buffer.view(-1), world_size, group.group_name).view(world_size, numel)


def _piece(sender: int, receiver: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """What rank ``sender`` sends rank ``receiver`` in an all-to-all."""
    return _row(16 * sender + receiver, dtype, numel)


def _exchange_rows(group: dist.ProcessGroup, dtype: torch.dtype, numel: int) -> torch.Tensor:
    world_size, rank = group.size(), group.rank()
    buffer = torch.stack([_piece(rank, receiver, dtype, numel) for receiver in range(world_size)])
    return ops.exchange_rows(buffer.view(-1), world_size, group.group_name).view(world_size, numel)


def _exchanged_rows(group: dist.ProcessGroup, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """As :func:`_exchange_rows`, through the eager reductions' read-once exchange (sends
    and receives where the group does not use shared memory)."""
    world_size, rank = group.size(), group.rank()
    buffer = torch.stack([_piece(rank, receiver, dtype, numel) for receiver in range(world_size)])
    return torch.stack(ops.exchanged_rows(buffer.view(-1), world_size, group.group_name))


def _new_group(ranks: list[int], environment: str | None = None, *, force: bool = False) -> tuple:
    """A gloo group and its shared-memory exchange (None: gloo's), with
    ``COMPSHARD_SHARED_MEMORY`` set to ``environment`` while it opens; ``force``: used
    even where this machine has fewer cores than ranks (slow, but the protocol is the
    same), so that 4 ranks exercise it on 2 cores."""
    group = dist.new_group(ranks, backend="gloo")
    usable = shared_memory.usable_here
    if environment is not None:
        os.environ["COMPSHARD_SHARED_MEMORY"] = environment
    if force:
        shared_memory.usable_here = lambda world_size: True
    try:
        return group, shared_memory.shared_rows(group)
    finally:
        shared_memory.usable_here = usable
        os.environ.pop("COMPSHARD_SHARED_MEMORY", None)


def _shared_memory_worker(rank: int, world_size: int) -> dict:
    ranks = list(range(world_size))
    _, decided = _new_group(ranks)
    shared_group, forced = _new_group(ranks, force=True)
    gloo_group, opened_gloo = _new_group(ranks, "0")
    same, expected_rows = [], []
    for dtype, numel in CASES:
        for exchange, expected in ((_gather, [_row(r, dtype, numel) for r in ranks]),
                                   (_exchange_rows, [_piece(r, rank, dtype, numel) for r in ranks]),
                                   (_exchanged_rows, [_piece(r, rank, dtype, numel) for r in ranks])):
            through_shared = exchange(shared_group, dtype, numel)
            through_gloo = exchange(gloo_group, dtype, numel)
            same.append(torch.equal(through_shared.view(torch.uint8), through_gloo.view(torch.uint8)))
            expected_rows.append(torch.equal(through_shared.view(torch.uint8), torch.stack(expected).view(torch.uint8)))
    return {"shared": decided is not None, "forced": forced is not None, "gloo": opened_gloo is None, "same": same,
            "expected": expected_rows, "held": shared_memory.held_bytes(), "usable": shared_memory.usable_here(world_size)}


@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_memory_exchanges_the_bits_gloo_exchanges(world_size):
    for rank, got in enumerate(run_distributed(_shared_memory_worker, world_size)):
        assert got["gloo"], f"rank {rank}: COMPSHARD_SHARED_MEMORY=0 must keep gloo"
        # ranks spawned on one host share /dev/shm: where this machine allows it, they must use it
        assert got["shared"] == got["usable"], f"rank {rank}: shared memory {got['shared']}, usable {got['usable']}"
        assert got["forced"], f"rank {rank}: a group that may use shared memory on this host must"
        assert got["held"] == 2 * SLOT_BYTES * (1 + got["shared"])
        assert all(got["same"]), f"rank {rank}: {got['same']}"
        assert all(got["expected"]), f"rank {rank}: {got['expected']}"


def test_not_used_where_the_jobs_processes_on_this_host_outnumber_its_cores(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))  # torchrun's count of the job's processes here
    assert shared_memory.processes_on_host() == cores + 1
    assert not shared_memory.usable_here(2)


def _exchanges(tmp_path, wait_seconds: float = 60, stale_seconds: float = 60) -> list[SharedRows]:
    """Both ranks of a 2-rank exchange over one file, in this process (rank 1's waits and
    heartbeat are the test's to drive)."""
    nbytes = SharedRows.nbytes(2)
    storage = shared_memory._map(str(tmp_path / "rows"), b"t" * 16, nbytes, create=True)
    return [SharedRows(storage, rank, [0, 1], wait_seconds=wait_seconds, stale_seconds=stale_seconds)
            for rank in range(2)]


def test_a_wait_for_a_late_rank_ends_in_an_error(tmp_path):
    exchange, late = _exchanges(tmp_path, wait_seconds=0.05)
    beating = threading.Thread(target=lambda: [late.beat() or time.sleep(0.01) for _ in range(20)])
    beating.start()  # alive, but never reaching the round
    with pytest.raises(RuntimeError, match="alive but did not reach round 1 within"):
        exchange.all_gather(torch.zeros(2, 4))
    beating.join()
    # its rounds are out of step now: a later exchange, started on the group's thread (as
    # exchange_rows_ starts it), raises too, and the error reaches wait_tensor
    rows = torch.zeros(2, 4)
    torch._C._distributed_c10d._register_work(rows, exchange.start_all_to_all(rows))
    with pytest.raises(RuntimeError, match="earlier shared-memory exchange of this group failed"):
        torch.ops._c10d_functional.wait_tensor(rows)


def test_a_wait_for_a_rank_without_heartbeat_ends_naming_it(tmp_path):
    """No process ids: a zombie, or a rank in another PID namespace, is noticed by its heartbeat."""
    exchange, _ = _exchanges(tmp_path, stale_seconds=0.3)
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 stopped: no heartbeat"):
        exchange.all_gather(torch.zeros(2, 4))
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(("kind", "error", "expected"), [
    ("exited", RankFailed, "rank 1 exited"),
    ("error", RankFailed, "rank 1 failed: ValueError: injected"),
    ("schedule", ScheduleError, "compile with dynamic=True"),
])
def test_a_wait_for_a_rank_that_published_its_failure_ends_at_once(tmp_path, kind, error, expected):
    exchange, failed = _exchanges(tmp_path)
    message = "compile with dynamic=True" if kind == "schedule" else "ValueError: injected"
    failed.publish(Failure(1, kind, message))
    started = time.monotonic()
    with pytest.raises(error, match=expected):
        exchange.all_gather(torch.zeros(2, 4))
    assert time.monotonic() - started < 1


def test_ranks_that_issued_different_collectives_fail_instead_of_mixing_rows(tmp_path):
    ranks = _exchanges(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        gather = pool.submit(ranks[0].all_gather, torch.zeros(2, 4))
        exchange = pool.submit(ranks[1].all_to_all, torch.zeros(2, 4))
        with pytest.raises(RuntimeError, match="issued different collectives: .* rank 1 exchanged an all-to-all"):
            gather.result(timeout=10)
        with pytest.raises(RuntimeError, match="issued different collectives|rank 0 failed"):
            exchange.result(timeout=10)


def test_the_file_is_private_to_its_owner_and_never_replaced(tmp_path):
    path = str(tmp_path / "rows")
    assert shared_memory._map(path, b"t" * 16, SharedRows.nbytes(2), create=True) is not None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert shared_memory._map(path, b"u" * 16, SharedRows.nbytes(2), create=True) is None
