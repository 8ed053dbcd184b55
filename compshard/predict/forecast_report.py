"""What ``compshard.forecast`` returns: the :class:`Forecast` of one configuration, its
memory and step-time estimates, and the sharding keywords it was forecast with; and the
report's text (``str(report)``).

What the prediction leaves out: the allocator's caching and fragmentation, the
runtime's own buffers (CUDA context, NCCL), host-side launch overhead beyond the per-op
constant, compute and communication slowing each other down, and anything outside the
compiled graphs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from tabulate import tabulate

from compshard.inspection import Report
from compshard.options import CompileOptions
from compshard.sharding import STRATEGIES

__all__ = ["GiB", "MemoryEstimate", "Forecast", "ShardKeywords", "StepEstimate"]

GiB = 2**30


@dataclass(frozen=True)
class ShardKeywords:
    """The ``compshard.shard`` keywords a configuration is forecast with; the defaults are
    ``shard``'s. The meshes are not among them: ``forecast`` builds them, the expert
    mesh from ``expert_parallel_size`` (``None``: the experts split over every rank)."""

    strategy: str = "full_shard"
    reshard_after_forward: bool | None = None
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    buffer_dtype: torch.dtype | None = None
    experts: tuple[str, ...] | None = None
    expert_parallel_size: int | None = None
    expert_capacity_factor: float | None = None

    @classmethod
    def from_dict(cls, keywords: Mapping[str, Any]) -> ShardKeywords:
        """The keywords of a ``forecast(sharding=...)`` dict; a ``ValueError`` names an
        unknown keyword or strategy."""
        allowed = [f.name for f in fields(cls)]
        unknown = sorted(set(keywords) - set(allowed))
        if unknown:
            raise ValueError(
                f"compshard.forecast: unknown sharding keyword(s) {unknown}; allowed: {allowed} "
                "(the mesh is built by forecast)"
            )
        strategy = keywords.get("strategy", cls.strategy)
        if strategy not in STRATEGIES:
            raise ValueError(
                f"compshard.forecast: sharding strategy={strategy!r} is not allowed; use one of {list(STRATEGIES)}"
            )
        experts = keywords.get("experts")
        if experts is not None and not isinstance(experts, str):
            keywords = {**keywords, "experts": tuple(experts)}
        return cls(**keywords)

    def as_kwargs(self) -> dict[str, Any]:
        """These keywords, as ``compshard.shard(module, **keywords)`` takes them (all but
        ``expert_parallel_size``, which the expert mesh says)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "expert_parallel_size"}


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the step's peak. Parameter shards (and under
    ``"shard_optimizer"`` the full parameters beside them) and optimizer state are held
    throughout; the rest is what the compiled graph holding the peak (``peak_graph``)
    has live then."""

    parameters: int
    optimizer_state: int
    gradients: int  # reduced shards and full gradients awaiting their reduction
    activations: int  # saved for backward, and temporaries
    gathered_parameters: int  # all-gather buffers and unpacked parameters
    collective_buffers: int  # gradients packed for or in reduction, backend scratch
    peak_graph: str

    @property
    def peak(self) -> int:
        return (
            self.parameters
            + self.optimizer_state
            + self.gradients
            + self.activations
            + self.gathered_parameters
            + self.collective_buffers
        )


@dataclass(frozen=True)
class StepEstimate:
    """Seconds of one training step. ``forward`` and ``backward`` are the estimated
    timelines' lengths: compute plus the communication compute waits for (the critical
    path through the two streams)."""

    forward: float
    backward: float
    optimizer: float  # the update's data-bound part: one fused pass at memory bandwidth, or timed ("measured")
    outside_graphs: float  # per parameter tensor: guards, DTensor wrapping, per-tensor updates
    compute: float
    communication: float  # all collectives, hidden or not
    exposed_communication: float  # compute waiting for collectives
    exposed_waits: tuple[tuple[str, str, float], ...] = ()  # (graph, bucket or unit, seconds), largest first
    tensor_parallel: float = 0.0  # tensor parallelism's collectives, on the critical path (compute waits for each)
    expert_parallel: float = 0.0  # expert parallelism's all-to-alls, on the critical path too
    step_gather: float = 0.0  # "shard_optimizer": the all-gathers after the update, not overlapped

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer + self.step_gather + self.outside_graphs


@dataclass
class Forecast:
    """What ``compshard.forecast`` predicts for one configuration. ``str(report)`` summarizes it.

    Attributes:
        world_size, hardware: what was forecast for (``hardware``: the preset's name).
        sharding: the ``compshard.shard`` keywords used (:class:`ShardKeywords`);
            ``shard_size`` x ``replicate_size`` ranks (hybrid sharding: shard groups of
            ``shard_size``).
        options: the backend options used (a :class:`~compshard.options.CompileOptions`).
        tokens_per_rank: tokens one rank trains on per step.
        memory: :class:`MemoryEstimate` (rank 0, the rank holding the most).
        step: :class:`StepEstimate`.
        memory_capacity: the device's memory in bytes (None: not known).
        tp: tensor-parallel ranks per data-parallel rank (``world_size / tp`` data-parallel
            ranks shard the parameters; 1: no tensor parallelism).
        extrapolated: None, or (blocks compiled, blocks in the model, the stack's name)
            when the estimates were extended from a shallower copy (see ``depth``).
        notes: what in the options holds the schedule back (e.g. buckets larger than
            ``max_inflight_mb``, whose gathers cannot be prefetched).
        candidates: with ``peak_limit_mb``, a report per configuration tried.
        recommended: the fastest candidate that fits the budget (None: none fits).
        schedule: the :class:`~compshard.inspection.Report` forecast on (the deeper copy when
            extrapolated; None when forecast in a subprocess).
    """

    world_size: int
    hardware: str
    sharding: ShardKeywords
    shard_size: int
    replicate_size: int
    options: CompileOptions
    tokens_per_rank: int
    memory: MemoryEstimate
    step: StepEstimate
    memory_capacity: int | None = None
    tp: int = 1
    extrapolated: tuple[int, int, str] | None = None
    notes: list[str] = field(default_factory=list)
    candidates: list[Forecast] = field(default_factory=list)
    recommended: Forecast | None = None
    schedule: Report | None = field(default=None, repr=False)

    @property
    def tokens_per_second_per_rank(self) -> float:
        return self.tokens_per_rank / self.step.total

    @property
    def tokens_per_second(self) -> float:
        """All ranks together."""
        return self.tokens_per_second_per_rank * self.world_size

    @property
    def communication_share(self) -> float:
        """Exposed communication as a share of the step: what communication costs."""
        return self.step.exposed_communication / self.step.total

    def fits(self, budget_bytes: float | None = None) -> bool | None:
        """Whether the peak fits ``budget_bytes`` (default: the device's memory; None when unknown)."""
        budget = self.memory_capacity if budget_bytes is None else budget_bytes
        return None if budget is None else self.memory.peak <= budget

    def configuration(self) -> str:
        """The strategy, the mesh's shape, the parameter dtype and the options that differ
        from the defaults, on one line."""
        dtype = self.sharding.param_dtype
        chosen = {f.name: value for f in fields(self.options) if (value := getattr(self.options, f.name)) != f.default}
        options = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "default options"
        experts = ""
        if self.sharding.experts:
            ep = self.sharding.expert_parallel_size or self.world_size // self.tp
            experts = f", experts split over {ep}"
        return (
            f"{self.sharding.strategy} (shard {self.shard_size} x replicate {self.replicate_size}"
            f"{f' x tp {self.tp}' if self.tp > 1 else ''}{f', param_dtype {dtype}' if dtype else ''}{experts}), "
            f"{options}"
        )

    def __str__(self) -> str:
        m, s = self.memory, self.step
        fits = self.fits()
        capacity = (
            ""
            if fits is None or self.memory_capacity is None
            else f" of {self.memory_capacity / GiB:.1f} ({'fits' if fits else 'does not fit'})"
        )
        extrapolated = []
        if self.extrapolated:
            compiled, blocks, stack = self.extrapolated
            extrapolated.append(f"extrapolated from {compiled} of the {blocks} blocks of '{stack}'")
        lines = [
            f"compshard.forecast: {self.world_size} ranks on {self.hardware}: {self.configuration()}",
            *extrapolated,
            f"memory per rank (GiB), peak in {m.peak_graph}{capacity}:",
            self._memory_table(),
            f"step {s.total * 1e3:.1f} ms = forward {s.forward * 1e3:.1f} + backward {s.backward * 1e3:.1f} + "
            f"optimizer {s.optimizer * 1e3:.1f}"
            + (f" + all-gathers after it {s.step_gather * 1e3:.1f}" if s.step_gather else "")
            + f" + outside the graphs {s.outside_graphs * 1e3:.1f}",
            f"critical path: compute {s.compute * 1e3:.1f} ms + exposed communication "
            f"{s.exposed_communication * 1e3:.1f} ms ({self.communication_share:.1%} of the step; all collectives "
            f"{s.communication * 1e3:.1f} ms)"
            + (f" + tensor-parallel collectives {s.tensor_parallel * 1e3:.1f} ms" if self.tp > 1 else "")
            + (f" + expert all-to-alls {s.expert_parallel * 1e3:.1f} ms" if s.expert_parallel else ""),
            f"tokens/s: {self.tokens_per_second_per_rank:,.0f} per rank, {self.tokens_per_second:,.0f} in all",
        ]
        waits = "; ".join(f"{graph} {what} {seconds * 1e3:.1f} ms" for graph, what, seconds in s.exposed_waits)
        if waits:
            lines.append(f"longest waits for communication: {waits}")
        lines += [f"note: {note}" for note in self.notes]
        if self.candidates:
            lines.append(self._candidates_table())
            if self.recommended is None:
                lines.append("no candidate fits the memory budget")
        return "\n".join(lines)

    __repr__ = __str__

    def _memory_table(self) -> str:
        m = self.memory
        held = (
            m.parameters,
            m.optimizer_state,
            m.gradients,
            m.activations,
            m.gathered_parameters,
            m.collective_buffers,
            m.peak,
        )
        headers = ["params", "optim state", "grads", "activations", "gathered params", "collective buffers", "peak"]
        return tabulate([[f"{v / GiB:.3f}" for v in held]], headers=headers)

    def _candidates_table(self) -> str:
        rows = [
            [
                c.configuration(),
                f"{c.memory.peak / GiB:.3f}",
                f"{c.step.total * 1e3:.1f}",
                f"{c.tokens_per_second_per_rank:,.0f}",
                "*" if c is self.recommended else "",
            ]
            for c in self.candidates
        ]
        return tabulate(rows, headers=["candidate", "peak GiB", "step ms", "tokens/s/rank", "fastest fitting"])
