"""Data parallel over tensor parallel (2-D): ``compshard.shard`` after ``parallelize_module``.

World size 4 as dp 2 x tp 2 on gloo. The repository GPT gets a colwise/rowwise plan on
attention and MLP, HF Llama the torchtitan-style plan with and without sequence
parallel; compshard (uncompiled and compiled) trains each 3 AdamW steps and is compared
with eager FSDP2 + TP (``fully_shard`` on ``mesh["dp"]`` after the same plan) and with
single-process eager training on the global batch, gradients clipped each step by
``compshard.clip_grad_norm_`` (torch's fails on a model with DTensors on two meshes, the
2-D ones and the dp-only ones, for FSDP2 as for compshard). One spawn for the module: the
GPT's runs, its compiled graphs and report, the refused layouts, then HF Llama's runs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import compshard
from compshard.backend import record_compiles
from compshard.compile_plan import COLLECTIVE_KINDS, node_meta
from compshard.inspection import Report
from compshard.models import tensor_parallel_plan as gpt_plan
from compshard.passes.fx_utils import c10d, is_op, op_arg, program_collective
from tests.distributed import run_distributed
from tests.models import make_model
from tests.real_models import build_llama
from tests.training import ADAMW, RTOL, local_batch, relative_error, train_reference

STEPS = 3
MAX_NORM = 0.5  # below the gradients' norm (about 1): every step clips
# HF Llama's weights start at std 0.02, so the suite's lr of 1e-2 moves them by about half
# their size a step, and tensor parallelism's own reduction order then puts eager FSDP2 +
# TP 1.3e-5 from single-process training after 3 steps; at 1e-3 it is 1.5e-6.
LLAMA_LR = 1e-3
# The GPT's too (std 0.02, biases from 0): at 1e-2 the q part of blocks.0.attn.qkv.bias has
# gradients of 1e-6 to 1e-5 whose signs flip from step to step (element 28: -1.1e-6, 8.4e-6,
# -5.1e-6), so Adam's first moment nearly cancels and the 3e-9 by which tensor parallelism's
# reduction order changes the last gradient moved that element by 1.2e-6: eager FSDP2 + TP
# (equal to compshard's runs) ended 1.25e-5 from single-process training on an AMD EPYC
# (another CPU passed). At 1e-3 the signs hold and the worst parameter is 1.6e-6 off (2.9e-6
# with a one-thread reference).
GPT_LR = 1e-3
DP, TP = 2, 2


def llama_plan(model: nn.Module, sequence_parallel: bool) -> dict:
    """torchtitan's plan in HF Llama's names: embedding rowwise, q/k/v and gate/up colwise,
    o/down rowwise, the head colwise. With sequence parallel the activations between the
    blocks stay DTensors split on the sequence (the norms run on the split), and each
    attention and MLP gathers its input; the embedding's output is a DTensor of the full
    shape, which HF's position ids and mask are built from."""
    between = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    plan = {
        "model.model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=between, use_local_output=local
        ),
        "model.lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    for i in range(len(model.model.model.layers)):
        layer = f"model.model.layers.{i}"
        plan |= {
            f"{layer}.{name}": ColwiseParallel()
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
        }
        plan |= {
            f"{layer}.{name}": RowwiseParallel(output_layouts=between, use_local_output=local)
            for name in ("self_attn.o_proj", "mlp.down_proj")
        }
        if sequence_parallel:
            plan |= {
                f"{layer}.input_layernorm": SequenceParallel(),
                f"{layer}.post_attention_layernorm": SequenceParallel(),
                f"{layer}.self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                ),
                f"{layer}.mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
            }
    if sequence_parallel:
        plan["model.model.norm"] = SequenceParallel()
    return plan


@dataclass
class Run:
    """One way of training, as rank 0 saw it."""

    losses: list[float]
    params: dict[str, torch.Tensor]  # full tensors
    placements: dict[str, tuple]


@dataclass
class GraphCollectives:
    """What one compiled graph holds: the program's (tensor-parallel) collectives by op
    in graph order, their groups, compshard's collective kinds and groups."""

    kind: str
    program: list[str]
    program_groups: set[str]
    program_waited: bool
    compshard: list[str]
    compshard_groups: set[str]


def adamw_at(model: nn.Module, lr: float = ADAMW["lr"]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), **(ADAMW | {"lr": lr}))


def train_2d(
    model: nn.Module,
    batch: tuple,
    mesh: DeviceMesh,
    compiled: bool,
    lr: float = ADAMW["lr"],
    *,
    options: dict | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = STEPS,
) -> Run:
    """``steps`` AdamW steps (with ``optimizer``, a new one when None) on this dp rank's
    slice of ``batch``, clipped by ``compshard.clip_grad_norm_``."""
    step_model = torch.compile(model, backend="compshard", options=options) if compiled else model
    opt = optimizer if optimizer is not None else adamw_at(model, lr)
    losses = []
    for _ in range(steps):
        loss = step_model(*local_batch(batch, mesh["dp"].get_local_rank(), DP))
        loss.backward()
        compshard.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().to(torch.float32, copy=True)
        dist.all_reduce(mean)  # tp ranks hold the same loss: the mean over all ranks is the mean over dp
        losses.append(mean.item() / dist.get_world_size())
    return Run(
        losses,
        full_parameters(model),
        {name: tuple(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)},
    )


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor, by name (collective)."""
    return {
        name: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach() for name, p in model.named_parameters()
    }


def shard_2d(
    mode: str,
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """``model`` (tensor-parallel already) sharded over ``mesh["dp"]``: by FSDP2 for
    ``"fsdp2"`` (each repeated block, then the root, as FSDP2 is applied), else by compshard;
    with the mixed-precision dtypes given."""
    if mode != "fsdp2":
        return compshard.shard(model, mesh=mesh["dp"], param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = model.blocks if hasattr(model, "blocks") else model.model.model.layers
    for block in blocks:
        fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
    return fully_shard(model, mesh=mesh["dp"], mp_policy=policy)


def _collectives(kind: str, graph: torch.fx.Graph) -> GraphCollectives:
    program = [n for n in graph.nodes if program_collective(n)]
    ours = [n for n in graph.nodes if node_meta(n).kind in COLLECTIVE_KINDS]
    waited = all(any(is_op(u, c10d.wait_tensor.default) for u in n.users) for n in program)
    return GraphCollectives(
        kind,
        [n.name for n in program],
        {op_arg(n, "group_name") for n in program},
        waited,
        [node_meta(n).kind for n in ours],
        {op_arg(n, "group_name") for n in ours},
    )


def _tensor_parallel_in_report(report: Report) -> tuple[set[str], set[str]]:
    """What ``compshard.inspect``'s table and trace say of the tensor-parallel collectives:
    the labels of the table's ``tp collective`` rows and of the trace's spans."""
    rows = {row["bucket"] for row in report.rows() if row["kind"] == "tp collective"}
    with tempfile.TemporaryDirectory() as folder:
        report.save_trace(os.path.join(folder, "trace.json"))
        with open(os.path.join(folder, "trace.json")) as file:
            events = json.load(file)["traceEvents"]
    return rows, {event["args"]["group"] for event in events if event.get("cat") == "tp collective"}


def _errors(mesh: DeviceMesh) -> dict[str, str]:
    """The messages of layouts ``shard`` refuses (nothing is changed or communicated before)."""
    messages = {}
    partial = nn.Linear(4, 4)
    partial.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    flat = init_device_mesh("cpu", (DP * TP,), mesh_dim_names=("all",))
    on_2d = nn.Linear(4, 4)
    on_2d.weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()]))
    cases = {
        "partial": (partial, mesh["dp"]),
        "2-D": (on_2d, mesh["dp"]),
        "default mesh": (parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel()), None),
        "other mesh": (parallelize_module(nn.Linear(4, 4), flat, ColwiseParallel()), mesh["dp"]),
    }
    for case, (module, dp_mesh) in cases.items():
        try:
            compshard.shard(module, mesh=dp_mesh)
        except ValueError as error:
            messages[case] = str(error)
    return messages


def _uneven(mesh: DeviceMesh) -> bool:
    """A colwise weight of 10 rows: 5 per tp rank, split 3 and 2 over dp; at rest its full
    tensor is the original."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 10)
    original = layer.weight.detach().clone()
    compshard.shard(parallelize_module(layer, mesh["tp"], ColwiseParallel()), mesh=mesh["dp"])
    return torch.equal(layer.weight.detach().full_tensor(), original)


def _gpt(mesh: DeviceMesh) -> dict:
    model, batch = make_model("gpt")
    runs = {}
    with record_compiles() as recorded:  # the compiled run's graphs (the others compile nothing)
        for mode in ("fsdp2", "eager", "compiled"):
            replica = shard_2d(mode, parallelize_module(copy.deepcopy(model), mesh["tp"], gpt_plan(model)), mesh)
            runs[mode] = train_2d(replica, batch, mesh, compiled=mode == "compiled", lr=GPT_LR)
    graphs = [_collectives(g.kind, g.gm.graph) for g in recorded]
    groups = {"dp": mesh["dp"].get_group().group_name, "tp": mesh["tp"].get_group().group_name}
    return {
        "runs": runs,
        "graphs": graphs,
        "groups": groups,
        "errors": _errors(mesh),
        "uneven": _uneven(mesh),
        "report": _tensor_parallel_in_report(Report(list(recorded))),
    }


def _llama(mesh: DeviceMesh) -> dict:
    model, batch = build_llama()
    runs = {}
    for sequence_parallel in (False, True):
        for mode in ("fsdp2", "eager", "compiled"):
            replica = parallelize_module(copy.deepcopy(model), mesh["tp"], llama_plan(model, sequence_parallel))
            runs[mode, sequence_parallel] = train_2d(
                shard_2d(mode, replica, mesh), batch, mesh, compiled=mode == "compiled", lr=LLAMA_LR
            )
    return runs


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    result = {"gpt": _gpt(mesh), "llama": _llama(mesh)}
    return result if rank == 0 else {}


@pytest.fixture(scope="module")
def spawned() -> dict:
    """Rank 0's results of the module's one spawn."""
    return run_distributed(_worker, DP * TP, timeout=1200)[0]


@pytest.fixture(scope="module")
def results(spawned) -> dict:
    return spawned["gpt"]


@pytest.fixture(scope="module")
def llama_runs(spawned) -> dict:
    return spawned["llama"]


def _assert_parity(run: Run, fsdp2: Run, reference_losses: list[float], reference: dict[str, nn.Parameter]) -> None:
    for theirs in (fsdp2.losses, reference_losses):
        assert run.losses == pytest.approx(theirs, rel=RTOL)
    for name, param in run.params.items():
        assert relative_error(param, fsdp2.params[name]) < RTOL, name
        assert relative_error(param, reference[name].detach()) < RTOL, name


def test_parameters_rest_as_fsdp2_places_them(results):
    runs = results["runs"]
    assert runs["eager"].placements == runs["fsdp2"].placements
    assert runs["compiled"].placements == runs["fsdp2"].placements
    placements = {str(p) for p in runs["compiled"].placements.values()}
    assert any("_StridedShard" in p for p in placements)  # qkv, fc: tp split dim 0, dp splits the piece
    assert any("Shard(dim=1)" in p for p in placements)  # the rowwise projections


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_training_matches_fsdp2_and_single_process(results, mode):
    model, batch = make_model("gpt")
    reference_losses = train_reference(model, batch, STEPS, max_grad_norm=MAX_NORM, optimizer=adamw_at(model, GPT_LR))
    reference = dict(model.named_parameters())
    _assert_parity(results["runs"][mode], results["runs"]["fsdp2"], reference_losses, reference)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_llama_matches_fsdp2_and_single_process(llama_runs, mode, sequence_parallel):
    model, batch = build_llama()
    reference_losses = train_reference(model, batch, STEPS, max_grad_norm=MAX_NORM, optimizer=adamw_at(model, LLAMA_LR))
    run = llama_runs[mode, sequence_parallel]
    assert run.placements == llama_runs["fsdp2", sequence_parallel].placements
    _assert_parity(run, llama_runs["fsdp2", sequence_parallel], reference_losses, dict(model.named_parameters()))


def _op_and_index(name: str) -> tuple[str, int]:
    """``all_reduce_3`` -> ``("all_reduce", 3)``; ``all_reduce`` -> ``("all_reduce", 0)``."""
    match = re.fullmatch(r"(.*?)_(\d+)", name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def test_compiled_graphs_carry_both_groups_collectives(results):
    graphs, groups = results["graphs"], results["groups"]
    assert {g.kind for g in graphs} >= {"forward", "backward"}
    for graph in graphs:
        if graph.kind not in ("forward", "backward"):
            continue
        assert graph.program and graph.compshard, graph
        assert graph.program_groups == {groups["tp"]}
        assert graph.compshard_groups == {groups["dp"]}
        assert graph.program_waited
        for op in {_op_and_index(name)[0] for name in graph.program}:
            # FX numbers the nodes of one op in trace order: the passes kept the program's order
            same_op = [name for name in graph.program if _op_and_index(name)[0] == op]
            assert same_op == sorted(same_op, key=lambda name: _op_and_index(name)[1]), same_op


def test_inspect_and_trace_name_the_tensor_parallel_group(results):
    rows, spans = results["report"]
    tp_group = f"on group {results['groups']['tp']} (ranks 0, 1)"  # rank 0's tp group
    assert rows and all(tp_group in row for row in rows), rows
    assert {row.split()[0] for row in rows} >= {"all_gather_into_tensor", "all_reduce"}, rows
    assert spans and spans <= rows, spans


def test_unsupported_layouts_raise_naming_the_parameter(results):
    errors = results["errors"]
    assert set(errors) == {"partial", "2-D", "default mesh", "other mesh"}
    assert "'weight'" in errors["partial"] and "Partial" in errors["partial"]
    assert "'weight'" in errors["2-D"] and "1-D mesh" in errors["2-D"]
    for case in ("default mesh", "other mesh"):
        assert "'weight'" in errors[case] and "mesh=mesh['dp']" in errors[case]


def test_uneven_rows_of_a_tp_split_dim_0(results):
    assert results["uneven"]
