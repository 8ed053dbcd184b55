"""Multi-process checks on gloo (world sizes 1, 2, 4): parity with eager, memory at rest,
the schedule's structure, and detection of a rank whose schedule differs.

Each world size spawns once (module-scoped fixtures); the tests read its results.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import traceback
from dataclasses import dataclass

import pytest
import torch
from torch.distributed.tensor import DTensor

import compshard
from compshard import cost_model
from compshard.comm import transport
from compshard.comm.layout import ShardLayout
from compshard.compile_plan import COLLECTIVE_KINDS, NodeMeta, node_meta
from compshard.passes.fx_utils import aliases, gathered_buffers
from tests.allocations import allocations, peak_rise
from tests.distributed import run_distributed
from tests.models import make_model
from tests.trace_checks import check_trace
from tests.training import RTOL, parity, relative_error

PARITY_MODELS = ("mlp", "gpt", "uneven", "gpt-graph-break")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _padded_numel(t: torch.Tensor, world_size: int) -> int:
    return t.numel() if t.dim() == 0 else ShardLayout(tuple(t.shape), world_size, 0).padded_shard_numel


def _state_bytes(model, opt, world_size: int) -> tuple[int, int]:
    """(bytes this rank holds, bound: 1/N of the unsharded total plus padding) for the
    parameters, gradients and optimizer state. 0-d tensors (AdamW's step counters, 0-d
    parameters) are replicated, so every rank holds them whole."""
    tensors = {}
    for p in model.parameters():
        tensors[id(p)] = p
        if p.grad is not None:
            tensors[id(p.grad)] = p.grad
        for value in opt.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    held = bound = 0
    for t in tensors.values():
        held += _local(t).numel() * t.element_size()
        bound += _padded_numel(t, world_size) * t.element_size()
    return held, bound


def _memory_at_rest(rank: int, world_size: int) -> dict:
    model, batch = make_model("gpt")
    unsharded_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 3  # param, grad, m (+ v below)
    unsharded_bytes += sum(p.numel() * p.element_size() for p in model.parameters())
    compshard.shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.compile(model, backend="compshard")(*(t.chunk(world_size)[rank] for t in batch))
    loss.backward()
    opt.step()  # state exists; gradients kept (no zero_grad) to count them too
    held, bound = _state_bytes(model, opt, world_size)
    return {"held": held, "bound": bound, "unsharded": unsharded_bytes}


def parity_worker(rank: int, world_size: int) -> dict:
    results = {}
    for name in PARITY_MODELS:
        torch._dynamo.reset()
        result = parity(name, rank, world_size)
        results[name] = {k: result[k] for k in ("loss", "params", "keys_match")}
    result = parity("uneven", rank, world_size, compiled=False)
    results["uneven-eager"] = {k: result[k] for k in ("loss", "params", "keys_match")}
    torch._dynamo.reset()
    results["memory"] = _memory_at_rest(rank, world_size)
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda n: f"world{n}")
def parity_results(request):
    return request.param, run_distributed(parity_worker, request.param)


@pytest.mark.parametrize("case", PARITY_MODELS + ("uneven-eager",))
def test_training_matches_single_process_eager(parity_results, case):
    world_size, results = parity_results
    for rank, result in enumerate(results):
        got = result[case]
        assert got["keys_match"], f"rank {rank}: full_state_dict keys differ from the unsharded model's"
        assert got["loss"] <= RTOL, f"rank {rank}: loss relative error {got['loss']:.2e}"
        worst = max(got["params"], key=got["params"].get)
        assert got["params"][worst] <= RTOL, f"rank {rank}: {worst} relative error {got['params'][worst]:.2e}"


def test_state_at_rest_is_one_nth_plus_padding(parity_results):
    world_size, results = parity_results
    for rank, result in enumerate(results):
        memory = result["memory"]
        assert memory["held"] <= memory["bound"], f"rank {rank}: {memory}"
        # the bound itself is 1/N of the unsharded bytes plus padding and replicated scalars
        assert memory["bound"] <= memory["unsharded"] / world_size + 16 * 1024, f"rank {rank}: {memory}"
    assert sum(r["memory"]["held"] for r in results) <= results[0]["memory"]["unsharded"] + 16 * 1024 * world_size


# ------------------------------------------------------------------------ schedule (world 2)


def _metadata_complete(report) -> bool:
    """Every scheduled node names parameters of the model; every collective start, wait
    and free moves bytes; a bucketed node names buckets of the plan holding its parameters."""
    params = {b["name"]: set(b["params"]) for b in report.buckets}
    for gm in report.graphs.values():
        for node in gm.graph.nodes:
            meta = node_meta(node)
            if meta.kind is None:
                continue
            if not meta.params or not set(meta.params) <= set().union(*params.values()):
                return False
            if meta.kind in (*COLLECTIVE_KINDS, "wait", "free") and meta.bytes <= 0:
                return False
            if meta.buckets and not set(meta.params) <= set().union(*(params.get(b, set()) for b in meta.buckets)):
                return False
    return True


def _schedule_facts(report) -> dict:
    forward = report.graphs["forward"]
    outputs = set(next(iter(forward.graph.find_nodes(op="output"))).all_input_nodes)
    saved_gathered = [
        p for b in gathered_buffers(forward.graph) if set(aliases(b)) & outputs for p in node_meta(b).params
    ]
    return {
        "saved_gathered": saved_gathered,
        "metadata_complete": _metadata_complete(report),
        "kinds": [(c["graph"], c["kind"], tuple(c["params"])) for c in report.collectives],
        "fingerprints": report.fingerprints,
        "backward_gathers": sum(
            1 for c in report.collectives if c["graph"] == "backward" and c["kind"] == "all_gather"
        ),
        "backward_gathered_buckets": sorted(
            name
            for c in report.collectives
            if (c["graph"], c["kind"]) == ("backward", "all_gather")
            for name in c["bucket"].split("+")
        ),
        "forward_freed_groups": sorted(
            tuple(c["params"])
            for c in report.collectives
            if (c["graph"], c["kind"], c["of"]) == ("forward", "free", "params")
        ),
        "forward_freed": sorted(
            p
            for c in report.collectives
            if (c["graph"], c["kind"], c["of"]) == ("forward", "free", "params")
            for p in c["params"]
        ),
        "buckets": sorted({c["bucket"] for c in report.collectives if c.get("bucket")}),
        "table": str(report),
    }


OPTION_VARIANTS = {
    "per-parameter": ("uneven", {"buckets": "none", "prefetch": 0}),
    "patterns": ("uneven", {"buckets": ["twice", "narrow"], "prefetch": 2}),
    "size-buckets": ("mlp", {"buckets": 0.001}),
    "bounded": ("gpt", {"prefetch": 3, "max_inflight_mb": 0.05, "memory_budget_mb": 0.01}),
}


def _independent_checks(graph) -> dict:
    """Schedule invariants, checked here without the compiler's own checker: each wait
    follows its start, nothing reads a gathered value before its wait, and the largest
    bytes of all-gathers (and of reduce-scatters) in flight together."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    starts = {n: node_meta(n) for n in graph.nodes if node_meta(n).kind in ("all_gather", "reduce_scatter")}
    waits = {n.all_input_nodes[0]: n for n in graph.nodes if node_meta(n).kind == "wait"}
    ordered = all(order[waits[s]] > order[s] for s in starts if s in waits) and set(waits) >= set(starts)
    early_use = [
        n.name
        for b in gathered_buffers(graph)
        for a in aliases(b)
        for n in a.users
        if n.op != "output" and order[n] < order[b]
    ]
    peak = {"all_gather": [], "reduce_scatter": []}
    inflight: dict = {}
    for node in graph.nodes:
        if node in starts:
            inflight[node] = starts[node]
            peak[starts[node].kind].append([m.bytes for m in inflight.values() if m.kind == starts[node].kind])
        elif node_meta(node).kind == "wait":
            inflight.pop(node.all_input_nodes[0], None)
    return {"ordered": ordered, "early_use": early_use, "inflight": peak}


def _gather_index(graph) -> dict[str, int]:
    """Bucket -> index of its all-gather among the graph's all-gathers, in order of their waits."""
    starts = [n.all_input_nodes[0] for n in graph.nodes if node_meta(n).kind == "wait"]
    gathers = [start for start in starts if node_meta(start).kind == "all_gather"]
    return {bucket: i for i, start in enumerate(gathers) for bucket in node_meta(start).buckets}


def _scratch_check(world_size: int) -> dict:
    """Bytes gloo allocates for itself during an all-gather, the in-place all-gather and
    all-to-all that run compshard's all-gathers and reduce-scatters on gloo, and a
    reduce-scatter (profiler allocation events, the output excluded), against the memory
    estimate's figure."""
    from torch.distributed.distributed_c10d import _get_default_group

    from compshard.passes.fx_utils import c10d
    from compshard.passes.memory_model import backend_scratch_bytes

    group = _get_default_group().group_name
    shard, full = torch.randn(4096), torch.randn(4096 * world_size)
    cases = {
        "all_gather": (
            c10d.all_gather_into_tensor_out.default,
            (shard, world_size, group),
            {"out": torch.empty(4096 * world_size)},
        ),
        "gather_rows": (torch.ops.compshard.gather_rows_.default, (full, world_size, group), {}),
        "reduce_scatter": (c10d.reduce_scatter_tensor.default, (full, "sum", world_size, group), {}),
        "exchange_rows": (torch.ops.compshard.exchange_rows_.default, (full, world_size, group), {}),
    }
    found = {}
    for kind, (op, args, kwargs) in cases.items():
        graph = torch.fx.Graph()
        inputs = [graph.placeholder(f"x{i}") for i, _ in enumerate(args[:1])]
        inputs[0].meta["val"] = args[0]
        start = graph.call_function(op, (inputs[0], *args[1:]), kwargs)
        output = {"reduce_scatter": torch.empty(4096)}.get(kind)  # None: in place, no output allocated
        scheduled_as = {"exchange_rows": "reduce_scatter", "gather_rows": "all_gather"}.get(kind, kind)
        in_place = kwargs.get("out", args[0])  # the tensor an in-place start writes
        start.meta.update(val=in_place if output is None else output, compshard=NodeMeta(scheduled_as, ("p",)))
        graph.call_function(c10d.wait_tensor.default, (start,))
        output = 0 if output is None else output.nbytes
        run = lambda: c10d.wait_tensor.default(op(*args, **kwargs))  # noqa: E731
        run()
        allocated = sum(size for size in allocations(run) if size > 0)
        found[kind] = (allocated - output, backend_scratch_bytes(start))
    return found


def _step_peaks(rank: int, world_size: int) -> dict:
    """The small GPT compiled with each codegen: the loss of its first step (the same
    weights for both) and the peak bytes of a forward and backward after it (gradients
    unset before each)."""
    model, batch = make_model("gpt")
    local = tuple(t.chunk(world_size)[rank] for t in batch)
    found = {}
    for codegen in ("fx", "inductor"):
        torch._dynamo.reset()
        sharded = compshard.shard(copy.deepcopy(model))
        step_model = torch.compile(sharded, backend="compshard", options={"codegen": codegen})
        losses = []

        def step():
            for param in sharded.parameters():
                param.grad = None
            loss = step_model(*local)
            loss.backward()
            losses.append(loss.detach())

        step()
        found[codegen] = {"loss": losses[0], "peak": peak_rise(step)}
    return found


def _compiled(model, local: tuple, options: dict | None = None) -> tuple:
    """Compile a sharded copy of ``model`` and run one step; return the report of what was
    compiled and the measured peak of a second forward (allocations above what was live)."""
    torch._dynamo.reset()
    sharded = compshard.shard(copy.deepcopy(model))
    step_model = torch.compile(sharded, backend="compshard", options=options)
    with compshard.backend.record_compiles() as graphs:
        step_model(*local).backward()
    return compshard.Report(graphs, config=compshard.sharding_config(sharded)), peak_rise(lambda: step_model(*local))


def _step_peak(params, step_model, local: tuple) -> int:
    """Peak bytes of a forward and backward (gradients unset first), after two such steps."""

    def step() -> None:
        for param in params:
            param.grad = None
        step_model(*local).backward()

    step()
    step()
    return peak_rise(step)


def _auto_budget(model, batch: tuple, rank: int, world_size: int) -> dict:
    """``memory_budget_mb="auto"`` on the GPT, with the cost model's constants fixed
    (a collective's latency 1 ms: re-gathers dear) so that its choice does not depend on
    this machine's timings: parity, what it decided, its measured peak against eager
    FSDP2's (one unit per block and the root) on the same model, and what it keeps when
    the ranks' local batches differ (5 rows and 3: each rank frees other bytes)."""
    local = tuple(t.chunk(world_size)[rank] for t in batch)
    uneven = tuple(t[:5] if rank == 0 else t[5:] for t in batch)
    from torch.distributed.fsdp import fully_shard

    options = {"memory_budget_mb": "auto"}
    with cost_model.assumed({torch.distributed.group.WORLD.group_name: cost_model.Costs(alpha=1e-3)}):
        torch._dynamo.reset()
        trained = parity("gpt", rank, world_size, compile_options=options)
        report, _ = _compiled(model, local, options)
        torch._dynamo.reset()
        sharded = compshard.shard(copy.deepcopy(model))
        peak = _step_peak(sharded.parameters(), torch.compile(sharded, backend="compshard", options=options), local)
        torch._dynamo.reset()
        uneven_report = compshard.inspect(compshard.shard(copy.deepcopy(model)), *uneven, options=options)
    eager = copy.deepcopy(model)
    for block in eager.blocks:
        fully_shard(block)
    fully_shard(eager)
    budget = report.plans[0].buckets.budget
    return {
        "parity": {k: trained[k] for k in ("loss", "params", "keys_match")},
        "kept": budget.kept,
        "levels": budget.levels,
        "kept_bytes": budget.kept_bytes,
        "freed_bytes": budget.freed_bytes,
        "recompute": report.plans[0].recompute.levels,
        "facts": _schedule_facts(report),
        "peak": peak,
        "fsdp2_peak": _step_peak(eager.parameters(), eager, local),
        "uneven_kept": uneven_report.plans[0].buckets.budget.kept,
    }


@dataclass(frozen=True)
class _Workload:
    """What the schedule checks share: the GPT, the global batch and this rank's rows."""

    rank: int
    world_size: int
    model: torch.nn.Module
    batch: tuple
    local: tuple


class ScheduleResults(dict):
    """One rank's schedule results by key. A check that raised left its keys out and its
    traceback in ``failed``: a test reading a key that is missing fails with those
    tracebacks, and the tests that read other checks' keys are unaffected."""

    failed: dict[str, str]

    def __missing__(self, key: str):
        raise AssertionError(f"no result {key!r}: a schedule check raised\n" + "\n".join(self.failed.values()))


def _scratch(w: _Workload, results: dict) -> None:
    results["scratch"] = _scratch_check(w.world_size)


def _default_schedule(w: _Workload, results: dict) -> None:
    report = compshard.inspect(compshard.shard(copy.deepcopy(w.model)), *w.local, profile=True)
    results["reshard"] = _schedule_facts(report)
    results["reduce_ops"] = sorted({c["op"] for c in report.collectives if c["kind"] == "reduce_scatter"})
    results["gather_ops"] = sorted({c["op"] for c in report.collectives if c["kind"] == "all_gather"})
    results["peak_bytes"] = {"auto": report.peak_bytes}
    auto, measured = _compiled(w.model, w.local)
    results["forward_peak"] = {"auto": (auto.peak_bytes["forward"], measured)}
    with tempfile.TemporaryDirectory() as folder:
        report.save_trace(os.path.join(folder, "trace.json"))
        with open(os.path.join(folder, "trace.json")) as file:
            events = json.load(file)["traceEvents"]
    results["trace"] = {
        "events": events if w.rank == 0 else [],
        "buckets": report.buckets,
        "gather_index": {kind: _gather_index(gm.graph) for kind, gm in report.graphs.items()},
        "exposed": {kind: t.exposed_comm for kind, t in report.timelines.items()},
    }


def _transport_rows(w: _Workload, results: dict) -> None:
    world_size = w.world_size
    buffer = torch.randn(world_size * 1000, generator=torch.Generator().manual_seed(w.rank))
    group = torch.distributed.group.WORLD.group_name
    rows = torch.zeros(world_size, 1000)
    rows[w.rank] = buffer[:1000]
    expected_rows = torch.ops._c10d_functional.wait_tensor(
        torch.ops._c10d_functional.all_gather_into_tensor(buffer[:1000], world_size, group)
    )
    results["gather_rows_equal_all_gather"] = torch.equal(
        transport.all_gather_rows(rows.view(-1), world_size, group), expected_rows
    )
    summed = transport.reduce_scatter_sum(buffer.clone(), world_size, group)
    results["exchange_equals_reduce_scatter"] = torch.equal(
        summed,
        torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.reduce_scatter_tensor(buffer, "sum", world_size, group)
        ),
    )
    received = transport.exchange_rows(buffer.clone(), world_size, group)
    results["exchange_equals_all_to_all"] = torch.equal(
        received,
        torch.ops._c10d_functional.wait_tensor(
            torch.ops._c10d_functional.all_to_all_single(buffer, [1000] * world_size, [1000] * world_size, group)
        ),
    )
    shard_numels, local_numels = [300, 500, 200], [300, 450, 200]  # three parameters, one short of its rows
    results["unpack_sums_exchanged_rows"] = all(
        torch.equal(unpacked, expected)
        for dtype in (torch.float32, torch.bfloat16)
        for unpacked, expected in zip(
            torch.ops.compshard.reduce_scatter_copy_out(
                received.view(world_size, -1), shard_numels, local_numels, dtype
            ),
            torch.ops.compshard.reduce_scatter_copy_out(summed, shard_numels, local_numels, dtype),
        )
    )


def _inference(w: _Workload, results: dict) -> None:
    with torch.no_grad():  # no backward: the inference graph
        inference = compshard.inspect(compshard.shard(copy.deepcopy(w.model)), *w.local)
        got = torch.compile(compshard.shard(copy.deepcopy(w.model)), backend="compshard")(*w.local)
    results["inference"] = {
        "matches_eager": torch.equal(got, w.model(*w.local)),
        "graphs": list(inference.graphs),
        "gathered": sorted(p for c in inference.collectives if c["kind"] == "all_gather" for p in c["params"]),
        "freed": sorted(
            p for c in inference.collectives if (c["kind"], c["of"]) == ("free", "params") for p in c["params"]
        ),
    }


def _prefetch_and_coalescing(w: _Workload, results: dict) -> None:
    late, measured = _compiled(w.model, w.local, {"prefetch": 0})
    results.setdefault("forward_peak", {})["prefetch 0"] = (late.peak_bytes["forward"], measured)
    results.setdefault("peak_bytes", {})["prefetch 0"] = late.peak_bytes
    results["late"] = {
        "buckets": late.buckets,
        "exposed": {kind: t.exposed_comm for kind, t in late.timelines.items()},
        "comm": {kind: t.comm for kind, t in late.timelines.items()},
    }
    separate, measured = _compiled(w.model, w.local, {"coalesce": "none"})
    results["forward_peak"]["separate"] = (separate.peak_bytes["forward"], measured)
    results["separate"] = _schedule_facts(separate)
    results["peak_bytes"]["separate"] = separate.peak_bytes


def _kept_gathered(w: _Workload, results: dict) -> None:
    kept = compshard.shard(copy.deepcopy(w.model), reshard_after_forward=False)
    results["keep"] = _schedule_facts(compshard.inspect(kept, *w.local))
    results["trainable"] = sorted(compshard.sharding.param_specs(kept))


def _option_variants(w: _Workload, results: dict) -> None:
    for name, (model_name, options) in OPTION_VARIANTS.items():
        torch._dynamo.reset()
        variant = parity(model_name, w.rank, w.world_size, compile_options=options)
        results[name] = {k: variant[k] for k in ("loss", "params", "keys_match")}


def _budget_and_bound(w: _Workload, results: dict) -> None:
    results["auto_budget"] = _auto_budget(w.model, w.batch, w.rank, w.world_size)
    torch._dynamo.reset()
    options = OPTION_VARIANTS["bounded"][1]
    bounded = compshard.inspect(compshard.shard(copy.deepcopy(w.model)), *w.local, options=options)
    results["bounded_schedule"] = {kind: _independent_checks(gm.graph) for kind, gm in bounded.graphs.items()}
    results["bounded_prefetch"] = _schedule_facts(bounded)["kinds"]


def _mismatched_schedule(w: _Workload, results: dict) -> None:
    """A rank whose compiler builds another schedule (here: rank 1 keeps every bucket
    gathered for backward, so its forward frees no parameters and its backward gathers
    none) is caught: the forwards start the same collectives, the backwards do not."""
    options = {"prefetch": 0, "coalesce": "none", **({"memory_budget_mb": 1e6} if w.rank == 1 else {})}
    try:
        compiled = torch.compile(compshard.shard(copy.deepcopy(w.model)), backend="compshard", options=options)
        compiled(*w.local).backward()
        results["mismatch"] = None
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        results["mismatch"] = str(error)


# In this order (the mismatch last: it leaves the ranks' schedules apart).
SCHEDULE_CHECKS = (
    _scratch,
    _default_schedule,
    _transport_rows,
    _inference,
    _prefetch_and_coalescing,
    _kept_gathered,
    _option_variants,
    _budget_and_bound,
    _mismatched_schedule,
)


def schedule_worker(rank: int, world_size: int) -> ScheduleResults:
    """Every schedule check in one spawn, each on its own: one that raises records its
    traceback and the next one runs (:class:`ScheduleResults`)."""
    results = ScheduleResults()
    results.failed = {}
    model, batch = make_model("gpt")
    workload = _Workload(rank, world_size, model, batch, tuple(t.chunk(world_size)[rank] for t in batch))
    for check in SCHEDULE_CHECKS:
        torch._dynamo.reset()
        try:
            check(workload, results)
        except Exception:  # noqa: BLE001 - recorded: the tests that read its results fail with it
            results.failed[check.__name__] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def schedule_results():
    return run_distributed(schedule_worker, 2)


def test_gathered_parameters_are_saved_only_for_the_last_bucket_of_forward(schedule_results):
    trainable = schedule_results[0]["trainable"]
    # wte (tied with the head, used last in forward), wpe and ln_f share the pooled bucket
    last = sorted(p for p in trainable if not p.startswith("blocks."))
    for result in schedule_results:
        facts = result["reshard"]
        assert sorted(set(facts["saved_gathered"])) == last
        assert facts["backward_gathered_buckets"] == ["blocks.0", "blocks.1"]  # gathered again in backward instead
        assert sorted(set(facts["forward_freed"])) == sorted(set(trainable) - set(last))


def test_estimated_forward_peak_is_the_measured_one(schedule_results):
    """The memory estimate the schedule is decided by, against the profiler's allocation
    events of the compiled forward (which matched to the byte when this was written)."""
    for result in schedule_results:
        for options, (estimated, measured) in result["forward_peak"].items():
            assert estimated == pytest.approx(measured, rel=0.05), (options, estimated, measured)


def test_auto_prefetch_does_not_raise_the_estimated_peak(schedule_results):
    for result in schedule_results:
        peaks = result["peak_bytes"]
        for kind in ("forward", "backward"):
            assert peaks["auto"][kind] <= peaks["prefetch 0"][kind], (kind, peaks)
        measured = {options: peak for options, (_, peak) in result["forward_peak"].items()}
        assert measured["auto"] <= measured["prefetch 0"] * 1.05, measured


def test_reshard_after_forward_false_keeps_parameters_gathered(schedule_results):
    for result in schedule_results:
        facts = result["keep"]
        assert facts["backward_gathers"] == 0
        # a bucket's parameters live in one buffer: kept buckets reach backward whole
        assert sorted(set(facts["saved_gathered"])) == result["trainable"]
        assert facts["forward_freed"] == []


def test_one_bucket_per_block_with_one_gather_and_one_reduce_scatter(schedule_results):
    trainable = schedule_results[0]["trainable"]
    for result in schedule_results:
        kinds = result["separate"]["kinds"]
        forward_gathers = [ps for g, k, ps in kinds if (g, k) == ("forward", "all_gather")]
        reduced = [ps for g, k, ps in kinds if (g, k) == ("backward", "reduce_scatter")]
        assert sorted(p for ps in forward_gathers for p in ps) == trainable  # tied wte/lm_head gathered once
        assert sorted(p for ps in reduced for p in ps) == trainable
        blocks = sorted(sorted({p.split(".")[1] for p in ps}) for ps in forward_gathers if ps[0].startswith("blocks"))
        assert blocks == [["0"], ["1"]]
        assert len(forward_gathers) == 3 and len(reduced) == 3  # wte+wpe+ln_f pooled, blocks.0, blocks.1
        assert result["separate"]["metadata_complete"]
        assert {"blocks.0", "blocks.1"} <= set(result["separate"]["buckets"])


def test_coalesced_buckets_share_collectives_but_are_freed_apart(schedule_results):
    for result in schedule_results:
        coalesced, separate = result["reshard"], result["separate"]
        for graph, kind in (("forward", "all_gather"), ("backward", "all_gather"), ("backward", "reduce_scatter")):
            count = {
                facts_name: sum(1 for g, k, _ in facts["kinds"] if (g, k) == (graph, kind))
                for facts_name, facts in (("coalesced", coalesced), ("separate", separate))
            }
            assert count["coalesced"] <= count["separate"], (graph, kind, count)
        assert len([k for k in coalesced["kinds"] if k[1] != "free"]) < len(
            [k for k in separate["kinds"] if k[1] != "free"]
        )
        # each bucket's parameters are still released on their own, right after the bucket's last use
        assert coalesced["forward_freed_groups"] == separate["forward_freed_groups"]
        assert len(coalesced["forward_freed_groups"]) == 2  # blocks.0 and blocks.1 (the pooled bucket is kept)
        assert coalesced["metadata_complete"]
        for graph in ("forward", "backward"):  # never at a higher estimated peak
            assert result["peak_bytes"]["auto"][graph] <= result["peak_bytes"]["separate"][graph], graph
        measured = {options: peak for options, (_, peak) in result["forward_peak"].items()}
        assert measured["auto"] <= measured["separate"] * 1.05, measured


def test_memory_estimate_counts_the_backend_scratch_of_collectives(schedule_results):
    for result in schedule_results:
        for kind, (measured, estimated) in result["scratch"].items():
            assert estimated == measured, (kind, measured, estimated)
            # in place: nothing; gloo's all-to-all receives into a temporary
            assert (measured == 0) if kind == "gather_rows" else (measured > 0), (kind, measured)


def test_all_gathers_on_gloo_are_sends_and_receives_into_the_rows(schedule_results):
    """gloo receives an all-gather into temporaries of its output's size and copies them
    in; compshard's compiled graphs (and its eager gathers) send each rank's row to the
    others and receive theirs in place instead, with the same bits."""
    for result in schedule_results:
        assert result["gather_ops"] == ["gather_rows_"], result["gather_ops"]
        assert result["gather_rows_equal_all_gather"]


def test_reduce_scatters_on_gloo_are_exchanges_summed_locally(schedule_results):
    """gloo runs a reduce-scatter as an all-reduce (twice the bytes); compshard's compiled
    backward and eager reduce_grad exchange rows with an all-to-all in place (the bits of
    gloo's all-to-all) and sum them, with
    the same bits at two ranks. The compiled unpack sums the received rows parameter by
    parameter as it unpacks them (and casts): the same bits as eager's sum unpacked."""
    for result in schedule_results:
        assert result["reduce_ops"] == ["exchange_rows_"], result["reduce_ops"]
        assert result["exchange_equals_all_to_all"]
        assert result["exchange_equals_reduce_scatter"]
        assert result["unpack_sums_exchanged_rows"]


def test_inference_graph_gathers_and_frees_every_bucket(schedule_results):
    for result in schedule_results:
        facts = result["inference"]
        assert facts["graphs"] == ["inference"] and facts["matches_eager"]
        assert facts["gathered"] == result["trainable"]  # tied wte/lm_head gathered once
        assert facts["freed"] == result["trainable"]  # nothing is kept for a backward


def test_every_rank_builds_the_same_schedule(schedule_results):
    assert schedule_results[0]["reshard"]["fingerprints"] == schedule_results[1]["reshard"]["fingerprints"]
    assert schedule_results[0]["reshard"]["kinds"] == schedule_results[1]["reshard"]["kinds"]


def test_report_table_lists_the_schedule(schedule_results):
    table = schedule_results[0]["reshard"]["table"]
    for column in (
        "graph",
        "node",
        "kind",
        "bucket / unit",
        "bytes",
        "est ms",
        "in flight",
        "live after",
        "prefetch (gathers ahead)",
        "exposed comm ms",
    ):
        assert column in table
    for kind in ("all_gather", "wait", "free", "reduce_scatter", "pack", "unpack"):
        assert kind in table
    rows = table.split("\n\n")[1].splitlines()[2:]
    assert len(set(rows)) == len(rows)
    frees = [row for row in rows if row.split()[2] == "free"]
    buckets = {b["name"] for b in schedule_results[0]["trace"]["buckets"]}
    for row in frees:  # a free names the bucket(s) it frees and what of them
        label = row.split()[3]
        assert set(label.split("+")) <= buckets, row
        assert "(gather buffer)" in row or "(unpacked params)" in row, row
    assert any("(unpacked params)" in row for row in frees) and any("(gather buffer)" in row for row in frees)


def test_report_buckets_and_trace(schedule_results):
    trace = schedule_results[0]["trace"]
    assert [b["name"] for b in trace["buckets"]] == ["rest.0", "blocks.0", "blocks.1"]
    assert all(set(b["prefetch"]) == {"forward", "backward"} for b in trace["buckets"][1:3])
    for bucket in trace["buckets"]:  # across the uses of at most every gather before it, and the code ahead
        for graph, distance in bucket["prefetch"].items():
            assert 0 <= distance <= trace["gather_index"][graph][bucket["name"]] + 1, (graph, bucket)
    late = schedule_results[0]["late"]
    assert all(d == 0 for b in late["buckets"] for d in b["prefetch"].values()), late["buckets"]
    pids = check_trace(trace["events"], measured=True)  # profile=True adds the profiler's events
    in_flight = [
        e["args"]["bytes"]
        for e in trace["events"]
        if e["pid"] == pids["estimated forward"] and e["name"] == "bytes in flight"
    ]
    assert max(in_flight) > 0  # two ranks: all-gathers in flight
    # prefetch 0: each forward all-gather starts at its wait, so all of it is exposed;
    # prefetching never exposes more
    assert late["comm"]["forward"] > 0 and late["exposed"]["forward"] == pytest.approx(late["comm"]["forward"])
    assert trace["exposed"]["forward"] <= late["exposed"]["forward"] * (1 + 1e-9)


@pytest.mark.parametrize("variant", list(OPTION_VARIANTS))
def test_scheduling_options_keep_parity(schedule_results, variant):
    for result in schedule_results:
        got = result[variant]
        assert got["keys_match"]
        assert got["loss"] <= RTOL, got["loss"]
        worst = max(got["params"], key=got["params"].get)
        assert got["params"][worst] <= RTOL, (worst, got["params"][worst])


def test_auto_memory_budget_keeps_buckets_in_room_freed_by_recompute_within_fsdp2_peak(schedule_results):
    for result in schedule_results:
        auto = result["auto_budget"]
        got = auto["parity"]
        assert got["keys_match"] and got["loss"] <= RTOL, got["loss"]
        assert max(got["params"].values()) <= RTOL
        # it kept block buckets gathered, raised recompute to make their room, and the
        # recompute pass applied the levels it chose
        assert auto["kept"] and all(name.startswith("blocks.") for name in auto["kept"])
        assert auto["levels"] and auto["recompute"] == auto["levels"]
        assert 0 < auto["kept_bytes"] <= auto["freed_bytes"]
        facts = auto["facts"]
        assert not set(auto["kept"]) & set(facts["backward_gathered_buckets"])  # never gathered again
        assert set(auto["kept"]) <= {".".join(p.split(".")[:2]) for p in facts["saved_gathered"]}  # saved instead
        assert "memory budget auto" in facts["table"]
        assert auto["peak"] <= auto["fsdp2_peak"], (auto["peak"], auto["fsdp2_peak"])
    assert schedule_results[0]["auto_budget"]["kept"] == schedule_results[1]["auto_budget"]["kept"]
    # local batches of 5 rows and 3: the ranks agree on each raise (each rank alone chose
    # differently, and check_schedule stopped the compile)
    uneven = [result["auto_budget"]["uneven_kept"] for result in schedule_results]
    assert uneven[0] == uneven[1] and uneven[0], uneven


def test_auto_budget_keeps_a_bucket_only_in_the_room_freed_before_it():
    from compshard.compile_plan import Level
    from compshard.passes.keep_gathered import _Candidate, _choose
    from compshard.passes.recompute_model import BlockRaise

    candidates = [_Candidate(f"blocks.{i}", 10, f"blocks.{i}", 1.0) for i in range(3)]
    raises = {f"blocks.{i}": BlockRaise(Level.SELECTIVE, 6, 0.5) for i in range(3)}
    choice = _choose(candidates, raises, chosen=True)
    # room 6 < 10; then 12: keep blocks.1 (2 left); then 8 < 10
    assert choice.kept == ("blocks.1",)
    assert choice.seconds_saved == pytest.approx(1.0 - 1.5)
    assert _choose(candidates, raises, chosen=False).seconds_saved == pytest.approx(1.0)
    # a bucket already held, or at one rank, costs no re-gather: never kept for time
    free = [_Candidate("blocks.0", 1, "blocks.0", 0.0)]
    assert _choose(free, raises, chosen=True).kept == ()


def test_schedule_invariants_hold_under_a_tight_inflight_bound(schedule_results):
    bound = OPTION_VARIANTS["bounded"][1]["max_inflight_mb"] * 2**20
    for result in schedule_results:
        for graph, facts in result["bounded_schedule"].items():
            assert facts["ordered"], graph
            assert facts["early_use"] == [], graph
            for kind, snapshots in facts["inflight"].items():
                for inflight in snapshots:  # at each start: bytes in flight, or one bucket alone
                    assert len(inflight) == 1 or sum(inflight) <= bound, (graph, kind, inflight)
    assert schedule_results[0]["bounded_prefetch"] == schedule_results[1]["bounded_prefetch"]


def test_a_rank_with_a_different_schedule_is_detected(schedule_results):
    for rank, result in enumerate(schedule_results):
        message = result["mismatch"]
        assert message is not None, f"rank {rank} trained on with mismatched schedules"
        assert "backward schedule differs across ranks at collective #0" in message
        assert "rank 0 has ('all_gather'" in message


# ------------------------------------------------------------------ Inductor codegen (world 2)


def codegen_worker(rank: int, world_size: int) -> dict:
    torch._dynamo.reset()
    inductor = parity("mlp", rank, world_size, compile_options={"codegen": "inductor"})
    return {"parity": {k: inductor[k] for k in ("loss", "params", "keys_match")}, "gpt": _step_peaks(rank, world_size)}


@pytest.fixture(scope="module")
def codegen_results():
    return run_distributed(codegen_worker, 2, timeout=600)  # Inductor's C++ compile is slow on CPU


def test_inductor_codegen_matches_eager(codegen_results):
    for result in codegen_results:
        got = result["parity"]
        assert got["keys_match"]
        assert got["loss"] <= RTOL
        assert max(got["params"].values()) <= RTOL, got["params"]


def test_inductor_codegen_peak_is_within_15_percent_of_fx(codegen_results):
    """Inductor compiles the compute between scheduled nodes, so the schedule's memory
    (gathers, frees, reduce-scatters where the passes put them) survives it, up to
    Inductor's own planning inside a region (handed whole graphs it peaked a third
    higher); and it computes the same loss. Where the prefetch pass starts the backward's
    second gather depends on the link constants calibrated at ``shard`` (measured, so
    they vary from run to run): started early, with a 24-op region computing while it is
    in flight, this GPT peaked 12.1% above the fx codegen (463,112 bytes against
    413,064); started 5 ops later, 0.2 to 3.4% above it."""
    for result in codegen_results:
        fx, inductor = result["gpt"]["fx"], result["gpt"]["inductor"]
        assert relative_error(inductor["loss"], fx["loss"]) <= RTOL, (inductor["loss"], fx["loss"])
        assert inductor["peak"] <= 1.15 * fx["peak"], (inductor["peak"], fx["peak"])
