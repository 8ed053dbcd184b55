"""compshard.forecast: predicted memory against a measured run, and what a forecast holds."""

from __future__ import annotations

import gc
import inspect
import math
import pathlib
import subprocess
import sys
from dataclasses import fields, replace

import pytest
import torch
import torch.distributed as dist

import compshard
from compshard.compile_plan import COLLECTIVE_KINDS, node_meta
from compshard.cost_model import Costs
from compshard.models import GPT, GPTConfig
from compshard.options import CompileOptions
from compshard.predict import hardware
from compshard.predict.forecast_report import ShardKeywords
from compshard.predict.hardware import Measured
from tests.distributed import run_distributed
from tests.test_tensor_parallel import gpt_plan

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from harness import peak_tensor_bytes, state_bytes  # noqa: E402  (the benchmarks' measurement)

MEASURED_GPT = GPTConfig(vocab_size=512, block_size=128, n_layer=2, n_head=4, n_embd=128)
GLOBAL_BATCH = 8


def _local_batch(cfg: GPTConfig, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, cfg.vocab_size, (GLOBAL_BATCH, cfg.block_size + 1), generator=torch.Generator().manual_seed(1)
    )
    return tokens[:, :-1].chunk(world_size)[rank], tokens[:, 1:].chunk(world_size)[rank]


def _meta_gpt(cfg: GPTConfig) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def _measure_peak(rank: int, world_size: int):
    """One compiled step's peak tensor bytes (as the benchmarks measure it) and the cost
    model's constants this process group was calibrated to."""
    torch.manual_seed(0)
    model = compshard.shard(GPT(MEASURED_GPT))
    x, y = _local_batch(MEASURED_GPT, rank, world_size)
    opt = torch.optim.AdamW(model.parameters())
    step_model = torch.compile(model, backend="compshard")
    step_model(x, y).backward()  # compiles
    opt.step()  # creates the optimizer state held from now on
    opt.zero_grad(set_to_none=True)
    peak = peak_tensor_bytes(lambda: step_model(x, y).backward(), torch.device("cpu"), state_bytes(model, opt))
    return peak, compshard.cost_model.costs_for(dist.group.WORLD.group_name)


def test_predicted_peak_memory_is_within_10_percent_of_a_measured_run_at_world_size_2():
    measured = run_distributed(_measure_peak, 2)
    measured_peak = max(peak for peak, _ in measured)
    report = compshard.forecast(
        _meta_gpt(MEASURED_GPT),
        *_local_batch(MEASURED_GPT, 0, 2),
        world_size=2,
        hardware=Measured(measured[0][1], "gloo"),
    )
    assert abs(report.memory.peak - measured_peak) <= 0.10 * measured_peak, (report.memory, measured_peak)


class _DetachedOutput(torch.nn.Module):
    """A model whose output does not require grad: forecasting it fails (a step needs a loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x).detach()


def _forecast_measured_on_every_rank(rank: int, world_size: int):
    """What each rank's compshard.forecast(..., hardware="measured") returned or raised."""
    report = compshard.forecast(
        _meta_gpt(FOUR_BLOCKS), *_local_batch(FOUR_BLOCKS, rank, world_size), world_size=world_size, hardware="measured"
    )
    try:
        compshard.forecast(
            _DetachedOutput(), torch.ones(2, 4), world_size=world_size, hardware="measured", tokens_per_rank=2
        )
        error = None
    except ValueError as raised:
        error = str(raised)
    return report.step.total, report.memory.peak, report.hardware, error


def test_measured_forecast_is_made_on_rank_0_and_every_rank_returns_it_or_its_error():
    """Under a process group, ``hardware="measured"`` times the machine on every rank, then
    rank 0 forecasts while the others wait: every rank returns rank 0's figures (timings taken
    by one process differ from run to run, so equal figures mean one forecast), and an error
    in rank 0's forecasting is raised on every rank rather than leaving them waiting."""
    results = run_distributed(_forecast_measured_on_every_rank, 2, timeout=240)
    assert results[0][:3] == results[1][:3], results
    assert results[0][2] == "measured"
    for *_, error in results:
        assert error is not None and "does not require grad" in error, results


_FORECAST_UNDER_A_PROCESS_GROUP = """
import torch
import torch.distributed as dist

import compshard
from compshard.models import GPT, GPTConfig

if __name__ == "__main__":
    dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (2, 16))
    compshard.forecast(model, tokens, tokens, world_size=1, hardware="measured")
    dist.destroy_process_group()
"""


def test_forecasting_in_a_subprocess_leaves_no_semaphore_behind(tmp_path):
    """Under a process group the forecast is made in a spawned worker. Killed once it had
    answered, the worker left the semaphore of tqdm's lock (torch.fx's Interpreter
    creates it while AOTAutograd traces) to the resource tracker, which warned of a
    leaked semaphore when the script exited (seen with ``hardware="measured"``)."""
    script = tmp_path / "forecast_under_a_process_group.py"
    script.write_text(_FORECAST_UNDER_A_PROCESS_GROUP.format(store=tmp_path / "store"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "leaked semaphore" not in done.stderr, done.stderr[-3000:]


# Two tokens and wide blocks: the parameters outweigh the activations, so the backward's
# peak falls while a block's all-gather is in flight.
GATHER_BOUND_GPT = GPTConfig(vocab_size=256, block_size=2, n_layer=2, n_head=4, n_embd=256)


def test_forecast_counts_the_scratch_gloo_holds_for_collectives_in_flight():
    """The in-place all-to-all of a reduce-scatter on gloo holds every rank's rows of its
    buffer until the unpack, where NCCL's reduce-scatter output is one row; gloo also
    receives into a temporary of the buffer's size until the wait
    (``memory_model.backend_scratch_bytes``). The forecast's breakdown was read after its
    fake process groups were gone, and then counted none of that (the width-384 GPT at 4
    ranks: 11 MiB, 10.6%, under its measured peak). The forecast builds each backend's
    collectives: on gloo a reduce-scatter is an all-to-all and a
    local sum and an all-gather sends and receives of the rows, on NCCL they are NCCL's
    own."""
    model = _meta_gpt(GATHER_BOUND_GPT)
    x, y = _local_batch(GATHER_BOUND_GPT, 0, 4)

    def forecast_for(backend: str):
        return compshard.forecast(model, x, y, world_size=4, hardware=Measured(Costs(), backend))

    through_gloo, on_nccl = forecast_for("gloo"), forecast_for("nccl")
    buffers = [report.memory.collective_buffers for report in (through_gloo, on_nccl)]
    assert buffers[0] > buffers[1], buffers
    for report, ops in (
        (through_gloo, {"reduce_scatter": "exchange_rows_", "all_gather": "gather_rows_"}),
        (on_nccl, {"reduce_scatter": "reduce_scatter_tensor", "all_gather": "all_gather_into_tensor_out"}),
    ):
        for kind, op in ops.items():
            assert {c.op for c in report.schedule.collectives if c.kind == kind} == {op}, kind


def test_measured_forecast_scales_each_graphs_op_timings_to_its_run_end_to_end(monkeypatch):
    """Ops timed alone add up to less than their graph run end to end (the small benchmark
    GPT's graphs: 1.1 to 1.6 times); ``"measured"`` runs each scheduled graph on random
    inputs, its collectives (gloo's all-to-all included) through the fake process group,
    and scales the graph's op timings so that they add up to that run."""
    runs = {}

    def recorded(self, gm):
        runs[gm] = Measured.graph_seconds.__wrapped__(self, gm)
        return runs[gm]

    recorded.__wrapped__ = Measured.graph_seconds
    monkeypatch.setattr(Measured, "graph_seconds", recorded)
    model = _meta_gpt(GATHER_BOUND_GPT)
    report = compshard.forecast(
        model, *_local_batch(GATHER_BOUND_GPT, 0, 2), world_size=2, hardware=Measured(Costs(), "gloo")
    )
    assert set(runs) == set(report.schedule.graphs.values())
    ops = ("exchange_rows_", "gather_rows_")
    for kind, gm in report.schedule.graphs.items():
        assert any(op in str(node.target) for node in gm.graph.nodes for op in ops), kind
        assert runs[gm] is not None and runs[gm] > 0, kind
        timed = [
            node
            for node in gm.graph.nodes
            if isinstance(node.target, torch._ops.OpOverload)
            and node_meta(node).kind not in (*COLLECTIVE_KINDS, "wait", "free")
        ]
        assert sum(node_meta(node).seconds for node in timed) == pytest.approx(runs[gm]), kind


def test_a_graph_run_is_scaled_by_the_load_timed_around_it(monkeypatch):
    """Each graph's run is scaled by the matmul rate timed just before and after it, not
    by one reading for the whole forecast: with every rank forecasting at 4 ranks on 2 cores, the
    other forecasting processes compiled, timed or idled on their own, and a reading taken
    once had the small benchmark GPT's 4-rank forecast 37% under its measured step. Here the
    machine reads 10x faster around one graph's runs than at calibration, 10x slower
    around the next: the first run's seconds are multiplied by 10, the second's divided
    by 10. Each run of the graph (it does run) reads as 1 ms, so that no other process's
    burst on a shared core moves the ratio."""
    readings = iter([10.0, 10.0, 0.1, 0.1])
    monkeypatch.setattr(Measured, "_flops_now", lambda self: next(readings) * self.costs.flops_per_second)
    runs = []

    def clock(fn, device):
        runs.append(fn())
        return 1e-3

    monkeypatch.setattr(hardware, "_synchronized_seconds", clock)
    graph = torch.fx.symbolic_trace(lambda x: torch.relu(x @ x) @ x)
    example = torch.randn(96, 96)
    for node in graph.graph.nodes:
        node.meta["val"] = example if node.op == "placeholder" else None
    machine = Measured(Costs(), "gloo")
    fast_load, slow_load = machine.graph_seconds(graph), machine.graph_seconds(graph)
    assert len(runs) == 2 * (hardware.GRAPH_TIMING_RUNS + 1)
    assert all(run.shape == (96, 96) for run in runs)
    assert (fast_load, slow_load) == (pytest.approx(1e-2), pytest.approx(1e-4))


def test_measured_optimizer_steps_the_optimizer_for_the_states_on_the_shards_shapes(monkeypatch):
    """``Measured.optimizer_seconds`` steps ``TIMED_OPTIMIZERS[states]`` (torch's optimizer
    for that many states) over parameters with gradients of the shards' shapes and dtypes,
    then over as many one-element tensors, and returns the difference of the medians. The
    clock here reads a microsecond per stepped element: real timings of a few milliseconds
    swing tenfold when another process takes a core mid-step, as in the suite's parallel
    workers."""
    steps = []

    class Recording(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

        def step(self, closure=None):
            steps.append([(tuple(p.shape), p.dtype, p.grad.shape) for g in self.param_groups for p in g["params"]])

    def clock(fn, device):
        fn()
        return 1e-6 * sum(math.prod(shape) for shape, _, _ in steps[-1])

    monkeypatch.setitem(hardware.TIMED_OPTIMIZERS, 1, Recording)
    monkeypatch.setattr(hardware, "_synchronized_seconds", clock)
    monkeypatch.setattr(Measured, "_flops_now", lambda self: self.costs.flops_per_second)  # no load change
    shards = [((256, 64), torch.float32), ((64,), torch.bfloat16)]
    seconds = Measured(Costs(), "gloo").optimizer_seconds(shards, 1)
    assert seconds == pytest.approx(1e-6 * (256 * 64 + 64 - 2))
    runs = hardware.OPTIMIZER_TIMING_STEPS + 1
    full = [((256, 64), torch.float32, (256, 64)), ((64,), torch.bfloat16, (64,))]
    one_element = [((1,), torch.float32, (1,)), ((1,), torch.bfloat16, (1,))]
    assert steps == [full] * runs + [one_element] * runs


def test_measured_optimizer_is_scaled_by_the_load_around_it_or_left_to_the_estimate(monkeypatch):
    """The optimizer's timing, less the same step over one-element tensors, is scaled by
    the matmul rate timed just before and after it; states it has no optimizer for, and
    shards over the timing limit, are left to the estimate (None)."""
    readings = iter([1.0, 1.0, 10.0, 10.0])
    monkeypatch.setattr(Measured, "_flops_now", lambda self: next(readings) * self.costs.flops_per_second)
    monkeypatch.setattr(
        hardware,
        "_optimizer_step_seconds",
        lambda shards, states, device: 1e-9 * (1 + states) * sum(math.prod(shape) for shape, _ in shards),
    )
    shards = [((256, 256), torch.float32)] * 8
    machine = Measured(Costs(), "gloo")
    at_load, at_tenfold_load = machine.optimizer_seconds(shards, 2), machine.optimizer_seconds(shards, 2)
    assert at_load == pytest.approx(3e-9 * 8 * (256 * 256 - 1))
    assert at_tenfold_load == pytest.approx(10 * at_load)
    assert machine.optimizer_seconds(shards, 3) is None
    monkeypatch.setattr(hardware, "GRAPH_TIMING_BYTES", 2**20)
    assert machine.optimizer_seconds(shards, 2) is None


def test_measured_forecast_prices_the_optimizer_on_rank0s_shards(monkeypatch):
    """With a ``Measured`` machine the forecast's optimizer seconds are its timing of torch's
    optimizer on rank 0's shard shapes (on CPU AdamW's defaults make about 20 passes of a
    parameter's size, where the presets price one fused pass)."""
    timed = []

    def recorded(self, shards, states):
        timed.append((shards, states))
        return 0.25

    monkeypatch.setattr(Measured, "optimizer_seconds", recorded)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32)
    model = _meta_gpt(cfg)
    report = compshard.forecast(
        model, *_local_batch(cfg, 0, 2), world_size=2, hardware=Measured(Costs(), "gloo"), optimizer_states=1
    )
    assert report.step.optimizer == 0.25
    assert timed == [
        ([((math.ceil(p.shape[0] / 2), *p.shape[1:]) if p.dim() else (), p.dtype) for p in model.parameters()], 1)
    ]


def _rank0_shard_bytes(model: torch.nn.Module, shard_size: int) -> int:
    """Bytes of rank 0's rows of every parameter: ceil(rows / N) rows (0-d: the whole)."""
    total = 0
    for param in {id(p): p for p in model.parameters()}.values():
        rows = math.ceil(param.shape[0] / shard_size) if param.dim() else 1
        total += min(rows, param.shape[0] if param.dim() else 1) * math.prod(param.shape[1:]) * param.element_size()
    return total


# One collective per bucket (no collective joins two blocks), so a six-block forecast
# extended from 3 and 4 blocks can be compared with the exact one.
FOUR_BLOCKS = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
SIX_BLOCKS = replace(FOUR_BLOCKS, n_layer=6)
UNJOINED = {"bucket_mb": 0.001}


@pytest.fixture(scope="module")
def forecasts():
    model = _meta_gpt(FOUR_BLOCKS)
    x, y = _local_batch(FOUR_BLOCKS, 0, 8)
    exact = compshard.forecast(
        model,
        x,
        y,
        world_size=16,
        options=UNJOINED,
        depth="exact",
        peak_limit_mb=1024,
        candidates=[({}, {"recompute": "full"})],
    )
    hybrid = compshard.forecast(
        model, x, y, world_size=16, options=UNJOINED, sharding={"strategy": "hybrid_shard"}, depth="exact"
    )
    return model, x, exact, hybrid


def test_forecast_holds_rank0_shards_optimizer_state_and_a_consistent_step(forecasts):
    model, x, full, hybrid = forecasts
    assert full.memory.parameters == _rank0_shard_bytes(model, 16)
    assert hybrid.memory.parameters == _rank0_shard_bytes(model, 8)  # shard groups of one H100 node
    assert (hybrid.shard_size, hybrid.replicate_size) == (8, 2)
    for report in (full, hybrid):
        assert report.memory.optimizer_state == 2 * report.memory.parameters
        step = report.step
        assert step.total == pytest.approx(step.forward + step.backward + step.optimizer + step.outside_graphs)
        assert step.compute + step.exposed_communication == pytest.approx(step.forward + step.backward)
        assert report.tokens_per_second == pytest.approx(16 * x.numel() / step.total)
    kinds = {c.kind for c in hybrid.schedule.collectives}
    assert "all_reduce" in kinds and "all_reduce" not in {c.kind for c in full.schedule.collectives}


def test_forecast_extended_from_three_and_four_blocks_matches_the_exact_plan():
    model = _meta_gpt(SIX_BLOCKS)
    x, y = _local_batch(SIX_BLOCKS, 0, 8)
    exact = compshard.forecast(model, x, y, world_size=16, options=UNJOINED, depth="exact")
    extrapolated = compshard.forecast(model, x, y, world_size=16, options=UNJOINED, depth="extrapolate")
    assert extrapolated.extrapolated == (4, 6, "blocks") and exact.extrapolated is None
    assert extrapolated.memory == exact.memory
    for name in ("forward", "backward", "communication", "exposed_communication", "optimizer"):
        assert getattr(extrapolated.step, name) == pytest.approx(getattr(exact.step, name), rel=0.01), name


def test_forecast_reports_the_sharding_keywords_with_shards_defaults(forecasts):
    """``report.sharding`` holds every keyword ``shard`` was called with: those given,
    and ``shard``'s own defaults for the rest."""
    _, _, full, hybrid = forecasts
    assert (full.sharding.strategy, hybrid.sharding.strategy) == ("full_shard", "hybrid_shard")
    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(compshard.shard).parameters.items()
        if name in {f.name for f in fields(ShardKeywords)}
    }
    assert ShardKeywords().as_kwargs() == defaults


def test_budget_recommends_the_fastest_fitting_candidate(forecasts):
    report = forecasts[2]
    assert [c.options for c in report.candidates] == [CompileOptions.from_dict({**UNJOINED, "recompute": "full"})]
    fitting = [c for c in report.candidates if c.memory.peak <= 2**30]
    assert report.recommended is min(fitting, key=lambda c: c.step.total)
    assert "fastest fitting" in str(report)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "world_size must be an int >= 1"),
        ({"world_size": 8, "hardware": "tpu-v9"}, "hardware='tpu-v9' is not known"),
        ({"world_size": 8, "sharding": {"mesh": None}}, "unknown sharding keyword"),
        ({"world_size": 12, "sharding": {"strategy": "hybrid_shard"}}, "needs shard_group_size dividing"),
        ({"world_size": 8, "options": {"prefetch": -1}}, "option 'prefetch' must be"),
        ({"world_size": 8, "tp": 3, "tp_plan": gpt_plan}, "tp must be an int >= 1 dividing world_size=8"),
        ({"world_size": 8, "tp": 2}, "tp=2 needs tp_plan"),
        ({"world_size": 8, "tp_plan": gpt_plan}, "tp_plan is given but tp=1"),
        (
            {
                "world_size": 8,
                "tp": 2,
                "tp_plan": gpt_plan,
                "shard_group_size": 2,
                "sharding": {"strategy": "hybrid_shard"},
            },
            "'hybrid_shard' with tp > 1 is not forecast yet",
        ),
    ],
)
def test_bad_arguments_name_the_option(kwargs, message):
    x, y = _local_batch(FOUR_BLOCKS, 0, 8)
    with pytest.raises(ValueError, match=message):
        compshard.forecast(_meta_gpt(FOUR_BLOCKS), x, y, **kwargs)


def test_extrapolating_needs_a_stack_of_four_identical_blocks():
    config = replace(FOUR_BLOCKS, n_layer=3)
    x, y = _local_batch(config, 0, 8)
    with pytest.raises(ValueError, match="depth='extrapolate' needs a ModuleList of at least 4 identical blocks"):
        compshard.forecast(_meta_gpt(config), x, y, world_size=8, depth="extrapolate")


def test_forecast_with_tensor_parallelism_splits_the_pieces_and_prices_tp_collectives():
    """dp 4 x tp 2 at 8 ranks: the layers the forecast covers are split over all 8 ranks, the
    rest over the 4 data-parallel ones, and tensor parallelism's collectives are priced at
    the link between the tp ranks and shown with their group (two blocks: one compile)."""
    config = replace(FOUR_BLOCKS, n_layer=2)
    model = _meta_gpt(config)
    x, y = _local_batch(config, 0, 4)  # one data-parallel rank's batch
    report = compshard.forecast(model, x, y, world_size=8, tp=2, tp_plan=gpt_plan, depth="exact")
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (report.tp, report.shard_size, report.replicate_size) == (2, 4, 1)
    assert total / 8 <= report.memory.parameters < total / 4
    assert report.memory.optimizer_state == 2 * report.memory.parameters
    assert report.tokens_per_rank == x.numel() // 2
    rows = [row for row in report.schedule.rows() if row.kind == "tp collective"]
    assert rows and all(row.seconds > 0 for row in rows)
    assert report.step.tensor_parallel == pytest.approx(sum(row.seconds for row in rows))
    assert 0 < report.step.compute < report.step.total - report.step.tensor_parallel
    assert "x tp 2" in str(report) and "tensor-parallel collectives" in str(report)


def test_the_deprecated_names_warn_and_reach_forecast(monkeypatch):
    from compshard.predict import forecasting

    calls = []
    monkeypatch.setattr(forecasting, "forecast", lambda *args, **keywords: calls.append((args, keywords)))
    with pytest.warns(FutureWarning, match="compshard.forecast"):
        compshard.plan("model", "x", world_size=4, memory_budget_gib=2)
    assert calls == [(("model", "x"), {"world_size": 4, "peak_limit_mb": 2048})]
    with pytest.warns(FutureWarning, match="compshard.Forecast"):
        assert compshard.PlanReport is compshard.Forecast


def test_forecast_with_split_experts_prices_their_all_to_alls():
    """transformers' Qwen3-MoE (tiny) at 4 ranks, its experts split over 4 and over 2 (dp 2
    x ep 2): each layer's all-to-alls are priced forward and backward, an expert-parallel
    group of 2 sends a smaller share of the tokens to other ranks (1/2, not 3/4), and the
    parameters at rest are 1/4 of the model's either way."""
    from tests.sharding.test_expert_parallel import EXPERTS, build_qwen3_moe

    model, batch = build_qwen3_moe()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    reports = {
        ep: compshard.forecast(model, *batch, world_size=4, sharding={"experts": EXPERTS, "expert_parallel_size": ep})
        for ep in (4, 2)
    }
    gc.collect()  # the forecast's fake models are gone: its schedule still reads its layers
    for ep, report in reports.items():
        rows = [row for row in report.schedule.rows() if row.kind == "expert all_to_all"]
        assert [row.graph for row in rows] == ["forward"] * 2 + ["backward"] * 2
        assert all(row.seconds > 0 for row in rows)
        assert 0 < report.step.expert_parallel < sum(row.seconds for row in rows)  # the matmuls are compute
        assert f"experts split over {ep}" in str(report) and "expert all-to-alls" in str(report)
        assert report.memory.parameters == pytest.approx(total / 4, rel=0.01)
    assert reports[2].step.expert_parallel < reports[4].step.expert_parallel


def test_forecast_of_shard_optimizer_holds_the_full_parameters_and_prices_their_gathers(forecasts):
    """``strategy="shard_optimizer"``: each rank holds its rows and the full parameters,
    the optimizer state of its rows only; no all-gather in forward or backward, and the
    all-gathers after the update priced in the step (one per block and one for the rest)."""
    model, x, full, _ = forecasts
    report = compshard.forecast(
        model, x, x, world_size=16, options=UNJOINED, sharding={"strategy": "shard_optimizer"}, depth="exact"
    )
    total = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    assert report.memory.parameters == _rank0_shard_bytes(model, 16) + total
    assert report.memory.optimizer_state == full.memory.optimizer_state
    assert report.memory.gathered_parameters == 0
    graphs = {c.graph for c in report.schedule.collectives if c.kind == "all_gather"}
    assert graphs == {"optimizer.step"}
    gathers = [c for c in report.schedule.collectives if c.graph == "optimizer.step"]
    assert len(gathers) == FOUR_BLOCKS.n_layer + 1
    step = report.step
    assert step.step_gather > 0 and "all-gathers after it" in str(report)
    assert step.total == pytest.approx(
        step.forward + step.backward + step.optimizer + step.step_gather + step.outside_graphs
    )
