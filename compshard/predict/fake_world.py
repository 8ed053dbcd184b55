"""The world a forecast is made in: copies of the model whose tensors hold no data (meta, or
fake tensors the backend can trace), and a ``"fake"`` process group of N ranks in which
they are sharded.

torch's ``FakeProcessGroup`` makes this process rank 0 of a world of N and sends
nothing; its groups are given the forecast hardware's cost-model constants and collective
backend, so the passes decide as they would on rank 0 of the real job (rank 0 holds the
most rows of every parameter).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from compshard import cost_model
from compshard.comm.transport import simulated_backends
from compshard.cost_model import Costs
from compshard.predict.forecast_report import ShardKeywords
from compshard.predict.hardware import Hardware, Measured
from compshard.sharding import shard

__all__ = ["FakeWorld", "copy_model", "fake_maker", "meta_like"]


def meta_like(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``t``'s shape, strides and dtype."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def fake_maker() -> Callable[[torch.Tensor], torch.Tensor]:
    """A function making a fake CPU tensor like its argument (in one fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    return fake_like


def copy_model(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are ``make(tensor)`` (ties kept)."""
    from compshard.sharding import is_sharded

    if is_sharded(model):
        raise ValueError(
            "compshard.forecast: model is already sharded; pass the unsharded model (meta parameters will do)"
        )
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo.setdefault(id(param), nn.Parameter(make(param.detach()), requires_grad=param.requires_grad))
    for buffer in model.buffers():
        memo.setdefault(id(buffer), make(buffer))
    return copy.deepcopy(model, memo)


@dataclass(frozen=True)
class FakeWorld:
    """``world_size`` ranks on ``machine`` computing in ``compute_dtype``: shard groups of
    ``shard_size`` (fewer than the data-parallel ranks: hybrid sharding), and with ``tp``
    > 1 that many tensor-parallel ranks per data-parallel rank, split by ``tp_plan``."""

    world_size: int
    shard_size: int
    machine: Hardware | Measured
    compute_dtype: torch.dtype
    tp: int = 1
    tp_plan: Callable[[nn.Module], dict] | None = None

    @contextlib.contextmanager
    def sharded(self, model: nn.Module, sharding: ShardKeywords) -> Iterator[None]:
        """Inside: the fake default process group (this process: rank 0) exists, and the
        fake ``model`` is sharded over its mesh with ``sharding`` (with ``tp_plan``:
        ``parallelize_module`` on the mesh's ``"tp"`` dimension first, sharded over
        ``"dp"``). A collective's backend scratch is known only while its group exists."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world_size)
        try:
            if self.tp > 1:
                mesh = init_device_mesh("cpu", (self.world_size // self.tp, self.tp), mesh_dim_names=("dp", "tp"))
            elif self.shard_size == self.world_size:
                mesh = init_device_mesh("cpu", (self.world_size,))
            else:  # hybrid sharding: (replicate, shard)
                mesh = init_device_mesh("cpu", (self.world_size // self.shard_size, self.shard_size))
            expert_mesh = None
            if sharding.expert_parallel_size not in (None, self.world_size):
                ep = sharding.expert_parallel_size
                expert_mesh = init_device_mesh("cpu", (ep, self.world_size // ep), mesh_dim_names=("ep", "dp_shard"))
            groups = {mesh.get_group(dim) for dim in range(mesh.ndim)}
            groups |= {expert_mesh.get_group(dim) for dim in range(2)} if expert_mesh is not None else set()
            with self._assumed_costs(groups):
                if self.tp_plan is not None:
                    parallelize_module(model, mesh["tp"], self.tp_plan(model))
                    mesh = mesh["dp"]
                before = set(dist.distributed_c10d._world.pg_names)
                shard(model, mesh=mesh, expert_mesh=expert_mesh, **sharding.as_kwargs())
                with self._assumed_costs(set(dist.distributed_c10d._world.pg_names) - before):  # the experts' own
                    yield
        finally:
            dist.destroy_process_group()

    @contextlib.contextmanager
    def _assumed_costs(self, groups: set[dist.ProcessGroup]) -> Iterator[None]:
        """Inside: ``groups`` have this machine's constants and collective backend."""
        costs: dict[str, Costs] = {
            g.group_name: self.machine.group_costs(dist.get_process_group_ranks(g), self.compute_dtype) for g in groups
        }
        with cost_model.assumed(costs), simulated_backends(dict.fromkeys(costs, self.machine.collective_backend)):
            yield
