"""Pipeline parallelism: the stage split (in process) and training with
``compshard.pipeline`` (stages compiled with the compshard backend, and eager) against
single-process eager training (gloo: 2 stages on 2 processes, 2 stages x 2 data-parallel
shards on 4, the shards gathered per step and per micro-batch), with the number of
all-gathers and gradient reduce-scatters per step. One spawn per world size.
"""

from __future__ import annotations

import contextlib
import copy
import io
import pathlib
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import compshard
from compshard.backend import record_compiles
from compshard.models import GPT, GPTConfig
from compshard.options import CompileOptions
from compshard.pipelining.runner import bubble_fraction, compiles_stage
from compshard.pipelining.stages import build_stage_module, split_stages
from compshard.sharding import gathered_for_step, reduce_accumulated_gradients
from compshard.sharding.grad_sync import grad_sync_state
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import ADAMW, RTOL, STEPS, local_batch, relative_error, train_reference

PIPELINE_DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "pipeline.md"
# Eight blocks: enough ops between blocks for four stages to balance; small enough to export fast.
BALANCE_GPT = GPTConfig(vocab_size=256, block_size=32, n_layer=8, n_head=4, n_embd=64)


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


# ----------------------------------------------------------------------------- in process


@pytest.fixture(scope="module")
def balance_gpt():
    torch.manual_seed(0)
    model = GPT(BALANCE_GPT)
    tokens = torch.randint(0, BALANCE_GPT.vocab_size, (2, BALANCE_GPT.block_size))
    return model, tokens


@pytest.mark.parametrize("stages", [2, 4])
def test_gpt_split_is_balanced_and_runs_as_the_model(balance_gpt, stages):
    model, tokens = balance_gpt
    split = split_stages(model, (tokens,), stages)
    costs = [stage.cost_seconds for stage in split.stages]
    assert max(costs) <= 1.1 * min(costs), f"stage costs {costs}"

    modules = [build_stage_module(split, k) for k in range(stages)]
    names = [name for module in modules for name, _ in module.named_parameters()]
    assert sorted(names) == sorted([name for name, _ in model.named_parameters()] + ["wte.weight"] * (stages > 1))
    assert split.tied == {"wte.weight": [0, stages - 1]}
    assert all(set(m.state_dict()) <= set(model.state_dict()) for m in modules)
    for module in modules:  # the model's own tensors, not copies
        assert all(p is model.get_parameter(name) for name, p in module.named_parameters())

    sent = (tokens,)
    for module in modules:
        sent = module(*sent)
        sent = sent if isinstance(sent, tuple) else (sent,)
    torch.testing.assert_close(sent[0], model(tokens), rtol=0, atol=0)

    table = str(split)
    assert all(re.search(rf"^{k}\s", table, re.M) for k in range(stages)), table
    assert "blocks.0" in table and "lm_head" in table and "tied: wte.weight" in table


class _Transposing(nn.Module):
    """Two linears with transposed (strided) values between them; the gradient of what
    ``contiguous()`` reads comes back transposed, so strided."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        swapped = (self.a(x).t() * 2).contiguous()
        return self.b(swapped)


def test_stages_send_and_receive_only_contiguous_tensors():
    # the most stages the model allows: only contiguous activations cross a cut, and each
    # stage's gradient for what it received (transposed inside it) comes back contiguous
    model, x = _Transposing(), torch.randn(4, 8)
    most = split_stages(model, (x,), 2).max_stages
    split = split_stages(model, (x,), most)
    crossing = [node.meta["val"] for stage in split.stages[1:] for node in stage.inputs]
    assert crossing and all(value.is_contiguous() for value in crossing)
    inputs, received, sent = (x,), [], []  # received[k]: what stage k + 1 received
    for k in range(most):
        if k:
            inputs = tuple(value.detach().requires_grad_() for value in sent[-1])
            received.append(inputs)
        output = build_stage_module(split, k)(*inputs)
        sent.append(output if isinstance(output, tuple) else (output,))
    torch.testing.assert_close(sent[-1][0], model(x), rtol=0, atol=0)
    # each stage's gradients for what it received, as torch's stages take them (not
    # through .grad, which autograd lays out as the tensor)
    grads = torch.autograd.grad(sent[-1][0].sum(), received[-1])
    found = list(grads)
    for k in range(most - 2, 0, -1):
        grads = torch.autograd.grad(sent[k], received[k - 1], grads)
        found += grads
    assert found and all(grad.is_contiguous() for grad in found)


def test_too_many_stages_names_the_maximum():
    model, (tokens, _) = make_model("gpt")
    most = split_stages(model, (tokens,), 2).max_stages
    assert len(split_stages(model, (tokens,), most).stages) == most
    with pytest.raises(ValueError, match=rf"stages={most + 1} .* at most {most}\b"):
        split_stages(model, (tokens,), most + 1)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"schedule": "zero-bubble"}, r"schedule='zero-bubble' is not allowed; use one of \['gpipe', '1f1b'\]"),
        ({"stages": 0}, r"stages must be an int >= 1, got 0"),
        ({"microbatches": 2.5}, r"microbatches must be an int >= 1, got 2.5"),
        ({"stages": 4, "microbatches": 2}, r"schedule='1f1b' needs microbatches >= stages"),
        ({"microbatches": 3}, r"microbatches=3 must divide the batch"),
        ({"reshard": "per_layer"}, r"reshard='per_layer' is not allowed; use one of \['per_step', 'per_microbatch'\]"),
    ],
)
def test_bad_options_name_the_option_and_what_is_allowed(options, message):
    model, (x, _) = make_model("gpt")
    kwargs = {"stages": 2, "microbatches": 4, "example_inputs": x, **options}
    with pytest.raises(ValueError, match=message):
        compshard.pipeline(model, gpt_loss, **kwargs)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"compile": "yes"}, TypeError, r"compile must be True or False, got 'yes'"),
        ({"compile_options": [("prefetch", 0)]}, TypeError, r"compile_options must be a dict of backend options"),
        ({"compile": False, "compile_options": {"prefetch": 0}}, ValueError, r"they need compile=True"),
        ({"compile_options": {"prefetch": -1}}, ValueError, r"option 'prefetch' must be 'auto' or an int >= 0"),
        ({"compile_options": {"prefech": 0}}, ValueError, r"unknown option\(s\) \['prefech'\]"),
    ],
)
def test_bad_compile_options_name_the_option(options, error, message):
    model, (x, _) = make_model("gpt")
    with pytest.raises(error, match=message):
        compshard.pipeline(model, gpt_loss, stages=2, microbatches=4, example_inputs=x, **options)


def test_bubble_fraction():
    assert bubble_fraction(1, 4) == 0
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)


# ------------------------------------------------------------------------------ distributed


# Micro-batches sum gradients in another order than the single-process reference; the
# entries whose true gradient is zero (the key part of the qkv bias) then hold only rounding
# noise, which Adam with eps 1e-6 turns into full-size steps (1.24e-5 relative error seen at
# world size 4 in a fresh virtualenv). eps 1e-4 keeps Adam's steps proportional to such noise.
PIPELINE_ADAMW = {**ADAMW, "eps": 1e-4}


# The collectives a step issues, at the functional-collective level: uncompiled compshard
# ops, a compiled graph's lowered collectives and the step's gathering all go through them.
# On gloo a reduce-scatter is an all-to-all and a local sum (transport.Transport.reduce_scatters_by_exchange):
# compshard::exchange_rows_ in place, or (eager, without shared memory) the sends and receives
# of transport.exchanged_rows (its profiler range); an all-gather is compshard::gather_rows_
# (transport.Transport.all_gathers_by_send_recv). Nothing else in a step exchanges or gathers rows.
COLLECTIVES = {
    "all_gathers": (
        "_c10d_functional::all_gather_into_tensor",
        "_c10d_functional::all_gather_into_tensor_out",
        "_c10d_functional::all_gather_into_tensor_coalesced",
        "compshard::gather_rows_",
    ),
    "reduce_scatters": (
        "_c10d_functional::reduce_scatter_tensor",
        "_c10d_functional::reduce_scatter_tensor_coalesced",
        "compshard::exchange_rows_",
        "compshard::exchanged_rows",
    ),
}


def _count_collectives(step: Callable[[], object]) -> dict[str, int]:
    """How many all-gathers and reduce-scatters ``step()`` issues on this rank."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return {kind: sum(event.name in names for event in profile.events()) for kind, names in COLLECTIVES.items()}


def _train(
    rank: int,
    world_size: int,
    stages: int,
    microbatches: int,
    schedule: str,
    pp_mesh: bool,
    compile: bool,
    reshard: str,
) -> dict:
    """Train the test GPT with ``compshard.pipeline`` and report errors against eager
    (``pp_mesh``: pass a 1-D ``("pp",)`` mesh instead of letting it build one), the graphs
    compiled and the collectives of the last step."""
    reference, batch = make_model("gpt")
    model = copy.deepcopy(reference)
    expected_losses = train_reference(
        reference, batch, optimizer=torch.optim.AdamW(reference.parameters(), **PIPELINE_ADAMW)
    )
    replicas = world_size // stages
    x, y = local_batch(batch, rank % replicas, replicas)  # ranks are laid out (pp, dp), dp inner
    mesh = init_device_mesh("cpu", (stages,), mesh_dim_names=("pp",)) if pp_mesh else None
    pipe = compshard.pipeline(
        model,
        gpt_loss,
        stages=stages,
        microbatches=microbatches,
        schedule=schedule,
        example_inputs=x,
        mesh=mesh,
        compile=compile,
        reshard=reshard,
    )
    opt = torch.optim.AdamW(pipe.module.parameters(), **PIPELINE_ADAMW)
    losses = []
    captured_before = counters["stats"]["unique_graphs"]
    with record_compiles() as compiled:
        for _ in range(STEPS - 1):
            losses.append(pipe.step(x, y).item())
            opt.step()
            opt.zero_grad()
    collectives = _count_collectives(lambda: losses.append(pipe.step(x, y).item()))
    captured = counters["stats"]["unique_graphs"] - captured_before
    opt.step()
    opt.zero_grad()
    full = compshard.full_state_dict(pipe.module)
    expected = reference.state_dict()
    report = pipe.describe()
    return {
        "stage": pipe.stage_index,
        "loss": max(relative_error(torch.tensor(a), torch.tensor(b)) for a, b in zip(losses, expected_losses)),
        "params": {name: relative_error(value, expected[name]) for name, value in full.items()},
        "names": [name for name, _ in pipe.module.named_parameters()],
        "graphs": sorted(graph.kind for graph in compiled),
        "captured": captured,
        **collectives,
        "sharded": [isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in pipe.module.parameters()],
        "bubble": report.bubble_fraction,
        "released": all(held.tensor.is_meta for stage in pipe.split.stages for held in stage.state.values()),
        "report": str(report),
    }


# UnevenFrozen's trainable parameters in registration order (the root's own first), with
# their full gradients' bytes: single 4, temperature (0-d: all-reduced alone), inp.weight
# 140, inp.bias 20, twice.weight 100, twice.bias 20, narrow.weight 60, narrow.bias 12. In
# buckets of at most 150 bytes: [single, inp.weight], [inp.bias, twice.weight, twice.bias],
# [narrow.weight, narrow.bias]; rows not divisible by the ranks (at world size 4 one rank
# holds none of narrow's).
BUCKET_BYTES, BUCKETS = 150, 3


def _reduce_accumulated_in_buckets(rank: int, world_size: int) -> dict:
    """Accumulate the uneven model's gradients over two micro-batches with sync off, reduce
    them in buckets, and compare with the whole batch's eager gradients."""
    reference, batch = make_model("uneven")
    model = compshard.shard(copy.deepcopy(reference))
    reference(*batch).backward()
    x, y = local_batch(batch, rank, world_size)
    with compshard.no_sync(model):
        for micro_batch in zip(x.chunk(2), y.chunk(2)):
            model(*micro_batch).backward()
    reduce_scatters = _count_collectives(
        lambda: reduce_accumulated_gradients(model, divide_by=2, bucket_bytes=BUCKET_BYTES)
    )["reduce_scatters"]
    expected = {name: p.grad for name, p in reference.named_parameters() if p.requires_grad}
    got = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.requires_grad}
    return {
        "reduce_scatters": reduce_scatters,
        "grads": {name: relative_error(got[name], expected[name]) for name in expected},
        "frozen_grad": model.frozen.weight.grad,
    }


def _released_while_a_loss_is_held(rank: int, world_size: int) -> dict:
    """The GPT's parameters gathered for a step, two micro-batches' full gradients
    accumulated on them and reduced while their losses (and so their autograd graphs,
    whose AccumulateGrad nodes reference every gathered parameter) are still held, as a
    training loop holds its loss: the bytes each gathered parameter's storage still holds
    after the reduction, and the gradients against the whole batch's eager ones."""
    reference, batch = make_model("gpt")
    model = compshard.shard(copy.deepcopy(reference))
    reference(*batch).backward()
    x, y = local_batch(batch, rank, world_size)
    with gathered_for_step(model):
        gathered = dict(grad_sync_state(model).step_gathered)
        losses = [model(*micro_batch) for micro_batch in zip(x.chunk(2), y.chunk(2))]
        for loss in losses:
            loss.backward()
        reduce_accumulated_gradients(model, divide_by=2)
        held = {name: tensor.untyped_storage().nbytes() for name, tensor in gathered.items()}
    expected = {name: p.grad for name, p in reference.named_parameters()}
    return {
        "held": held,
        "losses_held": all(loss.grad_fn is not None for loss in losses),
        "grads": {name: relative_error(p.grad.full_tensor(), expected[name]) for name, p in model.named_parameters()},
    }


def _run_readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PIPELINE_DOC.read_text(), re.S)
    block = next(b for b in blocks if "compshard.pipeline(" in b)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "docs/pipeline.md", "exec"), {"__name__": "__main__"})
    return out.getvalue()


CASES = {  # world size -> case -> (stages, microbatches, schedule, pass a 1-D pp mesh, compile, reshard)
    2: {
        "1f1b": (2, 4, "1f1b", False, True, "per_step"),
        "gpipe": (2, 4, "gpipe", True, True, "per_step"),
        "eager": (2, 4, "1f1b", False, False, "per_step"),
    },
    4: {
        "1f1b": (2, 2, "1f1b", False, True, "per_step"),
        "gpipe": (2, 4, "gpipe", False, True, "per_step"),
        "eager": (2, 4, "1f1b", False, False, "per_step"),
        "1f1b-per-microbatch": (2, 4, "1f1b", False, True, "per_microbatch"),
        "eager-per-microbatch": (2, 4, "gpipe", False, False, "per_microbatch"),
    },
}


def pipeline_worker(rank: int, world_size: int) -> dict:
    results = {name: _train(rank, world_size, *case) for name, case in CASES[world_size].items()}
    results["readme"] = _run_readme_example()
    results["buckets"] = _reduce_accumulated_in_buckets(rank, world_size)
    results["released"] = _released_while_a_loss_is_held(rank, world_size)
    return results


_RESULTS: dict[int, list] = {}  # world size -> every rank's pipeline_worker result (one spawn each)


def _results(world_size: int) -> tuple[int, list]:
    if world_size not in _RESULTS:
        _RESULTS[world_size] = run_distributed(pipeline_worker, world_size)
    return world_size, _RESULTS[world_size]


@pytest.fixture(params=[2, 4], ids=lambda n: f"world{n}")
def pipeline_results(request):
    return _results(request.param)


def _cases(world_size, case):
    return world_size, CASES[world_size][case], _results(world_size)[1]


# The (world size, case) pairs that exist; each world size spawns its processes once.
WORLD_CASES = [(world_size, case) for world_size, cases in CASES.items() for case in cases]
each_case = pytest.mark.parametrize(
    ("world_size", "case"), WORLD_CASES, ids=[f"world{n}-{case}" for n, case in WORLD_CASES]
)


@each_case
def test_pipeline_training_matches_single_process_eager(world_size, case):
    world_size, (stages, microbatches, schedule, _, _, _), results = _cases(world_size, case)
    model, _ = make_model("gpt")
    held = set()
    for rank, result in enumerate(results):
        got = result[case]
        assert got["loss"] <= RTOL, f"rank {rank}: loss relative error {got['loss']:.2e}"
        worst = max(got["params"], key=got["params"].get)
        assert got["params"][worst] <= RTOL, f"rank {rank}: {worst} relative error {got['params'][worst]:.2e}"
        assert got["stage"] == rank // (world_size // stages)
        assert all(got["sharded"]) if world_size > stages else not any(got["sharded"]), got["sharded"]
        assert got["released"], "the pipeline must not keep other stages' (or unsharded) tensors alive"
        assert got["bubble"] == pytest.approx((stages - 1) / (microbatches + stages - 1))
        assert f"schedule {schedule}" in got["report"] and "bubble fraction" in got["report"]
        held.update(got["names"])
    assert held == {name for name, _ in model.named_parameters()}


@each_case
def test_stages_compile_and_reduce_gradients_once_per_step(world_size, case):
    world_size, (stages, _, _, _, compile, reshard), results = _cases(world_size, case)
    sharded = world_size > stages
    for rank, result in enumerate(results):
        got = result[case]
        # compiled where the stage gathers parameters in every micro-batch: Dynamo captures
        # one graph per stage (no recompile after the first step) and compshard schedules it
        # (a forward and a backward graph); where it reads parameters gathered for the step,
        # or unsharded ones, there is nothing to schedule and the stage runs as built
        # (pipelining.runner.compiles_stage), with compile=True too
        scheduled = compile and sharded and reshard == "per_microbatch"
        assert got["captured"] == (1 if scheduled else 0), f"rank {rank}: {got['captured']} graphs captured"
        assert got["graphs"] == (["backward", "forward"] if scheduled else []), f"rank {rank}: {got['graphs']}"
        assert f"{'compiled' if scheduled else 'eager'} stages" in got["report"]
        assert ("nothing to schedule" in got["report"]) == (compile and not scheduled), got["report"]
        # one reduce-scatter per bucket and step, not one per micro-batch: a stage of the
        # test GPT is one bucket (far below bucket_mb)
        expected = 1 if sharded else 0
        assert got["reduce_scatters"] == expected, f"rank {rank}: {got['reduce_scatters']} reduce-scatters in a step"


@each_case
def test_sharded_stages_gather_as_reshard_says(world_size, case):
    world_size, (stages, microbatches, _, _, compile, reshard), results = _cases(world_size, case)
    for rank, result in enumerate(results):
        got = result[case]
        if world_size == stages:  # unsharded stages: nothing to gather
            assert got["all_gathers"] == 0, f"rank {rank}: {got['all_gathers']} all-gathers in a step"
        elif reshard == "per_step":  # once per step: a stage of the test GPT is one bucket
            assert got["all_gathers"] == 1, f"rank {rank}: {got['all_gathers']} all-gathers in a step"
            assert "parameters gathered per step" in got["report"]
        else:  # in every micro-batch's forward (compiled: per bucket, and again in backward where it reads
            # parameters; eager: per read)
            assert got["all_gathers"] >= microbatches, f"rank {rank}: {got['all_gathers']} all-gathers in a step"
            assert "parameters gathered per microbatch" in got["report"]


def test_accumulated_gradients_reduce_in_buckets(pipeline_results):
    _, results = pipeline_results
    for rank, result in enumerate(results):
        got = result["buckets"]
        assert got["reduce_scatters"] == BUCKETS, f"rank {rank}: {got['reduce_scatters']} reduce-scatters"
        worst = max(got["grads"], key=got["grads"].get)
        assert got["grads"][worst] <= RTOL, f"rank {rank}: {worst} gradient relative error {got['grads'][worst]:.2e}"
        assert got["frozen_grad"] is None


def test_the_step_reduction_frees_the_gathered_parameters_while_a_loss_is_held(pipeline_results):
    """Freed outright, not left to the last reference to drop: a held loss's graph would keep
    every gathered parameter (a whole stage's full parameters) alive through the reduction."""
    _, results = pipeline_results
    for rank, result in enumerate(results):
        got = result["released"]
        assert got["losses_held"]
        assert got["held"] and all(nbytes == 0 for nbytes in got["held"].values()), (rank, got["held"])
        worst = max(got["grads"], key=got["grads"].get)
        assert got["grads"][worst] <= RTOL, f"rank {rank}: {worst} gradient relative error {got['grads'][worst]:.2e}"


def test_readme_pipeline_example_runs(pipeline_results):
    _, results = pipeline_results
    assert re.search(r"^loss \d+\.\d{4}$", results[0]["readme"], re.M), results[0]["readme"]
    assert "bubble fraction (K-1)/(M+K-1) = 1/5" in results[0]["readme"]
    assert all(result["readme"] == "" for result in results[1:])  # only rank 0 prints


def test_compile_true_compiles_a_stage_only_where_there_is_something_to_schedule():
    def compiles(options: dict, device: str = "cpu", **stage) -> bool:  # a stage resolves its options for its device
        return compiles_stage(CompileOptions.from_dict(options).for_devices([torch.device(device)]), **stage)

    assert compiles({}, sharded=True, reshard="per_microbatch")  # gathers in every micro-batch
    assert not compiles({}, sharded=True, reshard="per_step")  # its parameters held for the step
    assert not compiles({}, sharded=False, reshard="per_microbatch")  # nothing sharded
    assert compiles({"recompute": "selective"}, sharded=True, reshard="per_step")
    assert compiles({"memory_budget_mb": 8}, sharded=False, reshard="per_step")
    assert compiles({"codegen": "inductor"}, sharded=False, reshard="per_step")
    assert compiles({}, "cuda", sharded=False, reshard="per_step")  # codegen "auto": Inductor on CUDA
