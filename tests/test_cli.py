"""The demo's and the benchmarks' --help: instant (torch not imported) and with defaults."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = ["demo.py", "bench_step.py", "bench_recompute.py", "bench_kernels.py", "bench_plan.py"]

# Runs the script as __main__ with --help and reports whether torch got imported.
PROBE = """
import runpy, sys
sys.argv = [{script!r}, "--help"]
sys.path.insert(0, {folder!r})
try:
    runpy.run_path({script!r}, run_name="__main__")
except SystemExit as exit:
    print("exit", exit.code)
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_fast_and_shows_defaults(script):
    path = str(BENCHMARKS / script)
    done = subprocess.run([sys.executable, "-c", PROBE.format(script=path, folder=str(BENCHMARKS))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "exit 0" in done.stdout
    assert "torch imported: False" in done.stdout
    assert "(default: 20)" in done.stdout or "(default: 7)" in done.stdout  # --steps, or bench_kernels' --repeats
