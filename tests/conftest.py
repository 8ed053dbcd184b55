"""Session setup shared by every test module.

torchvision's Python modules must be importable before anything imports transformers or
timm, even where the installed torchvision's compiled ops were built for another torch
(see ``tests.real_models.ensure_torchvision_importable``, which spawned workers also run
when they import the model zoo).

[Note: test files in parallel] pyproject's ``addopts`` run the suite in pytest-xdist
workers, a whole file per worker (``--dist loadfile``: a file's module fixtures, which
compile and train once for many tests, run once). On 2 cores one worker leaves a core
idle much of the time: single-process tests use one, and a spawn's ranks wait on each
other and on their compiles. A test that asserts how long something takes (a fault
named within seconds) is marked ``exclusive``: it runs while no other worker runs a
test, so another file's compile cannot stretch what it times. ``-n 0`` runs serially.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

# compshard's compile cache lives in torch's AOTAutograd cache (docs/caching.md): off for the suite, so that no
# test loads a schedule that another test, an earlier run or a patched pass compiled. test_compile_cache turns it on.
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")

from tests.real_models import ensure_torchvision_importable  # noqa: E402

ensure_torchvision_importable()

MAX_WORKERS = 4  # each worker's spawns start up to 4 ranks of about half a GiB each
LOCKS = "COMPSHARD_TEST_LOCKS"  # the folder of the run's lock files, made by xdist's controller


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "exclusive: runs while no other xdist worker runs a test (it asserts how long something takes)"
    )
    if not hasattr(config, "workerinput"):  # the controller (or a serial run): its workers inherit the folder
        os.environ[LOCKS] = tempfile.mkdtemp(prefix="compshard-test-locks-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(LOCKS), ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist (-o addopts=) has no such hook
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per core, at most MAX_WORKERS (xdist's own rule where
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` is set)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not hasattr(item.config, "workerinput"):  # a serial run
        yield
        return
    exclusive = _is_exclusive(item)
    with _turn(os.environ[LOCKS], exclusive=exclusive, keep=exclusive and _is_exclusive(nextitem)):
        yield


def _is_exclusive(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("exclusive") is not None


_held: dict[str, int] = {}  # this worker's open lock files, by name


def _lock_file(folder: str, name: str) -> int:
    if name not in _held:
        _held[name] = os.open(os.path.join(folder, name), os.O_RDWR | os.O_CREAT, 0o600)
    return _held[name]


@contextlib.contextmanager
def _turn(folder: str, exclusive: bool, keep: bool) -> Iterator[None]:
    """A test's turn on the machine: shared among the workers, or the whole of it.

    Two ``flock`` files: ``tests`` is held shared by every running test and exclusively
    by an exclusive one; ``gate`` is held by an exclusive test while it waits and runs,
    and passed through by every other test before it starts, so that a waiting exclusive
    test is not starved by the others' next tests. An exclusive test followed by
    another (``keep``) keeps both locks, so a run of them is not interleaved with others.
    """
    gate, tests = _lock_file(folder, "gate"), _lock_file(folder, "tests")
    if exclusive:
        fcntl.flock(gate, fcntl.LOCK_EX)  # no-ops when kept from the previous test
        fcntl.flock(tests, fcntl.LOCK_EX)
    else:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(tests, fcntl.LOCK_SH)
    try:
        yield
    finally:
        if not keep:
            fcntl.flock(tests, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)
