"""Training features against eager truth: mixed precision (against eager FSDP2 with the same
policy), gradient accumulation under ``no_sync``, the sharding strategies, offload, and
the errors for bad option values.

One spawn per world size (2, and 4 for hybrid sharding); the tests read its results.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import compshard
from compshard.compile_plan import node_meta
from compshard.passes.fx_utils import op_arg
from compshard.sharding.grad_sync import grad_sync_state
from tests.distributed import run_distributed
from tests.models import MLP, make_model
from tests.training import ADAMW, RTOL, local_batch, parity, relative_error, train_reference

BF16 = torch.bfloat16
MP_STEPS = 3
# bf16 has 8 mantissa bits (relative rounding 2**-9): after a few AdamW steps losses and
# parameters of two bf16-compute runs that round in different places agree to about this.
BF16_RTOL = 2e-2
PARITY_KEYS = ("loss", "params", "keys_match")


def _global_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """Norm-wise relative error over all parameters together."""
    return relative_error(
        torch.cat([actual[k].flatten().double() for k in expected]),
        torch.cat([v.flatten().double() for v in expected.values()]),
    )


class CollectiveCounter(TorchDispatchMode):
    """Counts eagerly run collectives (and ``compshard::reduce_grad`` calls) by op name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if (name.startswith("_c10d_functional::") and "wait" not in name) or name == "compshard::reduce_grad":
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    def reductions(self) -> int:
        return sum(n for name, n in self.counts.items() if "reduce" in name)


# ------------------------------------------------------------------------ mixed precision


def _train_mp(step_model, params, batch, rank: int, world_size: int):
    """Losses (global mean), the output dtype, and the optimizer after ``MP_STEPS`` steps."""
    opt = torch.optim.AdamW(params, **ADAMW)
    losses, output_dtype = [], None
    for _ in range(MP_STEPS):
        loss = step_model(*local_batch(batch, rank, world_size))
        output_dtype = loss.dtype
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().double()
        dist.all_reduce(mean)
        losses.append(mean.item() / world_size)
    return losses, output_dtype, opt


MP_CASES = {  # name: (model, compiled, output_dtype, buffer_dtype)
    "mlp-compiled": ("mlp", True, None, None),
    "mlp-eager": ("mlp", False, None, None),
    "gpt-compiled": ("gpt", True, None, None),
    "mlp-output-fp32": ("mlp", True, torch.float32, None),
    "buffer-bf16": ("mlp-buffer", True, None, BF16),
}


class MLPWithBuffer(MLP):
    """The MLP with a floating-point buffer added to its input (FSDP2 takes no 0-d
    parameters, so the test model with a buffer, ``uneven``, cannot be its reference)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.linspace(-1, 1, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return super().forward(x + self.shift, y)


def _mp_model(name: str):
    if name != "mlp-buffer":
        return make_model(name)
    _, batch = make_model("mlp")
    torch.manual_seed(0)
    return MLPWithBuffer(), batch


def _mixed_precision(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    results, fsdp_runs = {}, {}
    for case, (name, compiled, output_dtype, buffer_dtype) in MP_CASES.items():
        reference, batch = _mp_model(name)
        if buffer_dtype is not None:  # FSDP2 has no buffer option: the buffers are cast by hand
            for module in reference.modules():
                for key, buffer in module._buffers.items():
                    module._buffers[key] = buffer.to(buffer_dtype) if torch.is_floating_point(buffer) else buffer
        key = (name, output_dtype)
        if key not in fsdp_runs:
            fsdp = fully_shard(
                copy.deepcopy(reference),
                mp_policy=MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=output_dtype),
            )
            losses, dtype, _ = _train_mp(fsdp, list(fsdp.parameters()), batch, rank, world_size)
            fsdp_runs[key] = losses, dtype, {k: p.full_tensor() for k, p in fsdp.named_parameters()}
        torch._dynamo.reset()
        model, batch = _mp_model(name)
        compshard.shard(
            model, param_dtype=BF16, reduce_dtype=torch.float32, output_dtype=output_dtype, buffer_dtype=buffer_dtype
        )
        step_model = torch.compile(model, backend="compshard") if compiled else model
        losses, dtype, opt = _train_mp(step_model, list(model.parameters()), batch, rank, world_size)
        expected_losses, expected_dtype, expected = fsdp_runs[key]
        full = compshard.full_state_dict(model)
        results[case] = {
            "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
            "params": _global_error(full, expected),
            "output_dtype": (dtype, expected_dtype),
            "master_dtypes": sorted(
                {str(t.dtype) for p in model.parameters() for t in (p, *opt.state[p].values()) if t.dim() > 0}
            ),
            "buffer_dtypes": sorted(str(b.dtype) for b in model.buffers() if torch.is_floating_point(b)),
        }
    torch._dynamo.reset()
    model, batch = make_model("mlp")
    compshard.shard(model, param_dtype=BF16, reduce_dtype=torch.float32)
    report = compshard.inspect(model, *local_batch(batch, rank, world_size))
    results["collective_dtypes"] = sorted(
        {
            (node_meta(node).kind, str(node.meta["val"].dtype))
            for gm in report.graphs.values()
            for node in gm.graph.nodes
            if node_meta(node).kind in ("all_gather", "reduce_scatter")
        }
    )
    return results


# --------------------------------------------------------------------- gradient accumulation

MICRO_BATCHES = 4
ACCUMULATION_STEPS = 2


def _reductions_compiled(graphs: list) -> int:
    """Gradient reductions (reduce-scatter and all-reduce starts) in compiled graphs."""
    return sum(
        1 for g in graphs for node in g.gm.graph.nodes if node_meta(node).kind in ("reduce_scatter", "all_reduce")
    )


def _accumulate(name: str, rank: int, world_size: int, compiled: bool) -> dict:
    """``ACCUMULATION_STEPS`` optimizer steps, each over ``MICRO_BATCHES`` micro-batches of
    this rank's slice (all but the last under ``no_sync``), against the unsharded model
    trained on the whole batch at once. Collectives are counted by a dispatch mode when
    eager, and read from the graphs compiled in each phase when compiled (Dynamo does not
    compile under a dispatch mode)."""
    reference, batch = make_model(name)
    model = compshard.shard(copy.deepcopy(reference))
    expected_losses = train_reference(reference, batch, steps=ACCUMULATION_STEPS)
    dynamo_graphs = []

    def counting_backend(gm, example_inputs):
        dynamo_graphs.append(gm)
        return compshard.compshard_backend(gm, example_inputs)

    step_model = torch.compile(model, backend=counting_backend) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    local = local_batch(batch, rank, world_size)
    micro = [tuple(t.chunk(MICRO_BATCHES)[i] for t in local) for i in range(MICRO_BATCHES)]
    losses, grads_during_no_sync = [], []
    phases = {"unsynced": (CollectiveCounter(), []), "synced": (CollectiveCounter(), [])}

    def run(phase: str, inputs) -> torch.Tensor:
        counter, graphs = phases[phase]
        with compshard.backend.record_compiles() as compiled_now:
            with counter if not compiled else contextlib.nullcontext():
                part = step_model(*inputs) / MICRO_BATCHES
                part.backward()
        graphs.extend(compiled_now)
        return part.detach()

    for _ in range(ACCUMULATION_STEPS):
        with compshard.no_sync(model):
            loss = sum(run("unsynced", inputs) for inputs in micro[:-1])
        grads_during_no_sync.append(any(p.grad is not None for p in model.parameters()))
        loss += run("synced", micro[-1])
        opt.step()
        opt.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item() / world_size)
    full = compshard.full_state_dict(model)
    reductions = {
        phase: _reductions_compiled(graphs) if compiled else counter.reductions()
        for phase, (counter, graphs) in phases.items()
    }
    return {
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
        "params": {key: relative_error(full[key], value) for key, value in reference.state_dict().items()},
        "keys_match": list(full) == list(reference.state_dict()),
        "unsynced_reductions": reductions["unsynced"],
        "synced_reductions": reductions["synced"],
        "grads_during_no_sync": grads_during_no_sync,
        "pending_after_sync": [k for k, s in grad_sync_state(model).sinks.items() if s.grad is not None],
        "graphs_compiled": len(dynamo_graphs),
        "graph_kinds": sorted(g.kind for graphs in (phases["unsynced"][1], phases["synced"][1]) for g in graphs),
    }


# ------------------------------------------------------------------------------ strategies


def _schedule(model, batch, rank: int, world_size: int) -> dict:
    """The (graph, collective kind) pairs compiled, and (kind, size of its process group);
    one collective per bucket (no coalescing), so the order of reductions is per bucket."""
    report = compshard.inspect(model, *local_batch(batch, rank, world_size), options={"coalesce": "none"})
    sizes = {
        (node_meta(node).kind, dist.get_world_size(compshard.comm.layout.resolve_group(op_arg(node, "group_name"))))
        for gm in report.graphs.values()
        for node in gm.graph.nodes
        if node_meta(node).kind in ("all_gather", "reduce_scatter", "all_reduce")
    }
    kinds = {(c["graph"], c["kind"]) for c in report.collectives if c["kind"] != "free"}
    reductions: dict = {}  # backward: gradient collective starts and their waits, in graph order
    sequence = []
    for node in report.graphs["backward"].graph.nodes:
        kind = node_meta(node).kind
        if kind in ("reduce_scatter", "all_reduce"):
            reductions[node] = kind
            sequence.append(kind)
        elif kind == "wait" and node.args[0] in reductions:
            sequence.append(f"wait {reductions[node.args[0]]}")
    return {
        "kinds": sorted(kinds),
        "group_sizes": sorted(sizes),
        "header": str(report).splitlines()[0],
        "reductions": sequence,
    }


def _held_fraction(model, batch, rank: int, world_size: int) -> float:
    """Bytes of parameters, gradients and AdamW state this rank holds after a step, over
    the unsharded model's (0-d tensors excluded: replicated by every strategy)."""
    full = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() > 0) * 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.compile(model, backend="compshard")(*local_batch(batch, rank, world_size)).backward()
    opt.step()
    held = 0
    for p in model.parameters():
        for t in (p, p.grad, *opt.state[p].values()):
            if t is not None and t.dim() > 0:
                local = t.to_local() if isinstance(t, DTensor) else t
                held += local.numel() * local.element_size()
    return held / full


# Parity runs per strategy: (model, compiled). full_shard's are in test_distributed.py.
STRATEGY_PARITY = {
    "full_shard": (),
    "shard_grad_op": (("gpt", True), ("uneven", False)),
    "no_shard": (("uneven", True), ("gpt", True), ("uneven", False)),
    "hybrid_shard": (("uneven", True), ("gpt", True), ("uneven", False)),
}


def _case(name: str, compiled: bool) -> str:
    return f"{name}-{'compiled' if compiled else 'eager'}"


def _strategy(strategy: str, rank: int, world_size: int, mesh=None) -> dict:
    kwargs = {"strategy": strategy, **({"mesh": mesh} if mesh is not None else {})}
    results = {}
    for name, compiled in STRATEGY_PARITY[strategy]:
        torch._dynamo.reset()
        result = parity(name, rank, world_size, shard=kwargs, compiled=compiled)
        results[_case(name, compiled)] = {k: v for k, v in result.items() if k in PARITY_KEYS}
    torch._dynamo.reset()
    model, batch = make_model("mlp")
    results["schedule"] = _schedule(compshard.shard(model, **kwargs), batch, rank, world_size)
    torch._dynamo.reset()
    model, batch = make_model("gpt")
    results["held_fraction"] = _held_fraction(compshard.shard(model, **kwargs), batch, rank, world_size)
    results["config"] = compshard.sharding_config(model)
    return results


# ---------------------------------------------------------------------------------- spawns


def world2_worker(rank: int, world_size: int) -> dict:
    results = {"mixed_precision": _mixed_precision(rank, world_size)}
    for name, compiled in (("uneven", True), ("uneven", False), ("gpt", True)):
        torch._dynamo.reset()
        results[f"accumulate-{_case(name, compiled)}"] = _accumulate(name, rank, world_size, compiled)
    for strategy in ("full_shard", "shard_grad_op", "no_shard"):
        results[strategy] = _strategy(strategy, rank, world_size)
    return results


def world4_worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return {"hybrid_shard": _strategy("hybrid_shard", rank, world_size, mesh)}


@pytest.fixture(scope="module")
def world2():
    return run_distributed(world2_worker, 2)


@pytest.fixture(scope="module")
def world4():
    return run_distributed(world4_worker, 4)


# ----------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("case", list(MP_CASES))
def test_mixed_precision_matches_fsdp2_with_the_same_policy(world2, case):
    for rank, result in enumerate(world2):
        got = result["mixed_precision"][case]
        assert got["loss"] <= BF16_RTOL, (rank, got)
        assert got["params"] <= BF16_RTOL, (rank, got)
        assert got["output_dtype"][0] == got["output_dtype"][1], (rank, got)


def test_mixed_precision_keeps_fp32_master_weights_and_casts_as_asked(world2):
    results = world2[0]["mixed_precision"]
    assert results["mlp-compiled"]["output_dtype"][0] == BF16  # outputs stay in the compute dtype
    assert results["mlp-output-fp32"]["output_dtype"][0] == torch.float32
    assert results["mlp-compiled"]["master_dtypes"] == ["torch.float32"]  # shards, grads, AdamW state
    assert results["buffer-bf16"]["buffer_dtypes"] == ["torch.bfloat16"]
    assert results["mlp-compiled"]["buffer_dtypes"] == []
    # gathers move bf16, gradients are reduce-scattered in fp32
    assert results["collective_dtypes"] == [("all_gather", "torch.bfloat16"), ("reduce_scatter", "torch.float32")]


@pytest.mark.parametrize("case", ["accumulate-uneven-compiled", "accumulate-uneven-eager", "accumulate-gpt-compiled"])
def test_no_sync_micro_batches_equal_one_big_batch(world2, case):
    for rank, result in enumerate(world2):
        got = result[case]
        assert got["keys_match"]
        assert got["loss"] <= RTOL, (rank, got["loss"])
        worst = max(got["params"], key=got["params"].get)
        assert got["params"][worst] <= RTOL, (rank, worst, got["params"][worst])


@pytest.mark.parametrize("case", ["accumulate-uneven-compiled", "accumulate-uneven-eager", "accumulate-gpt-compiled"])
def test_no_sync_issues_no_gradient_collective(world2, case):
    for result in world2:
        got = result[case]
        assert got["unsynced_reductions"] == 0
        assert got["synced_reductions"] > 0  # the counter sees reductions when they happen
        assert got["grads_during_no_sync"] == [False] * ACCUMULATION_STEPS  # nothing reaches the shards
        assert got["pending_after_sync"] == []  # the synced micro-batch consumed every accumulated gradient


def test_no_sync_compiles_one_graph_per_mode(world2):
    # accumulate (under no_sync) and fold (the synced micro-batch after it); the second
    # accumulation round reuses both
    for case in ("accumulate-uneven-compiled", "accumulate-gpt-compiled"):
        assert world2[0][case]["graphs_compiled"] == 2
        assert world2[0][case]["graph_kinds"] == ["backward", "backward", "forward", "forward"]


@pytest.mark.parametrize(
    "strategy, case", [(s, _case(*c)) for s in ("shard_grad_op", "no_shard") for c in STRATEGY_PARITY[s]]
)
def test_strategy_matches_single_process_eager(world2, strategy, case):
    _check_parity([result[strategy][case] for result in world2])


@pytest.mark.parametrize("case", [_case(*c) for c in STRATEGY_PARITY["hybrid_shard"]])
def test_hybrid_shard_matches_single_process_eager(world4, case):
    _check_parity([result["hybrid_shard"][case] for result in world4])


def _check_parity(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert got["keys_match"]
        assert got["loss"] <= RTOL, (rank, got["loss"])
        worst = max(got["params"], key=got["params"].get)
        assert got["params"][worst] <= RTOL, (rank, worst, got["params"][worst])


def test_strategy_schedules(world2, world4):
    schedules = {s: world2[0][s]["schedule"] for s in ("full_shard", "shard_grad_op", "no_shard")}
    schedules["hybrid_shard"] = world4[0]["hybrid_shard"]["schedule"]
    assert schedules["full_shard"]["kinds"] == [
        ("backward", "all_gather"),
        ("backward", "reduce_scatter"),
        ("forward", "all_gather"),
    ]
    assert schedules["shard_grad_op"]["kinds"] == [("backward", "reduce_scatter"), ("forward", "all_gather")]
    assert schedules["no_shard"]["kinds"] == [("backward", "all_reduce")]
    assert schedules["hybrid_shard"]["kinds"] == [
        ("backward", "all_gather"),
        ("backward", "all_reduce"),
        ("backward", "reduce_scatter"),
        ("forward", "all_gather"),
    ]
    # hybrid: gathers and reduce-scatters within a shard group of 2, all-reduces across 2 replicas
    assert schedules["hybrid_shard"]["group_sizes"] == [("all_gather", 2), ("all_reduce", 2), ("reduce_scatter", 2)]
    assert schedules["no_shard"]["group_sizes"] == [("all_reduce", 2)]
    assert schedules["hybrid_shard"]["header"].startswith("sharding: hybrid_shard, shard 2 x replicate 2")


def test_gradient_reductions_overlap_backward(world2, world4):
    """The test MLP has four buckets. Reduce-scatters (all-reduces without sharding) are
    all started before the first is waited; hybrid waits each reduce-scatter and starts
    its all-reduce across replicas before the next bucket's reduce-scatter."""
    assert world2[0]["full_shard"]["schedule"]["reductions"] == ["reduce_scatter"] * 4 + ["wait reduce_scatter"] * 4
    assert world2[0]["no_shard"]["schedule"]["reductions"] == ["all_reduce"] * 4 + ["wait all_reduce"] * 4
    hybrid = world4[0]["hybrid_shard"]["schedule"]["reductions"]
    assert [kind for kind in hybrid if not kind.startswith("wait")] == ["reduce_scatter", "all_reduce"] * 4
    assert hybrid[:3] == ["reduce_scatter", "wait reduce_scatter", "all_reduce"]


def test_strategy_memory_at_rest(world2, world4):
    for result in world2:
        assert result["full_shard"]["held_fraction"] <= 0.5 + 0.01
        assert result["shard_grad_op"]["held_fraction"] <= 0.5 + 0.01
        assert result["no_shard"]["held_fraction"] == 1.0
    for result in world4:
        assert 0.5 - 0.01 <= result["hybrid_shard"]["held_fraction"] <= 0.5 + 0.01  # 1 / shard size, not 1/4
    config = world4[0]["hybrid_shard"]["config"]
    assert (config.strategy, config.shard_size, config.replicate_size) == ("hybrid_shard", 2, 2)
    assert world2[0]["shard_grad_op"]["config"].reshard_after_forward is False


# ----------------------------------------------------------------------- single process


def test_offload_on_a_cpu_run_has_nothing_to_offload():
    model, batch = make_model("mlp")
    with pytest.warns(UserWarning, match="offload=True has nothing to offload on a CPU-only run"):
        compshard.shard(model, offload=True)
    assert compshard.sharding_config(model).offload == "nothing_to_offload"
    model(*batch).backward()  # trains as without the option
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="offload moves CUDA parameters to pinned CPU memory")
def test_offload_keeps_shards_gradients_and_optimizer_state_in_pinned_cpu_memory():
    torch.manual_seed(0)
    reference, batch = make_model("mlp")
    reference.cuda()
    batch = tuple(t.cuda() for t in batch)
    model = compshard.shard(copy.deepcopy(reference), offload=True)
    assert compshard.sharding_config(model).offload == "pinned_cpu"
    expected = train_reference(reference, batch, steps=3)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    step_model = torch.compile(model, backend="compshard")
    losses = []
    for _ in range(3):
        loss = step_model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    for p in model.parameters():
        assert p.device.type == "cpu" and p.is_pinned()
        assert p.grad.device.type == "cpu"
        assert all(t.device.type == "cpu" for t in opt.state[p].values())
    assert max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected)) <= RTOL


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"strategy": "zero3"},
            ValueError,
            "strategy='zero3' is not allowed; use one of ['full_shard', 'shard_grad_op', 'no_shard', 'hybrid_shard', "
            "'shard_optimizer']",
        ),
        ({"strategy": "hybrid_shard"}, ValueError, "strategy='hybrid_shard' needs mesh=<2-D DeviceMesh>"),
        (
            {"strategy": "shard_grad_op", "reshard_after_forward": True},
            ValueError,
            "reshard_after_forward=True contradicts it",
        ),
        ({"output_dtype": torch.int8}, ValueError, "output_dtype=torch.int8 is not allowed; use None or one of"),
        ({"buffer_dtype": "half"}, ValueError, "buffer_dtype='half' is not allowed"),
        ({"cast_forward_inputs": None}, TypeError, "cast_forward_inputs must be True or False"),
        ({"offload": "cpu"}, TypeError, "offload must be True or False, got 'cpu'"),
    ],
)
def test_bad_training_options_name_the_option_and_what_is_allowed(kwargs, error, message):
    model, _ = make_model("mlp")
    with pytest.raises(error) as raised:
        compshard.shard(model, **kwargs)
    assert message in str(raised.value)


def test_gradient_sync_errors():
    model, _ = make_model("mlp")
    with pytest.raises(ValueError, match="is not one"):
        with compshard.no_sync(model):
            pass
    compshard.shard(model)
    with pytest.raises(ValueError, match="the module passed to compshard.shard; Sharded"):
        compshard.set_requires_gradient_sync(model.layers[0], False)
    with pytest.raises(TypeError, match="requires_gradient_sync must be True or False, got 0"):
        compshard.set_requires_gradient_sync(model, 0)


def test_no_sync_at_world_size_one_accumulates():
    reference, batch = make_model("mlp")
    model = compshard.shard(copy.deepcopy(reference))
    halves = [tuple(t.chunk(2)[i] for t in batch) for i in range(2)]
    with compshard.no_sync(model):
        (model(*halves[0]) / 2).backward()
    (model(*halves[1]) / 2).backward()
    reference(*batch).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert relative_error(p.grad, q.grad) <= RTOL, name


def test_docs_training_features_example_runs(capsys):
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "compshard.no_sync" in b]
    torch._dynamo.reset()
    exec(compile(block, "docs/training.md", "exec"), {})
    assert "ShardingConfig(strategy='full_shard'" in capsys.readouterr().out
