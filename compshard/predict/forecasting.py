"""``compshard.forecast``: predict per-rank memory and step time at N ranks, without the ranks.

How: a copy of the model whose parameters are fake tensors (shapes and dtypes, no
storage) is sharded with ``compshard.shard`` over a ``"fake"`` process group
(:mod:`~compshard.predict.fake_world`) and compiled with the compshard backend through
``compshard.inspect``: the passes build the schedule they would build on rank 0 of N real
ranks, deciding with the cost model's constants for the chosen hardware
(:mod:`~compshard.predict.hardware`). The prediction reads that schedule
(:mod:`~compshard.predict.estimates`):

- memory per rank: parameter shards and optimizer state at rest, plus the estimated bytes
  live at the step's peak, split by what holds them (:mod:`~compshard.predict.peak_memory`);
- step time: the estimated forward and backward timelines, plus the optimizer's bytes at
  memory bandwidth (one fused pass), plus the machine's seconds per parameter tensor for
  the host work outside the graphs (:mod:`~compshard.predict.pricing`;
  ``hardware="measured"`` times that host work, the graphs' ops and torch's optimizer on
  rank 0's shard shapes instead of estimating them; see
  :class:`~compshard.predict.hardware.Measured`).

A deep model is forecast from shallower copies (:mod:`~compshard.predict.depth`).

A forecast runs in this process when no process group is initialized (it creates and
destroys its own fake one, and resets Dynamo's caches afterwards); otherwise in a spawned
subprocess, which needs the model's class importable there (with ``hardware="measured"``,
on rank 0 only: every rank returns its report).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.comm.layout import ShardLayout
from compshard.compile_plan import MiB
from compshard.cost_model import Costs
from compshard.inspection import Report
from compshard.module_tree import module_of, repeated_block, repeated_containers
from compshard.options import CompileOptions
from compshard.predict import hardware as hardware_presets
from compshard.predict.depth import COMPILED_BLOCKS, Depth, extrapolated, stack_to_extrapolate
from compshard.predict.estimates import Estimates, estimate
from compshard.predict.fake_world import FakeWorld, copy_model, fake_maker, meta_like
from compshard.predict.forecast_report import Forecast, GiB, MemoryEstimate, ShardKeywords, StepEstimate
from compshard.predict.hardware import Hardware, Measured
from compshard.predict.pricing import longest_waits, optimizer_seconds

__all__ = ["default_candidates", "forecast", "plan"]

Setup = tuple[ShardKeywords, CompileOptions]  # one configuration to forecast


def default_candidates(world_size: int, devices_per_node: int) -> list[tuple[dict, dict]]:
    """The (sharding, options) grid ``peak_limit_mb`` searches: each recompute policy
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


def forecast(
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
    peak_limit_mb: float | None = None,
    candidates: Sequence[tuple[dict, dict]] | None = None,
    depth: Depth = "auto",
    **model_kwargs: Any,
) -> Forecast:
    """Predict one training step of ``model`` at ``world_size`` ranks; see :class:`Forecast`.

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
            the current process group: collective, call on every rank; rank 0 forecasts
            and every rank returns its report; see :class:`~compshard.predict.hardware.Measured`), or
            a ``Measured`` timed before (forecast on each rank that calls).
        options: backend options, as for ``torch.compile(..., options=...)``.
        sharding: ``compshard.shard`` keywords (``strategy``, ``param_dtype``,
            ``reduce_dtype``, ``reshard_after_forward``, ...); the mesh is built here.
        shard_group_size: ranks per shard group for ``strategy="hybrid_shard"`` (default:
            the hardware's devices per node).
        tp, tp_plan: tensor parallelism in ``tp`` consecutive ranks (one node's, where
            ``tp`` divides its devices): ``tp_plan(model)`` returns the plan
            ``parallelize_module`` applies on the mesh's ``"tp"`` dimension (a function
            defined at module level: a forecast under a process group pickles it), then the
            model is sharded over the ``world_size / tp`` data-parallel ranks, as
            ``docs/tensor_parallel.md`` describes. ``example_inputs`` are then one
            data-parallel rank's batch, shared by its ``tp`` ranks; tensor parallelism's
            collectives are priced at the link between the ``tp`` ranks and counted on
            the critical path.
        optimizer_states: optimizer tensors per parameter of the parameter's size (AdamW:
            2; SGD with momentum: 1).
        tokens_per_rank: tokens per rank and step for tokens/s (default: the elements of
            the first integer tensor among the inputs).
        peak_limit_mb: also forecast ``candidates`` and recommend the fastest whose
            peak fits this many MiB per rank (MiB: the unit of every memory option;
            each candidate is forecast as the main configuration is).
        candidates: (sharding, options) pairs laid over ``sharding`` and ``options``
            (default: :func:`default_candidates`).
        depth: ``"auto"``, ``"exact"`` or ``"extrapolate"`` (see :mod:`compshard.predict.depth`).
    """
    _check_arguments(model, world_size, optimizer_states, peak_limit_mb, depth, shard_group_size)
    _check_tensor_parallel(tp, tp_plan, world_size)
    preset = hardware_presets.PRESETS.get(hardware) if isinstance(hardware, str) else hardware
    group_size = shard_group_size or getattr(preset, "devices_per_node", None) or world_size
    layers: list[tuple[dict, dict]] = [({}, {})]  # laid over sharding and options
    if peak_limit_mb is not None:
        layers += candidates if candidates is not None else default_candidates(world_size // tp, group_size)
    setups = [
        _setup({**(sharding or {}), **more_sharding}, {**(options or {}), **more_options}, world_size, group_size, tp)
        for more_sharding, more_options in layers
    ]
    meta_model = copy_model(model, meta_like)
    inputs = torch.utils._pytree.tree_map_only(torch.Tensor, meta_like, (example_inputs, model_kwargs))
    tokens = tokens_per_rank if tokens_per_rank is not None else _count_tokens(inputs)
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    machine = hardware_presets.resolve(hardware, device, world_size)
    job = _Job(meta_model, inputs, machine, world_size, group_size, optimizer_states, tokens, depth, tp, tp_plan)
    if not dist.is_initialized():
        reports = _forecast_all(job, setups)
    elif hardware == "measured":  # timed on every rank just now: they wait for rank 0's forecast
        reports = _forecast_on_rank0(job, setups)
    else:
        reports = _in_subprocess(_forecast_all, job, setups)
    report = reports[0]
    if peak_limit_mb is not None:
        report.candidates = reports[1:]
        fitting = [r for r in report.candidates if r.fits(peak_limit_mb * MiB)]
        report.recommended = min(fitting, key=lambda r: r.step.total, default=None)
    return report


def plan(*example_inputs: Any, memory_budget_gib: float | None = None, **keywords: Any) -> Forecast:
    """Deprecated name of :func:`forecast` (a *plan* is the compiler's; a forecast predicts);
    ``memory_budget_gib`` is ``forecast``'s ``peak_limit_mb`` in GiB."""
    warnings.warn(
        "compshard.plan is deprecated: call compshard.forecast (memory_budget_gib=G is peak_limit_mb=G * 1024)",
        FutureWarning,
        stacklevel=2,
    )
    if memory_budget_gib is not None:
        keywords["peak_limit_mb"] = memory_budget_gib * GiB / MiB
    return forecast(*example_inputs, **keywords)


def _check_arguments(
    model: Any,
    world_size: Any,
    optimizer_states: Any,
    peak_limit_mb: Any,
    depth: Any,
    shard_group_size: Any,
) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"compshard.forecast: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"compshard.forecast: world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(optimizer_states, int) or optimizer_states < 0:
        raise ValueError(f"compshard.forecast: optimizer_states must be an int >= 0, got {optimizer_states!r}")
    if peak_limit_mb is not None and not peak_limit_mb > 0:
        raise ValueError(f"compshard.forecast: peak_limit_mb must be a number > 0 or None, got {peak_limit_mb!r}")
    if depth not in ("auto", "exact", "extrapolate"):
        raise ValueError(f"compshard.forecast: depth={depth!r} is not allowed; use 'auto', 'exact' or 'extrapolate'")
    if shard_group_size is not None and (not isinstance(shard_group_size, int) or shard_group_size < 1):
        raise ValueError(f"compshard.forecast: shard_group_size must be an int >= 1 or None, got {shard_group_size!r}")


def _check_tensor_parallel(tp: Any, tp_plan: Any, world_size: int) -> None:
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1 or world_size % tp:
        raise ValueError(f"compshard.forecast: tp must be an int >= 1 dividing world_size={world_size}, got {tp!r}")
    if tp > 1 and not callable(tp_plan):
        raise ValueError(
            f"compshard.forecast: tp={tp} needs tp_plan, a function of the model returning the plan "
            f"parallelize_module applies on mesh['tp'] (got {tp_plan!r})"
        )
    if tp == 1 and tp_plan is not None:
        raise ValueError("compshard.forecast: tp_plan is given but tp=1; pass tp=<tensor-parallel ranks>")


def _setup(sharding: dict, options: dict, world_size: int, group_size: int, tp: int) -> Setup:
    """One configuration's sharding keywords and options, checked."""
    keywords = ShardKeywords.from_dict(sharding)
    hybrid = keywords.strategy == "hybrid_shard"
    if hybrid and (group_size < 1 or world_size % group_size or group_size == world_size):
        raise ValueError(
            f"compshard.forecast: strategy='hybrid_shard' needs shard_group_size dividing world_size="
            f"{world_size} into more than one group, got {group_size}"
        )
    compile_options = CompileOptions.from_dict(options)
    if hybrid and tp > 1:
        raise ValueError(
            "compshard.forecast: strategy='hybrid_shard' with tp > 1 is not forecast yet; forecast "
            "'full_shard' or 'shard_grad_op' over the world_size / tp data-parallel ranks"
        )
    return keywords, compile_options


def _count_tokens(inputs: Any) -> int:
    for leaf in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(leaf, torch.Tensor) and not leaf.is_floating_point() and not leaf.is_complex():
            return leaf.numel()
    raise ValueError(
        "compshard.forecast: no integer tensor among the inputs to count tokens from; pass tokens_per_rank"
    )


@dataclass(frozen=True)
class _Job:
    """What every configuration of one ``forecast`` call shares (picklable: a subprocess gets it)."""

    meta_model: nn.Module
    inputs: tuple[tuple, dict]  # positional and keyword, meta tensors
    machine: Hardware | Measured
    world_size: int
    group_size: int
    optimizer_states: int
    tokens: int
    depth: str
    tp: int = 1
    tp_plan: Callable[[nn.Module], dict] | None = None


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


def _forecast_on_rank0(job: _Job, setups: list[Setup]) -> list[Forecast]:
    """Rank 0 forecasts (in a subprocess) while the other ranks wait, then every rank returns
    its reports or raises its error. Collective. With every rank forecasting, each
    forecasting process timed its graphs while the others compiled, timed or idled in phases of their
    own; alone, rank 0's timings are scaled to the training load by the calibration matmul
    (timed while every rank ran it) against the same matmul timed around each graph."""
    outcome: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = _in_subprocess(_forecast_all, job, setups)
        except Exception as error:  # noqa: BLE001 - raised on every rank below
            outcome[0] = error
    dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    return outcome[0]


def _forecast_all(job: _Job, setups: list[Setup]) -> list[Forecast]:
    in_subprocess = torch.multiprocessing.current_process().name != "MainProcess"
    reports = [_forecast_setup(job, sharding, options) for sharding, options in setups]
    return [replace(report, schedule=None) for report in reports] if in_subprocess else reports


def _forecast_setup(job: _Job, sharding: ShardKeywords, options: CompileOptions) -> Forecast:
    shard_size = job.group_size if sharding.strategy == "hybrid_shard" else job.world_size // job.tp
    compute_dtype = sharding.param_dtype or _parameter_dtype(job.meta_model)
    world = FakeWorld(job.world_size, shard_size, job.machine, compute_dtype, job.tp, job.tp_plan)

    def estimate_of(model: nn.Module) -> tuple[Estimates, Report]:
        return estimate(model, job.inputs, world, sharding, options)

    stack = stack_to_extrapolate(job.meta_model, job.depth, options, sharding.param_dtype, job.tp)
    if stack is None:
        estimates, schedule = estimate_of(job.meta_model)
    else:
        estimates, schedule = extrapolated(job.meta_model, stack, estimate_of)
    shards = (
        _rank0_shards(job.meta_model, shard_size)
        if job.tp == 1
        else _tensor_parallel_shards(job.meta_model, world, sharding)
    )
    params, tensors = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shards), len(shards)
    peak_graph = max(estimates.peaks, key=lambda graph: sum(estimates.peaks[graph].values()))
    group_costs = job.machine.group_costs(range(shard_size), compute_dtype)
    bytes_per_second = group_costs.bytes_per_second
    held, step_gather = _held_parameters(job.meta_model, sharding, compute_dtype, group_costs)
    exposed = estimates.exposed_communication
    return Forecast(
        world_size=job.world_size,
        hardware=job.machine.name,
        sharding=sharding,
        shard_size=shard_size,
        replicate_size=job.world_size // job.tp // shard_size,
        options=options,
        tokens_per_rank=job.tokens // job.tp,
        memory=MemoryEstimate(
            parameters=params + held,
            optimizer_state=job.optimizer_states * params,
            peak_graph=peak_graph,
            **estimates.peaks[peak_graph],
        ),
        step=StepEstimate(
            forward=estimates.forward,
            backward=estimates.backward,
            optimizer=optimizer_seconds(job.machine, shards, params, job.optimizer_states, bytes_per_second),
            outside_graphs=tensors * job.machine.step_tensor_seconds,
            compute=estimates.forward
            + estimates.backward
            - exposed
            - estimates.tensor_parallel
            - estimates.expert_parallel,
            communication=estimates.communication,
            exposed_communication=exposed,
            exposed_waits=longest_waits(schedule),
            tensor_parallel=estimates.tensor_parallel,
            expert_parallel=estimates.expert_parallel,
            step_gather=step_gather,
        ),
        memory_capacity=job.machine.memory_bytes,
        tp=job.tp,
        extrapolated=None if stack is None else (COMPILED_BLOCKS[1], stack[1], stack[0]),
        notes=_notes(schedule, options),
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


def _held_parameters(
    model: nn.Module, sharding: ShardKeywords, compute_dtype: torch.dtype, costs: Costs
) -> tuple[int, float]:
    """(bytes, seconds) of the full parameters ``"shard_optimizer"`` holds on each rank and
    of their all-gathers after each update (one per repeated block and one for the rest,
    as ``compshard.sharding.held_params`` buckets them); (0, 0.0) for other strategies."""
    if sharding.strategy != "shard_optimizer":
        return 0, 0.0
    params = {id(p): p for p in model.parameters()}.values()
    held = sum(p.numel() for p in params) * compute_dtype.itemsize
    containers = repeated_containers(module_of(name) for name, _ in model.named_parameters())
    units = {repeated_block(module_of(name), containers) for name, _ in model.named_parameters()}
    return held, len(units) * costs.alpha + held * costs.beta


def _rank0_shards(model: nn.Module, shard_size: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of rank 0's rows of every parameter."""
    params = {id(p): p for p in model.parameters()}.values()
    return [(tuple(ShardLayout(tuple(p.shape), shard_size, rank=0).local_shape), p.dtype) for p in params]


def _tensor_parallel_shards(
    meta_model: nn.Module, world: FakeWorld, sharding: ShardKeywords
) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of rank 0's piece of every parameter of the whole model, tensor
    parallel and sharded (no compile: the pieces are read from the fake copy)."""
    model = copy_model(meta_model, fake_maker())
    with world.sharded(model, sharding):
        params = {id(p): p for p in model.parameters()}.values()
        return [(tuple((p._local_tensor if isinstance(p, DTensor) else p).shape), p.dtype) for p in params]
