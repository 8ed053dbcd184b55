"""Run a test worker in spawned gloo processes on 127.0.0.1, never hanging.

Rendezvous goes through a FileStore in the run's own temporary folder, so concurrent
runs (two pytest sessions, say) can never join each other's group; gloo is pinned to
the loopback interface.

``run_distributed(worker, world_size, *args)`` starts ``world_size`` processes, each
calling ``worker(rank, world_size, *args)`` inside an initialized gloo process group, and
returns the workers' (picklable) results by rank. Process groups have a timeout
(``pg_timeout`` seconds; ``PROCESS_GROUP_TIMEOUT`` by default); the whole run has a
deadline (``timeout``) after which every process is killed and TimeoutError raised.
An exception in any worker is re-raised here with its traceback.

[Note: forkserver] A spawned rank imports torch and compshard afresh, seconds of CPU per
rank, and the suite starts dozens of process groups. Ranks are forked instead
from one forkserver that imported them once (a run then starts in a fraction of a
second). The server keeps the environment it started with, and torch reads some
variables (``TORCHINDUCTOR_*``) when it is imported, so a run whose environment differs
from the server's (a test that set a variable) is spawned, as before. The server must be
single-threaded when it forks (a thread's locks would be copied held): numpy's OpenBLAS
starts a thread pool at import unless ``OPENBLAS_NUM_THREADS=1``, set before it starts.
A rank that dies of a signal leaves Python's fault traceback, which the error carries.

The server also imports what nearly every rank imports later, once instead of per rank:
the compile stack that a rank's first ``torch.compile`` loads (Inductor's and export's
modules, about a second of CPU), pytest (which a test module, imported to unpickle its
worker, imports), and the real-model zoo's libraries (``tests.real_models`` first, so that
its torchvision fix is in place before transformers and timm import torchvision). None of
them starts a thread at import; a library that is not installed is skipped.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=120)
_PRELOADED = [
    "torch",
    "compshard",
    "tests.distributed",
    "torch._inductor.compile_fx",
    "torch.export._trace",
    "torch.distributed.tensor.experimental",
    "pytest",
    "tests.real_models",
    "transformers.modeling_utils",
    "timm",
    "torchvision.models",
]
_VARYING = ("PYTEST_CURRENT_TEST",)  # pytest rewrites it for every test
_server_environment: dict[str, str] | None = None


def _start_method() -> str:
    """The start method: forkserver while the environment is the server's, else spawn."""
    global _server_environment
    if _server_environment is None:  # the server starts with the first run
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        mp.set_forkserver_preload(_PRELOADED)
        _server_environment = _environment()
    return "forkserver" if _environment() == _server_environment else "spawn"


def _environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in _VARYING}


def _entry(
    rank: int,
    worker: Callable,
    world_size: int,
    out_dir: str,
    args: tuple,
    pg_timeout: datetime.timedelta = PROCESS_GROUP_TIMEOUT,
) -> None:
    faults = open(os.path.join(out_dir, f"faults{rank}.txt"), "w")  # open while the process lives
    faulthandler.enable(faults)
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.FileStore(os.path.join(out_dir, "store"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=pg_timeout)
    try:
        result = worker(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _fault_tracebacks(out_dir: str, world_size: int) -> str:
    texts = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"faults{rank}.txt")
        if not os.path.exists(path):  # the rank died before its entry ran
            continue
        with open(path) as faults:
            if text := faults.read().strip():
                texts.append(f"rank {rank}:\n{text}")
    return "\n".join(texts) or "(no rank left a fault traceback)"


def run_distributed(
    worker: Callable, world_size: int, *args: Any, timeout: float = 300, pg_timeout: float | None = None
) -> list[Any]:
    group_timeout = PROCESS_GROUP_TIMEOUT if pg_timeout is None else datetime.timedelta(seconds=pg_timeout)
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(
            _entry,
            args=(worker, world_size, out_dir, args, group_timeout),
            nprocs=world_size,
            join=False,
            start_method=_start_method(),
        )
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"distributed test {worker.__name__} (world size {world_size}) ran past {timeout}s"
                    )
        except mp.ProcessExitedException as error:
            raise RuntimeError(f"{error}\n{_fault_tracebacks(out_dir, world_size)}") from error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(out_dir, f"{rank}.pt"), weights_only=False) for rank in range(world_size)]
