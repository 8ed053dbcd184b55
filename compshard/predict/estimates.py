"""The adapter to the backend: compile a fake copy of the model in the fake world with
``compshard.inspect``, price what the passes left unpriced, and read the schedule's
figures into :class:`Estimates` (memory at each graph's peak by holder, the timelines'
seconds).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn

from compshard.inspection import Report, inspect
from compshard.options import CompileOptions
from compshard.predict.fake_world import FakeWorld, copy_model, fake_maker
from compshard.predict.forecast_report import ShardKeywords
from compshard.predict.peak_memory import peak_breakdown
from compshard.predict.pricing import price_expert_parallel, price_tensor_parallel, price_with_timings

__all__ = ["Estimates", "estimate"]


@dataclass(frozen=True)
class Estimates:
    """One compiled schedule's figures (or a linear combination of two)."""

    peaks: dict[str, dict[str, int]]  # graph -> holder -> bytes live at that graph's peak
    forward: float
    backward: float
    communication: float
    exposed_communication: float
    tensor_parallel: float  # seconds of tensor parallelism's collectives
    expert_parallel: float  # seconds of expert parallelism's all-to-alls

    def extended(self, shallower: Estimates, blocks: int) -> Estimates:
        """``self`` plus ``blocks`` times the difference to ``shallower`` (one block fewer)."""

        def extend(deep: float, shallow: float) -> float:
            return deep + blocks * (deep - shallow)

        peaks = {
            graph: {holder: round(extend(b, shallower.peaks[graph][holder])) for holder, b in held.items()}
            for graph, held in self.peaks.items()
        }
        return Estimates(
            peaks,
            *(extend(getattr(self, f.name), getattr(shallower, f.name)) for f in fields(self) if f.name != "peaks"),
        )


def estimate(
    meta_model: nn.Module,
    inputs: tuple[tuple, dict],
    world: FakeWorld,
    sharding: ShardKeywords,
    options: CompileOptions,
) -> tuple[Estimates, Report]:
    """Compile a fake copy of ``meta_model``, sharded in ``world``, for one step on
    ``inputs`` (positional and keyword); its estimates and the schedule they were read from."""
    fake_like = fake_maker()
    model = copy_model(meta_model, fake_like)
    args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, fake_like, inputs)
    option_values = {f.name: getattr(options, f.name) for f in fields(options)}
    try:
        with world.sharded(model, sharding):
            schedule = inspect(model, *args, options=option_values, **kwargs)
            kinds = {name: name.partition(".")[0] for name in schedule.graphs}  # "forward.1" -> "forward"
            peaks = {name: peak_breakdown(gm, kinds[name] == "backward") for name, gm in schedule.graphs.items()}
            if "backward" not in kinds.values():
                raise ValueError(
                    "compshard.forecast: the model's output does not require grad; forecast predicts a training step"
                )
            price_with_timings(schedule, world.machine)
            tensor_parallel = price_tensor_parallel(schedule)
            expert_parallel = price_expert_parallel(schedule)
    finally:
        torch._dynamo.reset()  # the forecast's compiled code (on fake tensors) is of no further use
    timelines = schedule.timelines
    return Estimates(
        peaks=peaks,
        forward=sum(timelines[name].total for name, kind in kinds.items() if kind == "forward"),
        backward=sum(timelines[name].total for name, kind in kinds.items() if kind == "backward"),
        communication=sum(t.comm for t in timelines.values()),
        exposed_communication=sum(t.exposed_comm for t in timelines.values()),
        tensor_parallel=tensor_parallel,
        expert_parallel=expert_parallel,
    ), schedule
