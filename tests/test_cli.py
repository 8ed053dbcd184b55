"""The demo's and the benchmarks' --help: instant (torch not imported) and with defaults."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = [
    "demo.py",
    "bench_step.py",
    "bench_tp.py",
    "bench_recompute.py",
    "bench_kernels.py",
    "bench_plan.py",
    "bench_moe.py",
    "bench_oss.py",
    "profile_step.py",
]

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
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(script=path, folder=str(BENCHMARKS))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "exit 0" in done.stdout
    assert "torch imported: False" in done.stdout
    assert "(default: 20)" in done.stdout or "(default: 7)" in done.stdout  # --steps, or bench_kernels' --repeats


def run_bench_step(*args: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_step.py"), *args, "--out", str(tmp_path / "step.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS,
        env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")},
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--fake-world", "1"], "--fake-world must be at least 2"),
        (["--fake-world", "4", "--systems", "compshard,ddp"], "leave ddp out"),
        (
            ["--fake-world", "3", "--batch", "8", "--systems", "compshard"],
            "--batch 8 must be a multiple of --fake-world 3",
        ),
    ],
)
def test_fake_world_rejects_what_it_cannot_run(args, message, tmp_path):
    done = run_bench_step(*args, tmp_path=tmp_path)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_fake_world_step_runs_as_rank_0_of_n(tmp_path):
    """One process under the fake process group: compshard's step at world size 4 (its
    collectives derived, none replayed) beside the compute-only step."""
    done = run_bench_step(
        "--fake-world",
        "4",
        "--batch",
        "4",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--systems",
        "compshard",
        "--layers",
        "1",
        "--width",
        "32",
        "--heads",
        "2",
        "--seq",
        "16",
        "--vocab",
        "64",
        tmp_path=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "step.json").read_text())
    assert record["world_size"] == 4 and record["config"]["fake_world"] == 4
    rows = record["results"]
    assert rows["compshard"]["collectives"] and rows["compshard"]["comm_seconds"] == 0.0
    assert rows["compshard"]["median_step_seconds"] > 0 and rows["compute-only"]["median_step_seconds"] > 0


def test_bf16_leaves_ddp_out(tmp_path):
    done = run_bench_step("--dtype", "bf16", "--systems", "compshard,ddp", tmp_path=tmp_path)
    assert done.returncode == 2 and "--dtype bf16" in done.stderr and "leave ddp out" in done.stderr, done.stderr


# bench_step as __main__ with torchvision's Python modules importable first, as the test
# suite arranges (transformers imports torchvision where it is installed).
LLAMA_PROBE = """
import runpy, sys
sys.path[:0] = [{root!r}, {folder!r}]
from tests.real_models import ensure_torchvision_importable
ensure_torchvision_importable()
sys.argv = ["bench_step.py", *{args!r}]
runpy.run_path({script!r}, run_name="__main__")
"""


def test_bf16_llama_step_at_fake_world_with_mfu(tmp_path):
    """--model llama builds transformers' Llama from harness.LlamaShape; --dtype bf16 gathers
    in bf16 (FSDP2's derived all-gathers carry half the bytes of its fp32 reduce-scatters)
    and --peak-tflops gives every row an MFU."""
    shape = (
        '{"n_layer": 2, "n_embd": 32, "n_head": 4, "n_kv_head": 2, "intermediate": 64, "vocab_size": 64, '
        '"block_size": 16}'
    )
    args = [
        "--fake-world",
        "2",
        "--batch",
        "2",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--systems",
        "compshard,fsdp2",
        "--model",
        "llama",
        "--llama-shape",
        shape,
        "--dtype",
        "bf16",
        "--peak-tflops",
        "1",
        "--out",
        str(tmp_path / "step.json"),
    ]
    probe = LLAMA_PROBE.format(
        root=str(BENCHMARKS.parent), folder=str(BENCHMARKS), args=args, script=str(BENCHMARKS / "bench_step.py")
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=BENCHMARKS,
        env={k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((tmp_path / "step.json").read_text())
    assert record["dtype"] == "bf16" and record["config"]["model"] == "llama" and record["config"]["n_layer"] == 2
    rows = record["results"]
    assert all(row["mfu"] > 0 for row in rows.values())
    fsdp2 = rows["fsdp2"]["collectives"]
    gathers = [c["nbytes"] for c in fsdp2 if c["kind"] == "all_gather"]
    reductions = [c["nbytes"] for c in fsdp2 if c["kind"] == "reduce_scatter"]
    assert {2 * n for n in gathers[1:]} == set(reductions[:-1])  # the blocks', in bf16 against fp32


def test_llama_shape_names_its_fields(tmp_path):
    done = run_bench_step(
        "--model", "llama", "--llama-shape", '{"layers": 2}', "--fake-world", "2", "--batch", "2", tmp_path=tmp_path
    )
    assert done.returncode != 0 and "--llama-shape" in done.stderr and "layers" in done.stderr, done.stderr[-2000:]
