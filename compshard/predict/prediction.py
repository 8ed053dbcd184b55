"""``compshard.plan``: predict per-rank memory and step time at N ranks, without the ranks.

How: a copy of the model whose parameters are fake tensors (shapes and dtypes, no
storage) is sharded with ``compshard.shard`` over a ``"fake"`` process group (torch's
``FakeProcessGroup``: this process is rank 0 of a world of N and nothing is sent), and
compiled with the compshard backend through ``compshard.inspect``: the passes build the
schedule they would build on rank 0 of N real ranks (rank 0 holds the most rows of every
parameter), deciding with the cost model's constants for the chosen hardware
(:mod:`compshard.predict.hardware`). The prediction reads that schedule:

- memory per rank: parameter shards and optimizer state at rest, plus the estimated bytes
  live at the step's peak (``passes/memory_model.py``), split by what holds them:
  activations, gathered parameters, gradients, collective buffers (gradients being
  reduced, the backend's scratch);
- step time: the estimated forward and backward timelines (one compute and one
  communication stream, ``compshard.timeline``), whose length is the critical path
  (compute plus the communication it waits for), plus the optimizer's bytes at memory
  bandwidth (one fused pass), plus the machine's seconds per parameter tensor for the host
  work outside the graphs (``hardware="measured"`` times that host work, the graphs' ops
  and torch's optimizer on rank 0's shard shapes instead of estimating them; see
  :class:`~compshard.predict.hardware.Measured`).

Depth: compiling a deep model takes minutes (Dynamo, AOTAutograd and the partitioner
trace every block). With ``depth="auto"`` a model whose blocks form a stack of at least
``EXTRAPOLATE_FROM`` identical blocks (a ``ModuleList`` of one class with the same
parameter shapes) is planned with its first ``PLANNED_BLOCKS`` (3 and 4) blocks, and every
estimate is extended linearly by the difference (one middle block: the first blocks start
the prefetch chain, whose look-ahead reaches past the first middle block, and the last
stays gathered into backward), when nothing couples the blocks of the schedule: one
bucket per block (``buckets="auto"``), a block's gathered bytes over
``bucket_mb`` (so no collective joins two blocks), no global budget (``memory_budget_mb``,
``recompute={"budget_mb": ...}``). Parameters and optimizer state come from the full
model's shapes. ``depth="exact"`` compiles the whole model.

What the prediction leaves out: the allocator's caching and fragmentation, the
runtime's own buffers (CUDA context, NCCL), host-side launch overhead beyond the per-op
constant, compute and communication slowing each other down, and anything outside the
compiled graphs.

Planning runs in this process when no process group is initialized (it creates and
destroys its own fake one, and resets Dynamo's caches afterwards); otherwise in a spawned
subprocess, which needs the model's class importable there (with ``hardware="measured"``,
on rank 0 only: every rank returns its report).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch
import torch.distributed as dist
from tabulate import tabulate
from torch import fx, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from compshard import cost_model
from compshard.comm.ops import ShardLayout, simulated_backends
from compshard.compile_plan import COLLECTIVE_KINDS, MiB, node_meta, set_node_meta
from compshard.cost_model import Costs, collective_seconds
from compshard.options import CompileOptions
from compshard.passes.fx_utils import op_arg, producer, program_collective
from compshard.passes.memory_model import backend_scratch_bytes, storages
from compshard.predict import hardware as hardware_presets
from compshard.predict.hardware import Hardware, Measured
from compshard.predict.inspection import Report, inspect
from compshard.sharding import STRATEGIES, shard
from compshard.sizes import nbytes
from compshard.timeline import simulate

__all__ = ["plan", "PlanReport", "MemoryEstimate", "StepEstimate", "default_candidates", "EXTRAPOLATE_FROM"]

GiB = 2**30
EXTRAPOLATE_FROM = 8  # depth="auto" extrapolates stacks of at least this many blocks
PLANNED_BLOCKS = (3, 4)  # the truncated depths an extrapolated plan compiles
Depth = Literal["auto", "exact", "extrapolate"]
_SHARD_KEYWORDS = (
    "strategy",
    "reshard_after_forward",
    "param_dtype",
    "reduce_dtype",
    "output_dtype",
    "cast_forward_inputs",
    "buffer_dtype",
)
_HOLDERS = ("gradients", "activations", "gathered_parameters", "collective_buffers")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds at the step's peak. Parameter shards and optimizer state are
    held throughout; the rest is what the compiled graph holding the peak (``peak_graph``)
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

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.optimizer + self.outside_graphs


@dataclass
class PlanReport:
    """What ``compshard.plan`` predicts for one configuration. ``str(report)`` summarizes it.

    Attributes:
        world_size, hardware: what was planned for (``hardware``: the preset's name).
        sharding: the ``compshard.shard`` keywords used; ``shard_size`` x ``replicate_size``
            ranks (hybrid sharding: shard groups of ``shard_size``).
        options: the backend options used.
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
        candidates: with ``memory_budget_gib``, a report per configuration tried.
        recommended: the fastest candidate that fits the budget (None: none fits).
        schedule: the :class:`~compshard.predict.inspection.Report` planned on (the deeper copy when
            extrapolated; None when planned in a subprocess).
    """

    world_size: int
    hardware: str
    sharding: dict
    shard_size: int
    replicate_size: int
    options: dict
    tokens_per_rank: int
    memory: MemoryEstimate
    step: StepEstimate
    memory_capacity: int | None = None
    tp: int = 1
    extrapolated: tuple[int, int, str] | None = None
    notes: list[str] = field(default_factory=list)
    candidates: list[PlanReport] = field(default_factory=list)
    recommended: PlanReport | None = None
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
        strategy = self.sharding.get("strategy", "full_shard")
        dtype = self.sharding.get("param_dtype")
        options = ", ".join(f"{k}={v}" for k, v in self.options.items()) or "default options"
        return (
            f"{strategy} (shard {self.shard_size} x replicate {self.replicate_size}"
            f"{f' x tp {self.tp}' if self.tp > 1 else ''}{f', param_dtype {dtype}' if dtype else ''}), {options}"
        )

    def __str__(self) -> str:
        m, s = self.memory, self.step
        fits = self.fits()
        capacity = (
            ""
            if fits is None or self.memory_capacity is None
            else f" of {self.memory_capacity / GiB:.1f} ({'fits' if fits else 'does not fit'})"
        )
        memory = tabulate(
            [
                [
                    f"{v / GiB:.3f}"
                    for v in (
                        m.parameters,
                        m.optimizer_state,
                        m.gradients,
                        m.activations,
                        m.gathered_parameters,
                        m.collective_buffers,
                        m.peak,
                    )
                ]
            ],
            headers=["params", "optim state", "grads", "activations", "gathered params", "collective buffers", "peak"],
        )
        lines = [
            f"compshard.plan: {self.world_size} ranks on {self.hardware}: {self.configuration()}",
            *(
                [
                    f"extrapolated from {self.extrapolated[0]} of the {self.extrapolated[1]} blocks of "
                    f"'{self.extrapolated[2]}'"
                ]
                if self.extrapolated
                else []
            ),
            f"memory per rank (GiB), peak in {m.peak_graph}{capacity}:",
            memory,
            f"step {s.total * 1e3:.1f} ms = forward {s.forward * 1e3:.1f} + backward {s.backward * 1e3:.1f} + "
            f"optimizer {s.optimizer * 1e3:.1f} + outside the graphs {s.outside_graphs * 1e3:.1f}",
            f"critical path: compute {s.compute * 1e3:.1f} ms + exposed communication "
            f"{s.exposed_communication * 1e3:.1f} ms ({self.communication_share:.1%} of the step; all collectives "
            f"{s.communication * 1e3:.1f} ms)"
            + (f" + tensor-parallel collectives {s.tensor_parallel * 1e3:.1f} ms" if self.tp > 1 else ""),
            f"tokens/s: {self.tokens_per_second_per_rank:,.0f} per rank, {self.tokens_per_second:,.0f} in all",
        ]
        waits = "; ".join(f"{graph} {what} {seconds * 1e3:.1f} ms" for graph, what, seconds in s.exposed_waits)
        if waits:
            lines.append(f"longest waits for communication: {waits}")
        lines += [f"note: {note}" for note in self.notes]
        if self.candidates:
            lines.append(
                tabulate(
                    [
                        [
                            c.configuration(),
                            f"{c.memory.peak / GiB:.3f}",
                            f"{c.step.total * 1e3:.1f}",
                            f"{c.tokens_per_second_per_rank:,.0f}",
                            "*" if c is self.recommended else "",
                        ]
                        for c in self.candidates
                    ],
                    headers=["candidate", "peak GiB", "step ms", "tokens/s/rank", "fastest fitting"],
                )
            )
            if self.recommended is None:
                lines.append("no candidate fits the memory budget")
        return "\n".join(lines)

    __repr__ = __str__


def default_candidates(world_size: int, devices_per_node: int) -> list[tuple[dict, dict]]:
    """The (sharding, options) grid ``memory_budget_gib`` searches: each recompute policy
    with full sharding, with parameters kept from forward to backward (``shard_grad_op``),
    and, beyond one node, with hybrid sharding over one node's devices."""
    strategies = ["full_shard", "shard_grad_op"]
    if world_size > devices_per_node and world_size % devices_per_node == 0:
        strategies.append("hybrid_shard")
    return [
        ({"strategy": strategy}, {"recompute": recompute})
        for strategy in strategies
        for recompute in ("none", "selective", "full")
    ]


def plan(
    model: nn.Module,
    *example_inputs: Any,
    world_size: int,
    hardware: str | Hardware | Measured = "h100-sxm",
    options: dict | None = None,
    sharding: dict | None = None,
    shard_group_size: int | None = None,
    tp: int = 1,
    tp_plan: Callable[[nn.Module], dict] | None = None,
    optimizer_states: int = 2,
    tokens_per_rank: int | None = None,
    memory_budget_gib: float | None = None,
    candidates: Sequence[tuple[dict, dict]] | None = None,
    depth: Depth = "auto",
    **model_kwargs: Any,
) -> PlanReport:
    """Predict one training step of ``model`` at ``world_size`` ranks; see :class:`PlanReport`.

    Args:
        model: the unsharded model; not modified. Its parameters may live on the meta
            device (``with torch.device("meta"): model = ...``): only shapes and dtypes
            are read.
        example_inputs, model_kwargs: one rank's inputs of one step (its local batch);
            real or meta tensors, only their shapes and dtypes are read. The output must
            be a loss (or tensors) requiring grad: the step is its forward and backward.
        world_size: ranks in all (data-parallel ranks times ``tp``).
        hardware: a preset name (``compshard.predict.hardware.PRESETS``), a
            :class:`~compshard.predict.hardware.Hardware`, ``"measured"`` (this machine timed, on
            the current process group: collective, call on every rank; rank 0 plans and
            every rank returns its report; see :class:`~compshard.predict.hardware.Measured`), or
            a ``Measured`` timed before (planned on each rank that calls).
        options: backend options, as for ``torch.compile(..., options=...)``.
        sharding: ``compshard.shard`` keywords (``strategy``, ``param_dtype``,
            ``reduce_dtype``, ``reshard_after_forward``, ...); the mesh is built here.
        shard_group_size: ranks per shard group for ``strategy="hybrid_shard"`` (default:
            the hardware's devices per node).
        tp, tp_plan: tensor parallelism in ``tp`` consecutive ranks (one node's, where
            ``tp`` divides its devices): ``tp_plan(model)`` returns the plan
            ``parallelize_module`` applies on the mesh's ``"tp"`` dimension (a function
            defined at module level: planning under a process group pickles it), then the
            model is sharded over the ``world_size / tp`` data-parallel ranks, as
            ``docs/tensor_parallel.md`` describes. ``example_inputs`` are then one
            data-parallel rank's batch, shared by its ``tp`` ranks; tensor parallelism's
            collectives are priced at the link between the ``tp`` ranks and counted on
            the critical path.
        optimizer_states: optimizer tensors per parameter of the parameter's size (AdamW:
            2; SGD with momentum: 1).
        tokens_per_rank: tokens per rank and step for tokens/s (default: the elements of
            the first integer tensor among the inputs).
        memory_budget_gib: also plan ``candidates`` and recommend the fastest that fits
            this many GiB per rank (each candidate is planned as the main configuration is).
        candidates: (sharding, options) pairs laid over ``sharding`` and ``options``
            (default: :func:`default_candidates`).
        depth: ``"auto"``, ``"exact"`` or ``"extrapolate"`` (see the module's docstring).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compshard.plan: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"compshard.plan: world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"compshard.plan: optimizer_states must be an int >= 0, got {optimizer_states!r}")
    if memory_budget_gib is not None and not memory_budget_gib > 0:
        raise ValueError(f"compshard.plan: memory_budget_gib must be a number > 0 or None, got {memory_budget_gib!r}")
    if depth not in ("auto", "exact", "extrapolate"):
        raise ValueError(f"compshard.plan: depth={depth!r} is not allowed; use 'auto', 'exact' or 'extrapolate'")
    if shard_group_size is not None and (not isinstance(shard_group_size, int) or shard_group_size < 1):
        raise ValueError(f"compshard.plan: shard_group_size must be an int >= 1 or None, got {shard_group_size!r}")
    _check_tensor_parallel(tp, tp_plan, world_size)
    sharding, options = dict(sharding or {}), dict(options or {})
    preset = hardware_presets.PRESETS.get(hardware) if isinstance(hardware, str) else hardware
    group_size = shard_group_size or getattr(preset, "devices_per_node", None) or world_size
    setups = [(sharding, options)]
    if memory_budget_gib is not None:
        grid = candidates if candidates is not None else default_candidates(world_size // tp, group_size)
        setups += [({**sharding, **more_sharding}, {**options, **more_options}) for more_sharding, more_options in grid]
    for setup_sharding, setup_options in setups:
        _check_setup(setup_sharding, setup_options, world_size, group_size)
        if tp > 1 and setup_sharding.get("strategy", "full_shard") == "hybrid_shard":
            raise ValueError(
                "compshard.plan: strategy='hybrid_shard' with tp > 1 is not planned yet; plan "
                "'full_shard' or 'shard_grad_op' over the world_size / tp data-parallel ranks"
            )
    meta_model = _copy_model(model, _meta_like)
    inputs = torch.utils._pytree.tree_map_only(torch.Tensor, _meta_like, (example_inputs, model_kwargs))
    tokens = tokens_per_rank if tokens_per_rank is not None else _count_tokens(inputs)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    machine = hardware_presets.resolve(hardware, device, world_size)
    job = _Job(meta_model, inputs, machine, world_size, group_size, optimizer_states, tokens, depth, tp, tp_plan)
    if not dist.is_initialized():
        reports = _plan_all(job, setups)
    elif hardware == "measured":  # timed on every rank just now: they wait for rank 0's plan
        reports = _planned_on_rank0(job, setups)
    else:
        reports = _in_subprocess(_plan_all, job, setups)
    report = reports[0]
    if memory_budget_gib is not None:
        report.candidates = reports[1:]
        fitting = [r for r in report.candidates if r.fits(memory_budget_gib * GiB)]
        report.recommended = min(fitting, key=lambda r: r.step.total, default=None)
    return report


def _check_setup(sharding: dict, options: dict, world_size: int, group_size: int) -> None:
    unknown = sorted(set(sharding) - set(_SHARD_KEYWORDS))
    if unknown:
        raise ValueError(
            f"compshard.plan: unknown sharding keyword(s) {unknown}; allowed: {list(_SHARD_KEYWORDS)} "
            "(the mesh is built by plan)"
        )
    strategy = sharding.get("strategy", "full_shard")
    if strategy not in STRATEGIES:
        raise ValueError(
            f"compshard.plan: sharding strategy={strategy!r} is not allowed; use one of {list(STRATEGIES)}"
        )
    if strategy == "hybrid_shard" and (group_size < 1 or world_size % group_size or group_size == world_size):
        raise ValueError(
            f"compshard.plan: strategy='hybrid_shard' needs shard_group_size dividing world_size="
            f"{world_size} into more than one group, got {group_size}"
        )
    CompileOptions.from_dict(options)


def _check_tensor_parallel(tp: Any, tp_plan: Any, world_size: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world_size % tp:
        raise ValueError(f"compshard.plan: tp must be an int >= 1 dividing world_size={world_size}, got {tp!r}")
    if tp > 1 and not callable(tp_plan):
        raise ValueError(
            f"compshard.plan: tp={tp} needs tp_plan, a function of the model returning the plan "
            f"parallelize_module applies on mesh['tp'] (got {tp_plan!r})"
        )
    if tp == 1 and tp_plan is not None:
        raise ValueError("compshard.plan: tp_plan is given but tp=1; pass tp=<tensor-parallel ranks>")


def _count_tokens(inputs: Any) -> int:
    for leaf in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_complex():
            return leaf.numel()
    raise ValueError("compshard.plan: no integer tensor among the inputs to count tokens from; pass tokens_per_rank")


# ------------------------------------------------------------------------- model copies


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _copy_model(model: nn.Module, make: Callable[[torch.Tensor], torch.Tensor]) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are ``make(tensor)`` (ties kept)."""
    from compshard.sharding import is_sharded

    if is_sharded(model):
        raise ValueError("compshard.plan: model is already sharded; pass the unsharded model (meta parameters will do)")
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo.setdefault(id(param), nn.Parameter(make(param.detach()), requires_grad=param.requires_grad))
    for buffer in model.buffers():
        memo.setdefault(id(buffer), make(buffer))
    return copy.deepcopy(model, memo)


def _block_stack(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The longest ``ModuleList`` of blocks of one class with the same parameter shapes."""

    def signature(block: nn.Module) -> tuple:
        return type(block), tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())

    stacks = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList)
        and len(module) >= PLANNED_BLOCKS[1]
        and len({signature(block) for block in module}) == 1
    ]
    return max(stacks, key=lambda stack: len(stack[1]), default=None)


def _truncated(model: nn.Module, stack_name: str, blocks: int) -> nn.Module:
    """A copy of ``model`` (sharing its tensors) whose stack holds its first ``blocks`` blocks."""
    parent_name, _, attr = stack_name.rpartition(".")
    shallow = copy.copy(model)
    shallow._modules = dict(model._modules)
    parent = shallow
    if parent_name:  # copy the path down to the stack, so the original keeps its blocks
        for part in parent_name.split("."):
            child = copy.copy(_submodule(parent, part))
            child._modules = dict(child._modules)
            parent._modules[part] = child
            parent = child
    stack = _submodule(parent, attr)
    assert isinstance(stack, Iterable), stack_name  # a ModuleList or Sequential of the blocks
    parent._modules[attr] = nn.ModuleList(list(stack)[:blocks])
    return shallow


def _submodule(parent: nn.Module, name: str) -> nn.Module:
    """``parent``'s child ``name`` (a registered module, not a None slot)."""
    child = parent._modules[name]
    assert child is not None, name
    return child


# ------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class _Job:
    """What every configuration of one ``plan`` call shares (picklable: a subprocess gets it)."""

    meta_model: nn.Module
    inputs: tuple
    machine: Hardware | Measured
    world_size: int
    group_size: int
    optimizer_states: int
    tokens: int
    depth: str
    tp: int = 1
    tp_plan: Callable[[nn.Module], dict] | None = None


@dataclass(frozen=True)
class _Estimates:
    """One compiled schedule's figures (or a linear combination of two)."""

    peaks: dict[str, dict[str, int]]  # graph -> holder -> bytes live at that graph's peak
    forward: float
    backward: float
    communication: float
    exposed_communication: float
    tensor_parallel: float  # seconds of tensor parallelism's collectives

    def extended(self, shallower: _Estimates, blocks: int) -> _Estimates:
        """``self`` plus ``blocks`` times the difference to ``shallower`` (one block fewer)."""

        def extend(deep: float, shallow: float) -> float:
            return deep + blocks * (deep - shallow)

        peaks = {
            graph: {holder: round(extend(b, shallower.peaks[graph][holder])) for holder, b in held.items()}
            for graph, held in self.peaks.items()
        }
        return _Estimates(
            peaks,
            *(extend(getattr(self, f.name), getattr(shallower, f.name)) for f in fields(self) if f.name != "peaks"),
        )


def _in_subprocess(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` in a spawned process (a process group exists here, and a fake world
    needs a process of its own) with this process's intra-op threads, which ops timed
    there run with."""
    context = torch.multiprocessing.get_context("spawn")
    with context.Pool(1, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)) as pool:
        result = pool.apply(fn, args)
        # Let the worker exit and run its finalizers: killed by the block's terminate(),
        # it left the semaphore of the lock tqdm creates (torch.fx's Interpreter makes a
        # progress bar) for the resource tracker to report as leaked at exit.
        pool.close()
        pool.join()
    return result


def _planned_on_rank0(job: _Job, setups: list[tuple[dict, dict]]) -> list[PlanReport]:
    """Rank 0 plans (in a subprocess) while the other ranks wait, then every rank returns
    its reports or raises its error. Collective. With every rank planning, each planning
    process timed its graphs while the others compiled, timed or idled in phases of their
    own; alone, rank 0's timings are scaled to the training load by the calibration matmul
    (timed while every rank ran it) against the same matmul timed around each graph."""
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = _in_subprocess(_plan_all, job, setups)
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            outcome[0] = error
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _plan_all(job: _Job, setups: list[tuple[dict, dict]]) -> list[PlanReport]:
    in_subprocess = torch.multiprocessing.current_process().name != "MainProcess"
    reports = [_plan_setup(job, sharding, options) for sharding, options in setups]
    return [replace(report, schedule=None) for report in reports] if in_subprocess else reports


def _extrapolation(job: _Job, sharding: dict, options: CompileOptions) -> tuple[str, int] | None:
    """(the block stack's name, its length) when ``job.depth`` asks to extrapolate and the
    blocks do not couple the schedule; None to compile the whole model."""
    stack = _block_stack(job.meta_model) if job.depth != "exact" else None
    if job.depth == "extrapolate" and stack is None:
        raise ValueError(
            f"compshard.plan: depth='extrapolate' needs a ModuleList of at least {PLANNED_BLOCKS[1]} identical blocks"
        )
    if stack is None or job.depth == "extrapolate":
        return None if stack is None else (stack[0], len(stack[1]))
    dtype = sharding.get("param_dtype")
    block_bytes = sum(p.numel() * (dtype or p.dtype).itemsize for p in stack[1][0].parameters()) // job.tp
    independent = (
        options.buckets == "auto"
        and options.memory_budget_mb is None
        and not isinstance(options.recompute, dict)
        and block_bytes > options.bucket_mb * MiB
    )
    return (stack[0], len(stack[1])) if independent and len(stack[1]) >= EXTRAPOLATE_FROM else None


def _plan_setup(job: _Job, sharding: dict, options: dict) -> PlanReport:
    strategy = sharding.get("strategy", "full_shard")
    shard_size = job.group_size if strategy == "hybrid_shard" else job.world_size // job.tp
    compute_dtype = sharding.get("param_dtype") or _parameter_dtype(job.meta_model)
    extrapolation = _extrapolation(job, sharding, CompileOptions.from_dict(options))
    if extrapolation is None:
        estimates, schedule = _compile(job, job.meta_model, sharding, options, shard_size, compute_dtype)
    else:
        stack_name, blocks = extrapolation
        shallow, deep = PLANNED_BLOCKS
        shallower, _ = _compile(
            job, _truncated(job.meta_model, stack_name, shallow), sharding, options, shard_size, compute_dtype
        )
        deeper, schedule = _compile(
            job, _truncated(job.meta_model, stack_name, deep), sharding, options, shard_size, compute_dtype
        )
        estimates = deeper.extended(shallower, blocks - deep)
    shards = (
        _rank0_shards(job.meta_model, shard_size)
        if job.tp == 1
        else _tensor_parallel_shards(job, sharding, shard_size, compute_dtype)
    )
    params, tensors = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shards), len(shards)
    peak_graph = max(estimates.peaks, key=lambda graph: sum(estimates.peaks[graph].values()))
    bytes_per_second = job.machine.group_costs(range(shard_size), compute_dtype).bytes_per_second
    optimizer = _optimizer_seconds(job.machine, shards, params, job.optimizer_states, bytes_per_second)
    exposed = estimates.exposed_communication
    return PlanReport(
        world_size=job.world_size,
        hardware=job.machine.name,
        sharding=sharding,
        shard_size=shard_size,
        replicate_size=job.world_size // job.tp // shard_size,
        options=options,
        tokens_per_rank=job.tokens // job.tp,
        memory=MemoryEstimate(
            parameters=params,
            optimizer_state=job.optimizer_states * params,
            peak_graph=peak_graph,
            **estimates.peaks[peak_graph],
        ),
        step=StepEstimate(
            forward=estimates.forward,
            backward=estimates.backward,
            optimizer=optimizer,
            outside_graphs=tensors * job.machine.step_tensor_seconds,
            compute=estimates.forward + estimates.backward - exposed - estimates.tensor_parallel,
            communication=estimates.communication,
            exposed_communication=exposed,
            exposed_waits=_longest_waits(schedule),
            tensor_parallel=estimates.tensor_parallel,
        ),
        memory_capacity=job.machine.memory_bytes,
        tp=job.tp,
        extrapolated=None if extrapolation is None else (PLANNED_BLOCKS[1], extrapolation[1], extrapolation[0]),
        notes=_notes(schedule, CompileOptions.from_dict(options)),
        schedule=schedule,
    )


def _notes(schedule: Report, options: CompileOptions) -> list[str]:
    largest = max((bucket["bytes"] for bucket in schedule.buckets), default=0)
    if largest <= options.max_inflight_mb * MiB:
        return []
    return [
        f"buckets of up to {largest / MiB:,.0f} MiB exceed max_inflight_mb={options.max_inflight_mb:g}: such a "
        "bucket's all-gather may only be in flight alone, so it is not prefetched; max_inflight_mb >= "
        f"{2 * largest / MiB:,.0f} lets it overlap the previous bucket's compute"
    ]


def _parameter_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for param in model.parameters():
        if param.is_floating_point():
            counts[param.dtype] = counts.get(param.dtype, 0) + param.numel()
    return max(counts, key=counts.__getitem__, default=torch.float32)


def _rank0_shards(model: nn.Module, shard_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of rank 0's rows of every parameter."""
    params = {id(p): p for p in model.parameters()}.values()
    return [(tuple(ShardLayout(tuple(p.shape), shard_size, rank=0).local_shape), p.dtype) for p in params]


def _optimizer_seconds(
    machine: Hardware | Measured,
    shards: list[tuple[tuple[int, ...], torch.dtype]],
    params: int,
    states: int,
    bytes_per_second: float,
) -> float:
    """The optimizer step's data-bound seconds over ``shards`` (``params`` bytes): timed by
    a ``Measured`` machine where it can, else one fused AdamW-like pass (read parameter,
    gradient and states; write parameter and states) at ``bytes_per_second``."""
    timed = machine.optimizer_seconds(shards, states) if isinstance(machine, Measured) else None
    if timed is not None:
        return timed
    return (3 + 2 * states) * params / bytes_per_second


def _tensor_parallel_shards(
    job: _Job, sharding: dict, shard_size: int, compute_dtype: torch.dtype
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of rank 0's piece of every parameter of the whole model, tensor
    parallel and sharded (no compile: the pieces are read from the fake copy)."""
    model = _copy_model(job.meta_model, _fake_maker())
    with _fake_world(job.world_size, shard_size, job.machine, compute_dtype, job.tp) as mesh:
        _shard_fake(model, mesh, job.tp_plan, sharding)
    params = {id(p): p for p in model.parameters()}.values()
    return [(tuple((p._local_tensor if isinstance(p, DTensor) else p).shape), p.dtype) for p in params]


def _shard_fake(model: nn.Module, mesh: Any, tp_plan: Callable[[nn.Module], dict] | None, sharding: dict) -> None:
    """``shard`` the fake ``model`` over ``mesh``; with ``tp_plan``, ``parallelize_module`` on
    ``mesh["tp"]`` first and ``shard`` over ``mesh["dp"]``."""
    if tp_plan is not None:
        parallelize_module(model, mesh["tp"], tp_plan(model))
        mesh = mesh["dp"]
    shard(model, mesh=mesh, **sharding)


def _fake_maker() -> Callable[[torch.Tensor], torch.Tensor]:
    """A function making a fake CPU tensor like its argument (in one fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def fake_like(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")

    return fake_like


@contextlib.contextmanager
def _fake_world(
    world_size: int, shard_size: int, machine: Hardware | Measured, compute_dtype: torch.dtype, tp: int = 1
) -> Iterator[Any]:
    """A ``"fake"`` default process group of ``world_size`` ranks (this process: rank 0)
    and its mesh (2-D (replicate, shard) when ``shard_size < world_size``; (dp, tp) with
    ``tp`` > 1), whose groups have ``machine``'s constants and collective backend."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        if tp > 1:
            mesh = init_device_mesh("cpu", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
        else:
            shape = (world_size,) if shard_size == world_size else (world_size // shard_size, shard_size)
            mesh = init_device_mesh("cpu", shape)
        groups = {mesh.get_group(dim) for dim in range(mesh.ndim)}
        costs: dict[str, Costs] = {
            g.group_name: machine.group_costs(dist.get_process_group_ranks(g), compute_dtype) for g in groups
        }
        with cost_model.assumed(costs), simulated_backends(dict.fromkeys(costs, machine.collective_backend)):
            yield mesh
    finally:
        dist.destroy_process_group()


def _compile(
    job: _Job, meta_model: nn.Module, sharding: dict, options: dict, shard_size: int, compute_dtype: torch.dtype
) -> tuple[_Estimates, Report]:
    """The adapter to the backend: compile a fake copy of ``meta_model``, sharded at
    ``job.world_size`` ranks, with ``compshard.inspect``; read the schedule's estimates."""
    fake_like = _fake_maker()
    model = _copy_model(meta_model, fake_like)
    args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, fake_like, job.inputs)
    try:
        with _fake_world(job.world_size, shard_size, job.machine, compute_dtype, job.tp) as mesh:
            _shard_fake(model, mesh, job.tp_plan, sharding)
            schedule = inspect(model, *args, options=options, **kwargs)
            kinds = {name: name.partition(".")[0] for name in schedule.graphs}  # "forward.1" -> "forward"
            # Inside the fake world: a collective's backend scratch (gloo's) is known only
            # while its simulated process group exists; outside it would count as none.
            peaks = {name: _peak_breakdown(gm, kinds[name] == "backward") for name, gm in schedule.graphs.items()}
            if "backward" not in kinds.values():
                raise ValueError(
                    "compshard.plan: the model's output does not require grad; plan predicts a training step"
                )
            _price_with_timings(schedule, job.machine)
            tensor_parallel = _price_tensor_parallel(schedule)
    finally:
        torch._dynamo.reset()  # planning's compiled code (on fake tensors) is of no further use
    timelines = schedule.timelines
    return _Estimates(
        peaks=peaks,
        forward=sum(timelines[name].total for name, kind in kinds.items() if kind == "forward"),
        backward=sum(timelines[name].total for name, kind in kinds.items() if kind == "backward"),
        communication=sum(t.comm for t in timelines.values()),
        exposed_communication=sum(t.exposed_comm for t in timelines.values()),
        tensor_parallel=tensor_parallel,
    ), schedule


def _price_with_timings(schedule: Report, machine: Hardware | Measured) -> None:
    """Where the machine times ops (``"measured"``), the timings replace the scheduled
    graphs' compute estimates, and the timelines are simulated again. A graph whose every
    compute op was timed is also run end to end, and its ops' timings are scaled to that
    run (what the graph's own code and the ops' cold caches add is spread over its ops in
    proportion). Call inside the fake world: the runs issue its collectives."""
    timed = False
    for gm in schedule.graphs.values():
        timings, untimed = {}, False
        for node in gm.graph.nodes:
            if _kind(node) not in (*COLLECTIVE_KINDS, "wait", "free"):
                seconds = machine.op_seconds(node)
                if seconds is not None:
                    timings[node] = seconds
                elif isinstance(node.target, torch._ops.OpOverload):
                    untimed = True
        run = None if untimed or not timings else machine.graph_seconds(gm)
        scale = run / sum(timings.values()) if run else 1.0
        for node, seconds in timings.items():
            set_node_meta(node, seconds=seconds * scale)
        timed = timed or bool(timings)
    if timed:
        schedule.timelines = {kind: simulate(gm.graph) for kind, gm in schedule.graphs.items()}


_PROGRAM_COLLECTIVE_KINDS = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter"}


def _price_tensor_parallel(schedule: Report) -> float:
    """Price tensor parallelism's collectives (the program's: ``fx_utils.program_collective``)
    at their group's constants, its full buffer moved (the larger of input and output;
    twice for an all-reduce), and simulate the timelines again; they stay on the compute
    stream, which waits for each (DTensor waits at once). Their seconds in all. Call
    inside the fake world, whose groups' constants ``cost_model.costs_for`` reads."""
    total = 0.0
    for gm in schedule.graphs.values():
        for node in gm.graph.nodes:
            if program_collective(node):
                moved = max(nbytes(value.meta.get("val")) for value in (node, *node.all_input_nodes))
                kind = _PROGRAM_COLLECTIVE_KINDS.get(node.target._opname, "all_gather")
                seconds = collective_seconds(moved, cost_model.costs_for(op_arg(node, "group_name")), kind)
                set_node_meta(node, seconds=seconds)
                total += seconds
    if total:
        schedule.timelines = {kind: simulate(gm.graph) for kind, gm in schedule.graphs.items()}
    return total


def _longest_waits(schedule: Report, count: int = 3) -> tuple[tuple[str, str, float], ...]:
    """The ``count`` longest waits of compute for a collective: (graph, bucket, seconds)."""
    waits = []
    for kind, timeline in schedule.timelines.items():
        nodes = {node.name: node for node in schedule.graphs[kind].graph.nodes}
        for span in timeline.spans:
            if span.kind == "wait" and span.end > span.start:
                meta = node_meta(nodes[span.name])
                waits.append((kind, meta.bucket or meta.unit, span.end - span.start))
    return tuple(sorted(waits, key=lambda wait: -wait[2])[:count])


# ------------------------------------------------------------------------- memory at the peak


def _peak_breakdown(gm: fx.GraphModule, count_inputs: bool) -> dict[str, int]:
    """The storages live while the graph's peak node runs (as the memory model counts
    them, inputs counted when ``count_inputs``: a backward's, but for those the caller
    holds, ``memory_model.mark_held_outside``), summed by what holds them."""
    events = storages(gm.graph, count_inputs=count_inputs)
    started = {
        meta.collective: meta.kind for node in events.nodes if (meta := node_meta(node)).kind in COLLECTIVE_KINDS
    }
    awaiting_reduction = {
        root
        for node in events.nodes
        if _side(node, started) == "reduce" and _kind(node) == "pack"
        for root in (events.roots.get(i) for i in node.all_input_nodes)
        if root is not None
    }
    spans = []  # (first index live, last index live, bytes, holder)
    for node in events.nodes:
        if events.roots[node] is node:
            spans.append(
                (
                    events.order[producer(node)],
                    events.release_index(node),
                    nbytes(node.meta.get("val")),
                    _holder(node, started, awaiting_reduction),
                )
            )
        scratch = backend_scratch_bytes(node)
        if scratch:
            spans.append((events.order[node], events.order[next(iter(node.users))], scratch, "collective_buffers"))
    change = [0] * (len(events.nodes) + 1)
    for first, last, size, _ in spans:
        change[first] += size
        change[last + 1] -= size
    live, peak, peak_index = 0, 0, 0
    for index in range(len(events.nodes)):
        live += change[index]
        if live > peak:
            peak, peak_index = live, index
    totals = dict.fromkeys(_HOLDERS, 0)
    for first, last, size, holder in spans:
        if first <= peak_index <= last:
            totals[holder] += size
    return totals


def _kind(node: fx.Node) -> str | None:
    return node_meta(node).kind


def _side(node: fx.Node, started: Mapping[str | None, str]) -> str | None:
    """``"gather"`` or ``"reduce"``: which lowering made a scheduled node; None for others.
    A node whose collective never starts is a local cast: of a parameter when it has no
    collective label, else of a gradient."""
    meta = node_meta(node)
    if meta.kind is None:
        return None
    kind = started.get(meta.collective)
    if kind is None:
        return "gather" if meta.collective is None else "reduce"
    return "gather" if kind == "all_gather" else "reduce"


def _holder(root: fx.Node, started: Mapping[str | None, str], awaiting_reduction: set[fx.Node]) -> str:
    if root.op == "placeholder":  # backward inputs: activations saved by forward, tangents
        return "activations"
    side = _side(root, started) or _side(producer(root), started)
    if side == "gather":
        return "gathered_parameters"
    if side == "reduce":
        return "gradients" if (_kind(root) or _kind(producer(root))) == "unpack" else "collective_buffers"
    return "gradients" if root in awaiting_reduction else "activations"
