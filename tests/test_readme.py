"""The README's example runs as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_runs(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README has no python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^loss \d+\.\d{4}$", done.stdout, re.M)
    assert "all_gather" not in done.stdout and "live after" in done.stdout  # one rank: nothing to gather
