"""compshard.inspect's report in one process: the table, the fingerprints, the trace, and
every graph of a model with graph breaks."""

from __future__ import annotations

import json

import pytest
import torch

import compshard
from compshard.compile_plan import node_meta
from compshard.passes.memory_model import HELD_OUTSIDE, live_bytes
from compshard.sizes import nbytes
from tests.models import make_model
from tests.trace_checks import check_trace


@pytest.fixture(scope="module")
def report():
    torch._dynamo.reset()
    model, batch = make_model("gpt")
    return compshard.inspect(compshard.shard(model), *batch, profile=True)


def _table_rows(text: str) -> list[str]:
    """The node table's rows (between its header rule and the blank line after it)."""
    lines = text.split("\n\n")[1].splitlines()
    return lines[2:]


def test_table_hides_rows_that_only_view_tensors(report):
    rows = _table_rows(str(report))
    with_views = _table_rows(report.table(views=True))
    # one rank: nothing to gather, so packs and unpacks are views; compute runs fold into one row per graph
    assert [row.split()[0] for row in rows] == ["forward", "backward"], rows
    assert all(" compute " in row for row in rows)
    assert len(with_views) > len(rows) and any(" unpack " in row for row in with_views)
    assert len(set(rows)) == len(rows)


def test_forward_and_backward_fingerprints_differ(report):
    assert set(report.fingerprints) == {"forward", "backward"}
    assert report.fingerprints["forward"] != report.fingerprints["backward"]


def test_trace_has_one_time_origin_integer_pids_and_memory_counters(report, tmp_path):
    path = tmp_path / "trace.json"
    report.save_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    check_trace(events, measured=True)
    live = [e["args"]["bytes"] for e in events if e["ph"] == "C" and e["name"] == "estimated live bytes"]
    # one counter value per node of every graph: the estimate after it
    nodes = [node for gm in report.graphs.values() for node in gm.graph.nodes]
    assert sorted(live) == sorted(node_meta(node).live_bytes for node in nodes)


def test_report_covers_every_graph_of_a_model_with_graph_breaks():
    torch._dynamo.reset()
    model, batch = make_model("gpt-graph-break")
    compshard.shard(model)
    with compshard.backend.record_compiles() as compiled:
        report = compshard.inspect(model, *batch)
    plans = list(dict.fromkeys(g.plan.number for g in compiled))
    assert len(plans) > 1 and len(report.plans) == len(plans)  # one plan per Dynamo graph
    expected = {f"{g.kind}.{plans.index(g.plan.number)}" for g in compiled}
    assert set(report.graphs) == set(report.fingerprints) == set(report.timelines) == set(report.peak_bytes) == expected
    assert len(report.graphs) == len(compiled)
    header = str(report).split("\n\n")[0]
    assert f"compiled {len(compiled)} graphs in {len(plans)} plans" in header
    # every plan's buckets: between them, every parameter of the model
    with_buckets = {b["plan"] for b in report.buckets}
    assert with_buckets <= set(range(len(plans))) and len(with_buckets) > 1
    assert {p for b in report.buckets for p in b["params"]} == {name for name, _ in model.named_parameters()}
    assert all(f"{kind}.{i}" in report.pass_seconds for i in range(len(plans)) for kind in ("dynamo", "forward"))


def test_backward_estimate_leaves_out_the_inputs_its_caller_holds(report):
    """The backward's inputs saved from the forward's own inputs (parameter shards, the
    batch: ``primals_*``) are held by the module and the caller whatever the backward
    does: they are tagged (``memory_model.mark_held_outside``) and the estimate counts
    none of them; the other inputs (activations, tangents) it counts from the start."""
    backward = report.graphs["backward"].graph
    inputs = list(backward.find_nodes(op="placeholder"))
    held = {node.name for node in inputs if node.meta.get(HELD_OUTSIDE)}
    primals = {node.name for node in inputs if node.name.startswith("primals")}
    assert primals and primals <= held, (primals, held)
    counted = [node for node in inputs if node.name not in held and isinstance(node.meta.get("val"), torch.Tensor)]
    assert counted, "every input was taken for one the caller holds"
    during, _ = live_bytes(backward, count_inputs=True)
    assert during[inputs[-1]] == sum(nbytes(node.meta["val"]) for node in counted)


def test_version():
    assert isinstance(compshard.__version__, str) and compshard.__version__.count(".") == 2
