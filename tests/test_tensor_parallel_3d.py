"""3-D: pipeline stages of a 2-D (dp x tp) sharded model, pp 2 x dp 2 x tp 2 at world size 8.

A tiny residual MLP in two stages (input layer and a block; a block and the output layer),
each block's fc colwise and proj rowwise on ``mesh["tp"]``, each stage sharded by compshard
over ``mesh["dp"]`` and run by ``torch.distributed.pipelining`` (``PipelineStage``,
``ScheduleGPipe``, 2 micro-batches) on ``mesh["pp"]``: micro-batches accumulate under
``compshard.no_sync`` and ``reduce_accumulated_gradients`` reduces them once per step, as
``compshard.pipeline`` does for its sharded stages. Uncompiled (8 processes on the suite's
2 cores). ``STEPS`` AdamW steps against single-process eager training on the global batch (1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import compshard
from compshard.sharding import reduce_accumulated_gradients
from tests.distributed import run_distributed
from tests.test_tensor_parallel import full_parameters
from tests.training import ADAMW, RTOL, relative_error

PP, DP, TP = 2, 2, 2
MICRO_BATCHES = 2
STEPS = 2  # the second step runs on what the first's reduction and AdamW update left
WIDTH, BATCH = 8, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(self.fc(x)))


def _model_and_batch() -> tuple[nn.Sequential, tuple[torch.Tensor, torch.Tensor]]:
    """The two stages as one ``Sequential`` (stage ``i`` is child ``i``) and the global batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, WIDTH), Block()), nn.Sequential(Block(), nn.Linear(WIDTH, 3)))
    generator = torch.Generator().manual_seed(1)
    return model, (torch.randn(BATCH, 4, generator=generator), torch.randn(BATCH, 3, generator=generator))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (PP, DP, TP), mesh_dim_names=("pp", "dp", "tp"))
    stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    model, (inputs, targets) = _model_and_batch()
    stage = copy.deepcopy(model[stage_index])
    block = "1" if stage_index == 0 else "0"
    parallelize_module(stage, mesh["tp"], {f"{block}.fc": ColwiseParallel(), f"{block}.proj": RowwiseParallel()})
    compshard.shard(stage, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(stage.parameters(), **ADAMW)
    pipe = PipelineStage(stage, stage_index, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(pipe, MICRO_BATCHES, loss_fn=_loss, scale_grads=False)
    x, y = inputs.chunk(DP)[dp_rank], targets.chunk(DP)[dp_rank]
    losses = []
    for _ in range(STEPS):
        micro_losses: list[torch.Tensor] = []
        with compshard.no_sync(stage):
            if stage_index == 0:
                schedule.step(x)
            else:
                schedule.step(target=y, losses=micro_losses)
        reduce_accumulated_gradients(stage, divide_by=MICRO_BATCHES)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(torch.stack(micro_losses).mean().item() if micro_losses else None)
    placements = {name: tuple(p.placements) for name, p in stage.named_parameters()}
    return {"stage": stage_index, "params": full_parameters(stage), "losses": losses, "placements": placements}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, PP * DP * TP, timeout=600)


def test_pipeline_of_2d_sharded_stages_matches_single_process(results):
    model, batch = _model_and_batch()
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    expected_losses = []
    for _ in range(STEPS):
        loss = _loss(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected_losses.append(loss.item())
    reference = dict(model.named_parameters())
    last_stage = [r for r in results if r["stage"] == PP - 1]
    for result in last_stage:  # one dp replica's half of the batch: the mean of the two is the global loss
        assert None not in result["losses"]
    replica_means = [sum(pair) / DP for pair in zip(*(r["losses"] for r in last_stage[::TP]))]
    assert replica_means == pytest.approx(expected_losses, rel=RTOL)
    for rank, result in enumerate(results):
        assert {p for placements in result["placements"].values() for p in map(repr, placements)} >= {
            "Shard(dim=0)",
            "_StridedShard(dim=0, sf=2)",
            "Shard(dim=1)",
        }, rank
        for name, value in result["params"].items():
            expected = reference[f"{result['stage']}.{name}"].detach()
            assert relative_error(value, expected) < RTOL, (rank, name)
