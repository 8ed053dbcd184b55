"""The suite's parallel workers (tests/conftest.py): an ``exclusive`` test runs alone.

A pytest run in two xdist workers, with this suite's conftest, of three generated files:
an exclusive one, sent to a worker first, and two plain ones. Every test records when it
ran and on which worker; no plain test may run while an exclusive one does.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORDING_TEST = """
import os, time
import pytest
{mark}
@pytest.mark.parametrize("index", range({count}))
def test_records(index, request):
    started = time.time()
    time.sleep({seconds})
    folder = os.environ["RECORDS"]
    name = request.node.nodeid.replace("/", "_").replace(":", "_")
    with open(os.path.join(folder, name), "w") as record:
        record.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{started}} {{time.time()}} {exclusive}")
"""


def test_no_test_runs_beside_an_exclusive_one(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    files = {
        "test_a_exclusive.py": RECORDING_TEST.format(
            mark="pytestmark = pytest.mark.exclusive", count=2, seconds=1.0, exclusive=True
        ),
        "test_b_plain.py": RECORDING_TEST.format(mark="", count=4, seconds=0.5, exclusive=False),
        "test_c_plain.py": RECORDING_TEST.format(mark="", count=4, seconds=0.5, exclusive=False),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    records = tmp_path / "records"
    records.mkdir()
    env = {**os.environ, "RECORDS": str(records), "PYTHONPATH": str(ROOT)}
    env.pop("PYTEST_ADDOPTS", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"]
        + ["--no-loadscope-reorder", *files],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = []
    for record in records.iterdir():
        worker, started, ended, exclusive = record.read_text().split()
        runs.append((worker, float(started), float(ended), exclusive == "True"))
    assert len(runs) == 10, runs
    assert len({worker for worker, *_ in runs}) == 2, runs  # the run was parallel
    alone = [(start, end) for _, start, end, exclusive in runs if exclusive]
    beside = [run for run in runs if not run[3] and any(run[1] < end and start < run[2] for start, end in alone)]
    assert not beside, (alone, beside)


def test_auto_workers_follow_the_cores_up_to_four(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests import conftest

    monkeypatch.delenv("PYTEST_XDIST_AUTO_NUM_WORKERS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert conftest.pytest_xdist_auto_num_workers(None) == conftest.MAX_WORKERS == 4
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "3")
    assert conftest.pytest_xdist_auto_num_workers(None) is None  # xdist's own rule reads it
