"""Data parallel over tensor parallel (2-D): ``compshard.shard`` after ``parallelize_module``.

World size 4 as dp 2 x tp 2 on gloo. The repository GPT gets a colwise/rowwise plan on
attention and MLP; compshard (uncompiled and compiled) trains it 3 AdamW steps and is
compared with eager FSDP2 + TP (``fully_shard`` on ``mesh["dp"]`` after the same plan) and
with single-process eager training on the global batch, gradients clipped each step by
``compshard.clip_grad_norm_`` (torch's fails on a model with DTensors on two meshes, the
2-D ones and the dp-only ones, for FSDP2 as for compshard). One spawn runs every check.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import compshard
from compshard.backend import record_compiles
from compshard.compile_plan import COLLECTIVE_KINDS, node_meta
from compshard.passes.fx_utils import c10d, is_op, op_arg, program_collective
from tests.distributed import run_distributed
from tests.models import make_model
from tests.training import RTOL, adamw, local_batch, relative_error, train_reference

STEPS = 3
MAX_NORM = 0.5  # below the gradients' norm (about 1): every step clips
DP, TP = 2, 2


def gpt_plan(model: nn.Module) -> dict:
    """Attention: qkv colwise gathered back to full width (the GPT splits q, k, v by the
    full width), proj rowwise from a replicated input; MLP: fc colwise, proj rowwise. So
    dim 0 is split by tp (qkv, fc), dim 1 (the projections) and biases are replicated."""
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.attn.qkv"] = ColwiseParallel(output_layouts=Replicate())
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel(input_layouts=Replicate())
        plan[f"blocks.{i}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.proj"] = RowwiseParallel()
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


def _train(model: nn.Module, batch: tuple, mesh: DeviceMesh, compiled: bool) -> Run:
    step_model = torch.compile(model, backend="compshard") if compiled else model
    opt = adamw(model)
    losses = []
    for _ in range(STEPS):
        loss = step_model(*local_batch(batch, mesh["dp"].get_local_rank(), DP))
        loss.backward()
        compshard.clip_grad_norm_(model, MAX_NORM)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # tp ranks hold the same loss: the mean over all ranks is the mean over dp
        losses.append(mean.item() / dist.get_world_size())
    params = {name: p.detach().full_tensor() if isinstance(p, DTensor) else p.detach()
              for name, p in model.named_parameters()}
    placements = {name: tuple(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    return Run(losses, params, placements)


def _collectives(kind: str, graph: torch.fx.Graph) -> GraphCollectives:
    program = [n for n in graph.nodes if program_collective(n)]
    ours = [n for n in graph.nodes if node_meta(n).kind in COLLECTIVE_KINDS]
    waited = all(any(is_op(u, c10d.wait_tensor.default) for u in n.users) for n in program)
    return GraphCollectives(kind, [n.name for n in program], {op_arg(n, "group_name") for n in program}, waited,
                            [node_meta(n).kind for n in ours], {op_arg(n, "group_name") for n in ours})


def _errors(mesh: DeviceMesh) -> dict[str, str]:
    """The messages of layouts ``shard`` refuses (nothing is changed or communicated before)."""
    messages = {}
    partial = nn.Linear(4, 4)
    partial.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    flat = init_device_mesh("cpu", (DP * TP,), mesh_dim_names=("all",))
    on_2d = nn.Linear(4, 4)
    on_2d.weight = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()]))
    cases = {"partial": (partial, mesh["dp"]), "2-D": (on_2d, mesh["dp"]),
             "default mesh": (parallelize_module(nn.Linear(4, 4), mesh["tp"], ColwiseParallel()), None),
             "other mesh": (parallelize_module(nn.Linear(4, 4), flat, ColwiseParallel()), mesh["dp"])}
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


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model, batch = make_model("gpt")
    runs = {}
    with record_compiles() as recorded:  # the compiled run's graphs (the others compile nothing)
        for mode in ("fsdp2", "eager", "compiled"):
            replica = parallelize_module(copy.deepcopy(model), mesh["tp"], gpt_plan(model))
            if mode == "fsdp2":
                for block in replica.blocks:
                    fully_shard(block, mesh=mesh["dp"])
                fully_shard(replica, mesh=mesh["dp"])
            else:
                compshard.shard(replica, mesh=mesh["dp"])
            runs[mode] = _train(replica, batch, mesh, compiled=mode == "compiled")
    graphs = [_collectives(g.kind, g.gm.graph) for g in recorded]
    groups = {"dp": mesh["dp"].get_group().group_name, "tp": mesh["tp"].get_group().group_name}
    result = {"runs": runs, "graphs": graphs, "groups": groups, "errors": _errors(mesh), "uneven": _uneven(mesh)}
    return result if rank == 0 else {}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_worker, DP * TP, timeout=600)[0]


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
    reference_losses = train_reference(model, batch, STEPS, max_grad_norm=MAX_NORM)
    reference = dict(model.named_parameters())
    run, fsdp2 = results["runs"][mode], results["runs"]["fsdp2"]
    for theirs in (fsdp2.losses, reference_losses):
        assert run.losses == pytest.approx(theirs, rel=RTOL)
    for name, param in run.params.items():
        assert relative_error(param, fsdp2.params[name]) < RTOL, name
        assert relative_error(param, reference[name].detach()) < RTOL, name


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


def test_unsupported_layouts_raise_naming_the_parameter(results):
    errors = results["errors"]
    assert set(errors) == {"partial", "2-D", "default mesh", "other mesh"}
    assert "'weight'" in errors["partial"] and "Partial" in errors["partial"]
    assert "'weight'" in errors["2-D"] and "1-D mesh" in errors["2-D"]
    for case in ("default mesh", "other mesh"):
        assert "'weight'" in errors[case] and "mesh=mesh['dp']" in errors[case]


def test_uneven_rows_of_a_tp_split_dim_0(results):
    assert results["uneven"]
