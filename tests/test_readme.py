"""The README's examples run as written (against this checkout's compshard)."""

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


def _run(block: str, folder: pathlib.Path) -> subprocess.CompletedProcess:
    script = folder / "example.py"
    script.write_text(block)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=folder, env=env)


def test_readme_example_runs(tmp_path):
    assert BLOCKS, "README has no python example"
    done = _run(BLOCKS[0], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^loss \d+\.\d{4}$", done.stdout, re.M)
    assert "all_gather" not in done.stdout and "live after" in done.stdout  # one rank: nothing to gather


# the pipeline example needs two processes: tests/test_pipeline.py runs it under its spawn
ONE_PROCESS = [(i, b) for i, b in enumerate(BLOCKS[1:], 2) if "compshard.pipeline(" not in b]


@pytest.mark.parametrize("block", [pytest.param(b, id=f"example-{i}") for i, b in ONE_PROCESS])
def test_other_readme_examples_run(tmp_path, block):
    done = _run(block, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
