"""Faults end in seconds with the true cause; nothing trains or loads wrong numbers.

Each test spawns two gloo ranks, trains the tiny GPT and
injects one fault at a chosen step on rank 1: killed (``SIGKILL``; the test does not reap
it until the other rank has ended, so it stays a zombie meanwhile), an exception that
ends its process, an exception it catches and goes on after, a batch of another size.
The other rank must end within :data:`FAULT_SECONDS` of the fault with an error that
names rank 1 (or the documented ``ScheduleError``); no rank may hang (every wait and join
here has a deadline).
Where nothing should fail (a parameter read on one rank), training must match the run
without it.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.tensor import DTensor

import compshard
from compshard import checkpoint
from compshard.comm import rank_exchange
from tests.models import make_model
from tests.training import adamw, local_batch

pytestmark = pytest.mark.exclusive  # times how soon a fault ends every rank (conftest)

FAULT_SECONDS = 15  # every rank ends within this of the fault
RUN_SECONDS = 120  # a whole spawn's deadline: past it the test fails, its processes killed
FAULTY = 1  # the rank a fault is injected on


class InjectedFault(Exception):
    """The exception a test raises on the faulty rank."""


@dataclass(frozen=True)
class Outcome:
    """How one rank's scenario ended."""

    rank: int
    result: Any
    error: str | None  # "<type>: <message>" of what it raised
    ended: float  # time.time()


_run_dir = ""  # the spawned rank's run folder (set in _child)


def _note_fault() -> None:
    with open(os.path.join(_run_dir, "fault"), "w") as file:
        file.write(repr(time.time()))


def _fault(how: str) -> None:
    """Note the time, then fault as ``how`` says: ``"kill"`` (SIGKILL), ``"raise"``, or
    ``"note"`` (only the time: the fault is what the rank does next)."""
    _note_fault()
    if how == "note":
        return
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault("injected")


def _child(rank: int, world_size: int, run_dir: str, scenario: Callable, args: tuple) -> None:
    global _run_dir
    _run_dir = run_dir
    errors = os.open(os.path.join(run_dir, f"{rank}.err"), os.O_WRONLY | os.O_CREAT, 0o600)
    os.dup2(errors, 2)  # what a rank that aborts says (gloo's own checks end the process)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(run_dir, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=RUN_SECONDS)
    )
    try:
        result, error = scenario(rank, world_size, *args), None
    except InjectedFault:
        raise  # the faulty rank: its exception ends its process, as an uncaught one ends a script
    except Exception as caught:  # noqa: BLE001 - the outcome under test
        result, error = None, f"{type(caught).__name__}: {caught}"
    outcome = Outcome(rank, result, error, time.time())
    torch.save(outcome, os.path.join(run_dir, f"{rank}.pt"))
    os._exit(0)  # no teardown: a failed group's may block


@dataclass(frozen=True)
class Run:
    outcomes: list[Outcome | None]  # by rank; None: the rank's process ended without one (the faulty rank)
    exited: list[float]  # by rank: when this process saw it end (time.time())
    stderr: list[str]  # by rank
    fault: float | None  # when the fault was injected

    def late_ranks(self) -> list[str]:
        """The ranks that ended more than FAULT_SECONDS after the fault, as complaints."""
        assert self.fault is not None, "the fault was not injected"
        late = []
        for rank, (outcome, exited) in enumerate(zip(self.outcomes, self.exited)):
            ended = outcome.ended if outcome is not None else exited
            if ended - self.fault > FAULT_SECONDS:
                late.append(f"rank {rank} ended {ended - self.fault:.1f} s after the fault")
        return late


def _run(scenario: Callable, *args: Any, world_size: int = 2) -> Run:
    """``scenario(rank, world_size, *args)`` on ``world_size`` spawned ranks. The faulty
    rank is joined last, so a killed one stays a zombie while the others run."""
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as run_dir:
        processes = [
            context.Process(target=_child, args=(rank, world_size, run_dir, scenario, args))
            for rank in range(world_size)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + RUN_SECONDS
        exited = [0.0] * world_size
        try:
            for rank in [*range(FAULTY), *range(FAULTY + 1, world_size), FAULTY]:
                processes[rank].join(max(0.0, deadline - time.monotonic()))
                assert not processes[rank].is_alive(), f"{scenario.__name__}: rank {rank} ran past {RUN_SECONDS} s"
                exited[rank] = time.time()
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        outcomes = [
            torch.load(path, weights_only=False) if os.path.exists(path := os.path.join(run_dir, f"{r}.pt")) else None
            for r in range(world_size)
        ]
        fault_path = os.path.join(run_dir, "fault")
        fault = float(open(fault_path).read()) if os.path.exists(fault_path) else None
        stderr = [open(os.path.join(run_dir, f"{rank}.err")).read() for rank in range(world_size)]
        return Run(outcomes, exited, stderr, fault)


def _survivor(run: Run) -> Outcome:
    """Rank 0's outcome, checked: it ended with an error within FAULT_SECONDS of the fault."""
    outcome = run.outcomes[0]
    assert outcome is not None, f"rank 0 ended without an outcome: {run.stderr[0][-2000:]}"
    assert outcome.error is not None, f"rank 0 did not fail: {outcome.result}"
    assert not run.late_ranks(), run.late_ranks()
    return outcome


def _sharded_gpt(compiled: bool = True) -> tuple[torch.nn.Module, Callable, tuple[torch.Tensor, ...]]:
    model, batch = make_model("gpt")
    compshard.shard(model)
    step_model = torch.compile(model, backend="compshard") if compiled else model
    return model, step_model, batch


# ----------------------------------------------------------------- a rank dies or raises


def _dies_mid_step(rank: int, world_size: int, step: int, how: str, compiled: bool = True) -> list[float]:
    """Train; at ``step`` the faulty rank faults between its forward and its backward."""
    model, step_model, batch = _sharded_gpt(compiled)
    optimizer = adamw(model)
    losses = []
    for current in range(step + 2):
        loss = step_model(*local_batch(batch, rank, world_size))
        if current == step and rank == FAULTY:
            _fault(how)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "uncompiled"])
def test_a_killed_rank_is_named_within_seconds_while_a_zombie(compiled):
    """No process id is read: a zombie (and a rank in another PID namespace) is noticed
    by its heartbeat stopping, after its closed sockets fail the other rank's collective."""
    outcome = _survivor(_run(_dies_mid_step, 2, "kill", compiled))
    assert "rank 1" in outcome.error, outcome.error


def _dies_in_its_experts_exchange(rank: int, world_size: int, how: str, compiled: bool) -> list[float]:
    """Experts split across ranks (Qwen3-MoE): at the second step the faulty rank faults
    as its first all-to-all starts, so the other waits for it inside that all-to-all."""
    from compshard.comm import expert_ops
    from tests.sharding.test_expert_parallel import EXPERTS, build_qwen3_moe

    model, batch = build_qwen3_moe()
    compshard.shard(model, experts=EXPERTS)
    step_model = torch.compile(model, backend="compshard") if compiled else model
    exchange = expert_ops._all_to_all
    losses = []
    for step in range(3):
        if step == 1 and rank == FAULTY:

            def faulty(*args: Any) -> torch.Tensor:
                _fault(how)
                return exchange(*args)

            expert_ops._all_to_all = faulty
        loss = step_model(*local_batch(batch, rank, world_size))
        loss.backward()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "uncompiled"])
def test_a_rank_that_dies_in_an_experts_all_to_all_is_named_within_seconds(compiled):
    outcome = _survivor(_run(_dies_in_its_experts_exchange, "kill", compiled))
    assert "rank 1" in outcome.error, outcome.error


def _at_next_compile_exchange(how: str) -> None:
    """Make this rank fault (:func:`_fault`) as it enters its next compile-time exchange:
    the other ranks are then compiling the same graph."""
    wait = rank_exchange._wait_for_everyone

    def fault_then_wait(*args: Any) -> None:
        rank_exchange._wait_for_everyone = wait
        _fault(how)
        wait(*args)

    rank_exchange._wait_for_everyone = fault_then_wait


def _fails_while_the_others_compile(rank: int, world_size: int, how: str) -> None:
    model, step_model, batch = _sharded_gpt()
    if rank == FAULTY:
        _at_next_compile_exchange(how)
    step_model(*local_batch(batch, rank, world_size)).backward()


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_that_fails_while_the_others_compile_is_named(how):
    """The compile-time exchange notices the failed rank in seconds, and does not blame shapes."""
    outcome = _survivor(_run(_fails_while_the_others_compile, how))
    assert "ScheduleError" not in outcome.error and "rank 1" in outcome.error, outcome.error
    cause = "rank 1 failed: InjectedFault: injected" if how == "raise" else "rank 1 stopped: no heartbeat"
    assert cause in outcome.error, outcome.error


# ------------------------------------------------------------------ a rank goes its own way


def _batch_changes(rank: int, world_size: int, step: int) -> None:
    """Train compiled; at ``step`` the faulty rank's batch loses a row, so it alone
    recompiles; the fault shows (its time is noted) where that compile first exchanges."""
    model, step_model, batch = _sharded_gpt()
    optimizer = adamw(model)
    for current in range(step + 2):
        inputs = local_batch(batch, rank, world_size)
        if current == step and rank == FAULTY:
            _at_next_compile_exchange("note")
            inputs = tuple(t[:-1] for t in inputs)
        step_model(*inputs).backward()
        optimizer.step()
        optimizer.zero_grad()


def test_a_rank_whose_batch_changes_raises_the_schedule_error_everywhere():
    run = _run(_batch_changes, 2)
    for rank, outcome in enumerate(run.outcomes):
        assert outcome is not None and outcome.error is not None, f"rank {rank}: {outcome} {run.stderr[rank][-2000:]}"
        assert "ScheduleError: " in outcome.error and "dynamic=True" in outcome.error, outcome.error
    assert not run.late_ranks(), run.late_ranks()


def _skips_a_batch(rank: int, world_size: int, step: int) -> None:
    """The skip-batch pattern: at ``step`` the faulty rank's loss raises (after its
    forward), it catches the exception and goes on to the next batch."""
    model, step_model, batch = _sharded_gpt()
    optimizer = adamw(model)
    for current in range(step + 3):
        try:
            loss = step_model(*local_batch(batch, rank, world_size))
            if current == step and rank == FAULTY:
                _fault("raise")
            loss.backward()
        except InjectedFault:
            continue
        optimizer.step()
        optimizer.zero_grad()


def test_a_rank_that_skips_a_batch_ends_in_a_clear_error():
    """gloo's own size check ends the process that receives the wrong size, saying so;
    the other rank then fails naming it."""
    run = _run(_skips_a_batch, 2)
    said = [outcome.error if outcome is not None else stderr for outcome, stderr in zip(run.outcomes, run.stderr)]
    assert all(said), said  # every rank raised, or aborted saying why
    assert any("collective mismatch" in text for text in said), said
    assert not run.late_ranks(), run.late_ranks()


# ----------------------------------------------------------------------------- checkpoints


def _dies_in_its_checkpoint_overwrite(rank: int, world_size: int, path: str) -> None:
    """Save after step 1 to ``path``, train on, save over it with the faulty rank killed as
    it starts writing its file: the other rank has agreed the plan and writes its own."""
    model, step_model, batch = _sharded_gpt(compiled=False)
    optimizer = adamw(model)
    for current in range(3):
        step_model(*local_batch(batch, rank, world_size)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if current == 0:
            checkpoint.save(path, model, optimizer)
            if rank == 0:
                torch.save(checkpoint.full_state_dict(model), path + ".expected")
            else:
                checkpoint.full_state_dict(model)
    if rank == FAULTY:
        FileSystemWriter.write_data = lambda *args, **kwargs: _fault("kill")
    checkpoint.save(path, model, optimizer)


def test_a_checkpoint_overwrite_that_a_rank_dies_in_keeps_the_old_one_whole(tmp_path):
    path = str(tmp_path / "ckpt")
    _survivor(_run(_dies_in_its_checkpoint_overwrite, path))
    model, _ = make_model("gpt")
    checkpoint.load(path, model)
    expected = torch.load(path + ".expected")
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), f"{name}: not the checkpoint of step 1"


# --------------------------------------------------------- reads outside forward, misuse


def _reads_and_misuse(rank: int, world_size: int) -> dict:
    """Rank 0 alone reads a parameter outside forward (to log its norm) in the middle of
    training; the losses and parameters must be those of a run without the read. Then
    the misuses: a model compiled and called before shard, and offload of a meta model."""
    results = {}
    for read in (False, True):
        model, step_model, batch = _sharded_gpt()
        optimizer = adamw(model)
        losses = []
        for current in range(3):
            if read and current == 1 and rank == 0:
                weight = model.blocks[0].mlp.fc.weight
                results["read"] = (
                    isinstance(weight, torch.nn.Parameter) and isinstance(weight, DTensor),
                    tuple(weight.to_local().shape),
                )
            loss = step_model(*local_batch(batch, rank, world_size))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results["with read" if read else "without read"] = losses, checkpoint.full_state_dict(model)
    results["full norm"] = model.blocks[0].mlp.fc.weight.full_tensor().norm()  # explicit, on every rank

    model, batch = make_model("gpt")
    torch.compile(model, backend="compshard")(*local_batch(batch, rank, world_size)).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compshard.shard(model)
    results["compiled before shard"] = [str(warning.message) for warning in caught]

    with torch.device("meta"):
        meta_model, _ = make_model("gpt")
    try:
        compshard.shard(meta_model, offload=True)  # (without offload a meta model is sharded from its shapes)
    except ValueError as error:
        results["meta"] = str(error)
    return results


def test_a_read_outside_forward_is_local_and_misuse_is_named():
    run = _run(_reads_and_misuse)
    results = [outcome.result if outcome is not None and outcome.error is None else outcome for outcome in run.outcomes]
    assert all(isinstance(result, dict) for result in results), results
    # the stored DTensor Parameter: this rank's rows of the (128, 32) weight, no gather
    assert results[0]["read"] == (True, (64, 32))
    for result in results:
        assert result["with read"][0] == result["without read"][0]  # same losses: nothing shifted
        for name, value in result["without read"][1].items():
            assert torch.equal(result["with read"][1][name], value), name
        assert any(
            "before shard" in message and "discarding the other ranks' updates" in message
            for message in result["compiled before shard"]
        ), result["compiled before shard"]
        assert "meta device" in result["meta"] and "to_empty" in result["meta"], result["meta"]
    assert results[0]["full norm"] == results[1]["full norm"]
