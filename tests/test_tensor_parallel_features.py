"""Training features in 2-D (dp 2 x tp 2): mixed precision, no_sync, recompute, memory budget.

One spawn at world size 4, the repository GPT with ``gpt_plan``, ``STEPS`` AdamW steps with
clipping as in ``tests/test_tensor_parallel.py`` (two: the second step shows what the first
left behind, no_sync's empty gradients and bf16's drift; the 3-step parity is that file's):

- bf16 compute with fp32 gradient reduction, compshard uncompiled and compiled against
  eager FSDP2 + TP with the same ``MixedPrecisionPolicy``: both against single-process fp32
  training, compshard within twice FSDP2's error (and within ``BF16_RTOL`` of FSDP2);
- gradient accumulation: each step two micro-batches, the first under ``compshard.no_sync``,
  uncompiled, and compiled with ``recompute="full"`` and a ``memory_budget_mb`` that keeps
  every bucket gathered (one compiled run for the three: each compile of a 2-D graph costs
  about a minute on 2 cores), against single-process training on the global batch (1e-5),
  the compiled plans showing the recompute and the buckets asked for.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import compshard
from compshard.backend import record_compiles
from compshard.compile_plan import Level
from tests.distributed import run_distributed
from tests.models import make_model
from tests.test_tensor_parallel import (
    DP,
    MAX_NORM,
    TP,
    Run,
    adamw_at,
    full_parameters,
    gpt_plan,
    shard_2d,
    train_2d,
)
from tests.training import RTOL, local_batch, relative_error, train_reference

STEPS = 2
BF16 = torch.bfloat16
BF16_RTOL = 2e-2  # compshard against FSDP2, both in bf16 (as tests/test_training_features.py)
MICRO_BATCHES = 2
OPTIONS = {"recompute": "full", "memory_budget_mb": 1024}  # MiB: every bucket of the tiny GPT stays gathered


@dataclass(frozen=True)
class PlanSeen:
    """What a compiled plan decided: its recompute policy, the level of each block, and
    whether every bucket stayed gathered from forward to backward."""

    policy: str
    levels: dict[str, Level]
    all_kept: bool


def _accumulate(model: nn.Module, batch: tuple, mesh: DeviceMesh, compiled: bool) -> tuple[Run, list[bool]]:
    """``STEPS`` steps of ``MICRO_BATCHES`` micro-batches of this dp rank's slice, all but
    the last under ``no_sync`` (compiled: with ``OPTIONS``); also whether any gradient
    reached the parameters before each step's synced micro-batch."""
    step_model = torch.compile(model, backend="compshard", options=OPTIONS) if compiled else model
    optimizer = adamw_at(model)
    local = local_batch(batch, mesh["dp"].get_local_rank(), DP)
    micro = [tuple(t.chunk(MICRO_BATCHES)[i] for t in local) for i in range(MICRO_BATCHES)]
    losses, reached = [], []
    for _ in range(STEPS):
        loss = torch.zeros(())
        with compshard.no_sync(model):
            for inputs in micro[:-1]:
                part = step_model(*inputs) / MICRO_BATCHES
                part.backward()
                loss += part.detach()
        reached.append(any(p.grad is not None for p in model.parameters()))
        part = step_model(*micro[-1]) / MICRO_BATCHES
        part.backward()
        loss += part.detach()
        compshard.clip_grad_norm_(model, MAX_NORM)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return Run(losses, full_parameters(model), {}), reached


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model, batch = make_model("gpt")

    def replica(system: str, **dtypes: torch.dtype) -> nn.Module:
        return shard_2d(system, parallelize_module(copy.deepcopy(model), mesh["tp"], gpt_plan(model)), mesh, **dtypes)

    results: dict = {}
    for system, compiled in (("fsdp2", False), ("compshard", False), ("compshard", True)):
        results["bf16", system, compiled] = train_2d(
            replica(system, param_dtype=BF16, reduce_dtype=torch.float32), batch, mesh, compiled, steps=STEPS
        )
    results["no_sync", False] = _accumulate(replica("compshard"), batch, mesh, compiled=False)
    with record_compiles() as recorded:
        results["no_sync", True] = _accumulate(replica("compshard"), batch, mesh, compiled=True)
    plans = {graph.plan.number: graph.plan for graph in recorded}.values()  # accumulate, then fold
    results["plans"] = [
        PlanSeen(plan.recompute.policy, dict(plan.recompute.levels), all(b.keep_gathered for b in plan.buckets))
        for plan in plans
    ]
    return results if rank == 0 else {}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_distributed(_worker, DP * TP, timeout=900)[0]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 training on the global batch: the losses and parameters."""
    model, batch = make_model("gpt")
    losses = train_reference(model, batch, STEPS, max_grad_norm=MAX_NORM)
    return losses, {name: p.detach() for name, p in model.named_parameters()}


def _error(run: Run, params: dict[str, torch.Tensor]) -> float:
    return max(relative_error(run.params[name], value) for name, value in params.items())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_within_fsdp2s_error(results, reference, compiled):
    fsdp2, run = results["bf16", "fsdp2", False], results["bf16", "compshard", compiled]
    fsdp2_error = _error(fsdp2, reference[1])
    assert RTOL < fsdp2_error  # bf16 compute is visible against fp32 training
    assert _error(run, reference[1]) <= 2 * fsdp2_error
    assert _error(run, fsdp2.params) <= BF16_RTOL
    assert run.losses == pytest.approx(fsdp2.losses, rel=BF16_RTOL)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_no_sync_micro_batches_equal_one_big_batch(results, reference, compiled):
    run, reached = results["no_sync", compiled]
    assert reached == [False] * STEPS  # under no_sync nothing reaches the shards
    assert run.losses == pytest.approx(reference[0], rel=RTOL)
    assert _error(run, reference[1]) < RTOL


def test_compiled_accumulation_recomputed_and_kept_gathered_as_asked(results):
    plans = results["plans"]
    assert len(plans) == 2, plans  # one per gradient-sync mode: accumulate, fold
    for plan in plans:
        assert plan.policy == "full" and plan.levels and set(plan.levels.values()) == {Level.FULL}, plan
        assert plan.all_kept, plan
