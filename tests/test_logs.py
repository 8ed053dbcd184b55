"""TORCH_LOGS="compshard" shows the passes' decisions; TORCH_TRACE gets structured artifacts."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = """
import torch
import compshard
from tests.models import make_model

model, batch = make_model("gpt")
compshard.shard(model)
torch.compile(model, backend="compshard")(*batch).backward()
"""


def test_torch_logs_and_trace(tmp_path):
    env = {
        **os.environ,
        "TORCH_LOGS": "+compshard",
        "TORCH_TRACE": str(tmp_path / "trace"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr
    assert "compshard: 3 buckets" in log
    assert "bucket blocks.0: 12 params" in log
    assert "compshard: recompute none" in log
    for graph in ("forward", "backward"):
        assert f"compshard: {graph} estimated:" in log and "peak" in log and "fingerprint" in log
        assert f"compshard: scheduled {graph} graph:" in log  # "+compshard": DEBUG shows the graphs

    artifacts = {}
    for path in (tmp_path / "trace").iterdir():
        for line in path.read_text().splitlines():
            if '"artifact"' in line:
                start = line.index("{")
                record = json.JSONDecoder().raw_decode(line[start:])[0]
                artifacts[record["artifact"]["name"]] = record
    assert {
        "compshard_plan",
        "compshard_forward_schedule",
        "compshard_forward_decisions",
        "compshard_backward_schedule",
        "compshard_backward_decisions",
    } <= set(artifacts)
    assert all(
        "frame_id" in artifacts[name] for name in artifacts if name.startswith("compshard")
    )  # tied to the compile


def test_a_compile_warning_points_at_the_users_line():
    import warnings

    import torch

    import compshard
    from tests.models import make_model

    torch._dynamo.reset()
    model, batch = make_model("gpt")
    compshard.shard(model)
    step_model = torch.compile(model, backend="compshard", options={"recompute": {"budget_mb": 0}})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step_model(*batch)  # compiles here: the budget cannot be met
    ours = [w for w in caught if "recompute budget_mb" in str(w.message)]
    assert ours, [str(w.message) for w in caught]
    assert all(w.filename == __file__ for w in ours), [(w.filename, w.lineno) for w in ours]
    assert "MiB" in str(ours[0].message) and " MB " not in str(ours[0].message)
