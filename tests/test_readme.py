"""The README's examples run as written (against this checkout's compshard), in one
process and, where the README says so, under torchrun with two processes; CI runs the
README's two commands."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
COMMANDS = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def _run(block: str, folder: pathlib.Path, torchrun: bool = False) -> subprocess.CompletedProcess:
    script = folder / "example.py"
    script.write_text(block)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun \
        else [sys.executable]
    return subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=300, cwd=folder,
                          env=_env())


def test_readme_example_runs(tmp_path):
    assert BLOCKS, "README has no python example"
    done = _run(BLOCKS[0], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^loss \d+\.\d{4}$", done.stdout, re.M)
    assert "all_gather" not in done.stdout and "live after" in done.stdout  # one rank: nothing to gather


# the pipeline example needs two processes: tests/test_pipeline.py runs it under its spawn
ONE_PROCESS = [(i, b) for i, b in enumerate(BLOCKS[1:], 2) if "compshard.pipeline(" not in b]
# the examples the README says also run under torchrun (they join the job when launched by it)
TORCHRUN = [(i, b) for i, b in enumerate(BLOCKS, 1) if '"RANK" in os.environ' in b]


@pytest.mark.parametrize("block", [pytest.param(b, id=f"example-{i}") for i, b in ONE_PROCESS])
def test_other_readme_examples_run(tmp_path, block):
    done = _run(block, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]


def test_torchrun_examples_are_found():
    assert [i for i, _ in TORCHRUN] == [1, next(i for i, b in enumerate(BLOCKS, 1) if "checkpoint.save" in b)]


@pytest.mark.parametrize("block", [pytest.param(b, id=f"example-{i}") for i, b in TORCHRUN])
def test_readme_examples_run_under_torchrun(tmp_path, block):
    done = _run(block, tmp_path, torchrun=True)
    assert done.returncode == 0, done.stderr[-3000:]
    if block is BLOCKS[0]:
        assert len(re.findall(r"^loss \d+\.\d{4}$", done.stdout, re.M)) == 1  # rank 0 prints
        assert "all_gather" in done.stdout and "reduce_scatter" in done.stdout  # two ranks: sharded
    else:
        assert len(re.findall(r"^grad norm \d+\.\d{4}, \d+ model tensors", done.stdout, re.M)) == 1


def test_ci_runs_the_readme_commands_as_written():
    setup = next(c for c in COMMANDS if "pip install torch==2.13.0" in c).strip()
    tests = next(c for c in COMMANDS if "pytest" in c).strip()
    assert "pip install -e . " in setup and setup.endswith("benchmarks/demo.py")
    assert setup.index("torch==2.13.0") < setup.index("pip install -e .")  # pinned torch first (CPU build)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert f"{setup} || exit" in ci and f"{tests} || exit" in ci
    assert ci.index(f"{setup} || exit") < ci.index(f"{tests} || exit")  # the demo, with runtime dependencies only, first
