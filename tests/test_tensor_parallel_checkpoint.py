"""DCP checkpoints of 2-D (dp x tp) models: compshard's and eager FSDP2 + TP's read each other's.

One spawn at world size 4. The repository GPT with ``gpt_plan`` on dp 2 x tp 2 is trained
one step (the optimizer then holds state to save) by compshard (uncompiled) and by eager
FSDP2 + TP, and each saves: compshard with ``compshard.checkpoint.save``, FSDP2 with
``dcp.save`` of ``get_state_dict``. Then each
checkpoint is loaded into the other system with the same plan, and compshard's into
plain compshard at world size 4 (dp 4 x tp 1), whose own checkpoint loads back into
compshard 2-D. After each load the model's and the optimizer's full tensors equal the
writer's, bit for bit.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

import compshard
from compshard import checkpoint
from compshard.sharding import is_sharded
from tests.distributed import run_distributed
from tests.models import make_model
from tests.test_tensor_parallel import DP, TP, adamw_at, gpt_plan, shard_2d, train_2d

FULL = StateDictOptions(full_state_dict=True)


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The model's and the optimizer's full tensors, by name (collective)."""
    if is_sharded(model):
        return checkpoint.get_full_state_dict(model, optimizer, rank0_only=False)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=FULL)
    return {checkpoint.MODEL_KEY: model_state, checkpoint.OPTIMIZER_KEY: optimizer_state}


def _fsdp2_save(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({checkpoint.MODEL_KEY: model_state, checkpoint.OPTIMIZER_KEY: optimizer_state}, checkpoint_id=path)


def _fsdp2_load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {checkpoint.MODEL_KEY: model_state, checkpoint.OPTIMIZER_KEY: optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state[checkpoint.MODEL_KEY], optim_state_dict=state[checkpoint.OPTIMIZER_KEY]
    )


def _differences(state: dict, expected: dict) -> list[str]:
    """Names of the model and optimizer tensors in which ``state`` differs from ``expected``."""
    flat = {f"model.{k}": v for k, v in state[checkpoint.MODEL_KEY].items()}
    flat |= {
        f"optimizer.{p}.{k}": v
        for p, entries in state[checkpoint.OPTIMIZER_KEY]["state"].items()
        for k, v in entries.items()
    }
    wanted = {f"model.{k}": v for k, v in expected[checkpoint.MODEL_KEY].items()}
    wanted |= {
        f"optimizer.{p}.{k}": v
        for p, entries in expected[checkpoint.OPTIMIZER_KEY]["state"].items()
        for k, v in entries.items()
    }
    if set(flat) != set(wanted):
        return sorted(set(flat) ^ set(wanted))
    return [key for key, value in wanted.items() if not torch.equal(flat[key].cpu(), value.cpu())]


def _worker(rank: int, world_size: int, root: str) -> dict:
    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    model, batch = make_model("gpt")

    def two_d(system: str) -> tuple[nn.Module, torch.optim.Optimizer]:
        replica = shard_2d(system, parallelize_module(copy.deepcopy(model), mesh["tp"], gpt_plan(model)), mesh)
        return replica, adamw_at(replica)

    def one_d() -> tuple[nn.Module, torch.optim.Optimizer]:
        replica = compshard.shard(copy.deepcopy(model))
        return replica, adamw_at(replica)

    loaders = {"compshard": checkpoint.load, "fsdp2": _fsdp2_load}
    written = {}
    for system, save in (("compshard", checkpoint.save), ("fsdp2", _fsdp2_save)):
        trained, optimizer = two_d(system)
        train_2d(trained, batch, mesh, compiled=False, optimizer=optimizer, steps=1)
        save(os.path.join(root, system), trained, optimizer)
        written[system] = _full_state(trained, optimizer)
    results = {}
    for writer, reader in (("compshard", "fsdp2"), ("fsdp2", "compshard")):
        loaded, optimizer = two_d(reader)
        loaders[reader](os.path.join(root, writer), loaded, optimizer)
        results[f"{reader} 2-D <- {writer} 2-D"] = _differences(_full_state(loaded, optimizer), written[writer])
    flat, optimizer = one_d()
    checkpoint.load(os.path.join(root, "compshard"), flat, optimizer)
    results["compshard dp 4 <- compshard 2-D"] = _differences(_full_state(flat, optimizer), written["compshard"])
    _train_one_d(flat, optimizer, batch, mesh)
    checkpoint.save(os.path.join(root, "compshard-dp4"), flat, optimizer)
    written["compshard-dp4"] = _full_state(flat, optimizer)
    loaded, optimizer = two_d("compshard")
    checkpoint.load(os.path.join(root, "compshard-dp4"), loaded, optimizer)
    results["compshard 2-D <- compshard dp 4"] = _differences(_full_state(loaded, optimizer), written["compshard-dp4"])
    results["trained apart"] = _differences(written["compshard-dp4"], written["compshard"])
    return results


def _train_one_d(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple, mesh: DeviceMesh) -> None:
    """One more step at dp 4, so that the checkpoint it writes differs from the 2-D one."""
    loss = model(*(t.chunk(DP * TP)[mesh.get_rank()] for t in batch))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_distributed(_worker, DP * TP, str(tmp_path_factory.mktemp("checkpoints_2d")), timeout=600)


@pytest.mark.parametrize(
    "case",
    [
        "fsdp2 2-D <- compshard 2-D",
        "compshard 2-D <- fsdp2 2-D",
        "compshard dp 4 <- compshard 2-D",
        "compshard 2-D <- compshard dp 4",
    ],
)
def test_loaded_state_equals_the_writers(results, case):
    for rank, result in enumerate(results):
        assert result[case] == [], (rank, case)


def test_the_layouts_trained_apart(results):
    """The dp-4 checkpoint differs from the 2-D one: the round trip back is no copy of the first."""
    assert results[0]["trained apart"]
