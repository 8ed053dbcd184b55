"""The README's examples run as written (against this checkout's compshard), in one
process and, where they join a torchrun job, under torchrun with two processes; CI runs
the README's two commands. Which fences run: tests/doc_blocks.py."""

from __future__ import annotations

import re

import pytest

from tests.doc_blocks import README, ROOT, blocks, run, runnable

BLOCKS = runnable([README])
COMMANDS = [block.code for block in blocks(README) if block.language == "bash"]
LOSS = re.compile(r"^loss \d+\.\d{4}$", re.M)


def test_readme_example_runs(tmp_path):
    assert BLOCKS, "README has no python example"
    done = run(BLOCKS[0], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert LOSS.search(done.stdout)
    assert "all_gather" not in done.stdout and "live after" in done.stdout  # one rank: nothing to gather


def test_readme_example_runs_under_torchrun(tmp_path):
    assert BLOCKS[0].launches() == [1, 2]
    done = run(BLOCKS[0], tmp_path, processes=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(LOSS.findall(done.stdout)) == 1  # rank 0 prints
    assert "all_gather" in done.stdout and "reduce_scatter" in done.stdout  # two ranks: sharded


@pytest.mark.parametrize(
    "block, processes", [pytest.param(b, n, id=f"{b.name}-{n}") for b in BLOCKS[1:] for n in b.launches()]
)
def test_other_readme_examples_run(tmp_path, block, processes):
    done = run(block, tmp_path, processes)
    assert done.returncode == 0, done.stderr[-3000:]
    assert LOSS.search(done.stdout)


def test_readme_trains_a_hugging_face_model():
    assert any("from transformers import" in block.code for block in BLOCKS)


def test_ci_runs_the_readme_commands_as_written():
    setup = next(c for c in COMMANDS if "pip install torch==2.13.0" in c).strip()
    tests = next(c for c in COMMANDS if "pytest" in c).strip()
    assert "pip install -e . " in setup and setup.endswith("benchmarks/demo.py")
    assert setup.index("torch==2.13.0") < setup.index("pip install -e .")  # pinned torch first (CPU build)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert f"{setup} || exit" in ci and f"{tests} || exit" in ci
    assert ci.index(f"{setup} || exit") < ci.index(f"{tests} || exit")  # the demo (runtime dependencies only) first


def test_readme_is_a_front_door():
    assert len(README.read_text().splitlines()) <= 300
