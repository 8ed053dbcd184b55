"""``compshard.pipeline``: pipeline-parallel training over stages cut by a graph pass.

The forward is captured and cut into ``stages`` contiguous stages balanced by estimated
cost (``compshard.pipelining.stages``); each rank runs one stage with
``torch.distributed.pipelining`` (``PipelineStage`` and its ``ScheduleGPipe`` /
``Schedule1F1B``) over ``microbatches`` micro-batches. With more ranks than stages the
ranks form a 2-D mesh ``(pp, dp)``: every stage is replicated over ``dp`` ranks, and each
replica's stage module is sharded over them with ``compshard.shard`` (ZeRO-3 inside the
stage, pipeline across stages).

Each stage module (an FX graph of ATen ops) is compiled with the compshard backend
(``compile=True``, the default; ``compile_options`` are the backend's options), which
schedules its all-gathers; ``compile=False`` runs it eagerly, each parameter read a
blocking all-gather. A stage whose graphs would gather nothing (``per_step`` below, or
an unsharded stage) leaves compshard nothing to schedule: unless the options ask for
recompute, a memory budget or Inductor's codegen, it is not compiled but runs as built,
under eager autograd (:func:`compiles_stage`).

When a sharded stage gathers its parameters is the ``reshard`` option (see
:data:`RESHARD_MODES`), a choice of memory against communication:

- ``"per_step"`` (the default): the stage's parameters are all-gathered once, on entry to
  ``step`` (:func:`compshard.sharding.gathered_for_step`: one all-gather per bucket of
  at most the compile option ``bucket_mb`` of full parameters, in registration order, the
  same on every rank), every micro-batch's forward and backward reads them (its graphs
  hold no collective), and each is freed as its gradient is taken for the end-of-step
  reduction. The stage's full parameters are held for the whole step (``dp`` times its
  shards), as FSDP2 holds a root unit under torch's pipeline schedules; nothing is
  gathered while computing. The default: the faster mode where the stage's parameters
  fit, at little more peak memory (``benchmarks/results/pipeline_cpu2core_202611.md``).
- ``"per_microbatch"``: each of the ``M`` micro-batches gathers what its forward reads,
  and again what its backward reads (compiled: in buckets, prefetched and freed after
  their last use, as the compshard backend schedules any model; eager: one blocking
  all-gather per parameter read), holding only the buckets in use: up to ``2 M``
  gathers of each bucket per step.

Gradients of a sharded stage are reduced once per step, not once per micro-batch: the
backwards of the ``M`` micro-batches accumulate the full gradient of every parameter
locally (``per_step``: on the gathered parameters; ``per_microbatch``: with gradient
sync off, :func:`compshard.no_sync`), and after the schedule
:func:`compshard.sharding.reduce_accumulated_gradients` reduce-scatters the sums once,
in buckets of consecutive parameters (registration order, the same on every rank of the
stage's ``dp`` group; at most the compile option ``bucket_mb`` of full gradients each),
divided by ``M`` as the schedule's mean asks.
Trade-off: one reduce-scatter per bucket and step instead of one per bucket and
micro-batch (and none inside the compiled backwards, so none overlaps backward compute),
for one *full-size* gradient per parameter of the stage held from its first backward to
the end of the step (``dp`` times the sharded gradient), as DDP holds.

Tied parameters whose uses fall in different stages (GPT's ``wte.weight`` /
``lm_head.weight``) are held by each of those stages; after the backward their gradients
are summed across those stages (an all-reduce over the ranks that hold them), so every
copy takes the same optimizer step and they stay equal.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from compshard import cost_model
from compshard.backend import asks_for_graph_work
from compshard.options import CompileOptions
from compshard.pipelining.stages import StageSplit, build_stage_module, split_stages, stage_io_meta
from compshard.sharding import gathered_for_step, no_sync, reduce_accumulated_gradients, shard
from compshard.torch_compat import TORCH_2_13

__all__ = [
    "Pipeline",
    "PipelineReport",
    "RESHARD_MODES",
    "Reshard",
    "SCHEDULES",
    "bubble_fraction",
    "StepLoss",
    "compiles_stage",
    "pipeline",
    "sum_tied_gradients",
    "tied_gradient_groups",
]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

Reshard = Literal["per_step", "per_microbatch"]
RESHARD_MODES: tuple[str, ...] = get_args(Reshard)  # when a sharded stage frees its gathered parameters


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of each rank's time in GPipe and 1F1B: ``(K - 1) / (M + K - 1)``
    (``K`` stages, ``M`` micro-batches, stages of equal cost)."""
    return (stages - 1) / (microbatches + stages - 1)


@dataclass
class PipelineReport:
    """What ``Pipeline.describe()`` returns; ``str()`` shows the stages and the schedule."""

    split: StageSplit
    schedule: str
    microbatches: int
    data_parallel: int  # ranks sharding each stage
    compiled: bool  # stages compiled with the compshard backend (else run as built, eagerly)
    reshard: str  # when a sharded stage's gathered parameters are freed (RESHARD_MODES)
    nothing_to_compile: bool = False  # compile=True, but the stages run as built (compiles_stage)

    @property
    def bubble_fraction(self) -> float:
        return bubble_fraction(len(self.split.stages), self.microbatches)

    def __str__(self) -> str:
        stages = len(self.split.stages)
        note = " (compile=True, nothing to schedule: run as built)" if self.nothing_to_compile else ""
        header = (
            f"pipeline: {stages} {'compiled' if self.compiled else 'eager'} stages x {self.data_parallel} "
            f"data-parallel shards{note}, schedule {self.schedule}, "
            f"{self.microbatches} micro-batches, bubble fraction (K-1)/(M+K-1) = "
            f"{stages - 1}/{self.microbatches + stages - 1} = {self.bubble_fraction:.3f}"
        )
        if self.data_parallel > 1:
            header += f"\nparameters gathered {self.reshard.replace('_', ' ')}"
        return f"{header}\n{self.split}"


class Pipeline:
    """This rank's stage of a pipelined model; build it with :func:`pipeline`.

    Attributes:
        module: this rank's stage module. Its ``named_parameters()`` use the original
            model's names (sharded over the ``dp`` ranks when there are several): give
            them to the optimizer, and save its ``state_dict()`` for checkpoints.
        stage_index: which stage this rank runs.
        split: the cut, for every stage (see :meth:`describe`).
    """

    def __init__(
        self,
        split: StageSplit,
        loss_fn: Callable,
        *,
        schedule: str,
        microbatches: int,
        mesh: DeviceMesh,
        device: torch.device,
        input_shapes: list[torch.Size],
        compile_options: dict[str, Any] | None,
        reshard: Reshard,
    ) -> None:
        self.split = split
        self._input_shapes = input_shapes
        self._schedule_name = schedule
        self._microbatches = microbatches
        self._data_parallel = mesh["dp"].size() if mesh.ndim == 2 else 1
        self.stage_index = mesh["pp"].get_local_rank()
        self._stages = len(split.stages)
        self.module: fx.GraphModule = build_stage_module(split, self.stage_index)
        split.release_tensors()  # the stage module holds this rank's; sharding may replace them
        self._sharded = self._data_parallel > 1
        if self._sharded:
            shard(self.module, mesh=mesh["dp"])
        options = CompileOptions.from_dict(compile_options).for_devices([device])
        self._compile_requested = compile_options is not None
        self._compiled = self._compile_requested and compiles_stage(options, self._sharded, reshard)
        self._reshard = reshard
        self._bucket_bytes = int(options.bucket_mb * 2**20)
        runner = (
            torch.compile(self.module, backend="compshard", options=compile_options) if self._compiled else self.module
        )
        # Torch 2.11's PipelineStage infers shapes by running the stage once without
        # gradients, which compiles an extra graph; the captured shapes make that needless.
        # Torch 2.13 infers them from the first step's real forward instead.
        inputs_meta, outputs_meta = (None, None) if TORCH_2_13 else stage_io_meta(split, self.stage_index)
        # torch.compile of a Module returns an OptimizedModule (a Module); its stub says Callable
        stage = PipelineStage(
            runner,  # type: ignore[arg-type]
            self.stage_index,
            self._stages,
            device,
            input_args=inputs_meta,
            output_args=outputs_meta,
            group=mesh["pp"].get_group(),
        )
        # A sharded stage divides by M in its one reduction per step; the schedule's own
        # division would find no gradient yet.
        self._schedule = SCHEDULES[schedule](stage, microbatches, loss_fn=loss_fn, scale_grads=not self._sharded)
        self._tied = tied_gradient_groups(split, mesh, dict(self.module.named_parameters()))
        self._step_loss = StepLoss(mesh)

    def step(self, inputs: torch.Tensor | Sequence[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over all micro-batches; gradients are left in
        ``module``'s parameters (summed over micro-batches as the mean loss asks; a
        sharded stage reduces them once, at the end).

        ``inputs`` (the model's positional inputs) and ``targets`` are this data-parallel
        replica's batch, split along dim 0 into the micro-batches; every rank passes them
        (only the first stage reads ``inputs``, only the last ``targets``). Returns the mean
        loss over the micro-batches and data-parallel replicas, on every rank. Inputs
        are made contiguous first (a slice such as ``tokens[:, :-1]`` is not), since
        torch's pipelining checks each micro-batch's strides against the stage's.
        """
        args = tuple(a.contiguous() for a in _as_tuple(inputs))
        if [a.shape for a in args] != self._input_shapes:
            raise ValueError(
                f"compshard.pipeline: step() inputs have shapes {[tuple(a.shape) for a in args]}; the stages were "
                f"captured for {[tuple(s) for s in self._input_shapes]} (example_inputs)"
            )
        is_first, is_last = self.stage_index == 0, self.stage_index == self._stages - 1
        losses: list[torch.Tensor] = []
        with self._accumulating_gradients():
            self._schedule.step(
                *(args if is_first else ()),
                target=targets if is_last else None,
                losses=losses if is_last else None,
                return_outputs=False,
            )
            if self._sharded:
                reduce_accumulated_gradients(self.module, divide_by=self._microbatches, bucket_bytes=self._bucket_bytes)
        sum_tied_gradients(self._tied)
        return self._step_loss(losses, targets.device)

    def _accumulating_gradients(self) -> contextlib.AbstractContextManager[object]:
        """The block in which a sharded stage's micro-batches accumulate full gradients
        locally, as ``reshard`` says: on the parameters gathered for the step, or with
        gradient sync off."""
        if not self._sharded:
            return contextlib.nullcontext()
        if self._reshard == "per_step":
            return gathered_for_step(self.module, bucket_bytes=self._bucket_bytes)
        return no_sync(self.module)

    def describe(self) -> PipelineReport:
        """The stages (modules, ops, estimated forward cost, parameter memory before
        sharding) and the schedule's bubble fraction."""
        return PipelineReport(
            self.split,
            self._schedule_name,
            self._microbatches,
            self._data_parallel,
            self._compiled,
            self._reshard,
            self._compile_requested and not self._compiled,
        )


def tied_gradient_groups(
    split: StageSplit,
    mesh: DeviceMesh,
    params: Mapping[str, nn.Parameter],
) -> list[tuple[nn.Parameter, dist.ProcessGroup]]:
    """For each tied parameter this rank's stage holds (``params``: its parameters by
    name): the group of ranks (same ``dp`` index, the stages holding it) its gradient is
    summed over. Every rank creates every group, in the same order, as ``new_group``
    requires."""
    stages = mesh["pp"].size()
    stage_index = mesh["pp"].get_local_rank()
    ranks = mesh.mesh.reshape(stages, -1)
    dp_index = mesh["dp"].get_local_rank() if mesh.ndim == 2 else 0
    created: dict[tuple[int, ...], dist.ProcessGroup] = {}
    groups = []
    for name, holders in split.tied.items():
        for column in range(ranks.shape[1]):
            members = tuple(int(ranks[s, column]) for s in holders)
            if members not in created:
                created[members] = dist.new_group(list(members))
            if stage_index in holders and column == dp_index:
                groups.append((params[name], created[members]))
    return groups


def sum_tied_gradients(groups: list[tuple[nn.Parameter, dist.ProcessGroup]]) -> None:
    """Sum each tied parameter's gradient (this rank's rows) over its group of stages, so
    every copy takes the same optimizer step (``groups``: :func:`tied_gradient_groups`)."""
    with torch.no_grad():
        for param, group in groups:
            assert param.grad is not None, "sum_tied_gradients runs after the step's backward"
            dist.all_reduce(_local(param.grad), group=group)


class StepLoss:
    """The step's loss on every rank: the mean of the last stage's micro-batch losses
    (an empty list on other stages), broadcast along ``pp`` and averaged over the ``dp``
    replicas. The mesh's ``pp`` and ``dp`` groups are looked up once, here: slicing a
    ``DeviceMesh`` runs its layout algebra in Python, a cost a step would otherwise pay
    for every slice."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self._pp_group = mesh["pp"].get_group()
        self._last_stage = mesh["pp"].size() - 1
        replicas = mesh["dp"].size() if mesh.ndim == 2 else 1
        self._dp_group = mesh["dp"].get_group() if replicas > 1 else None
        self._replicas = replicas

    def __call__(self, losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        with torch.no_grad():
            loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)
            loss = loss.detach().to(torch.float32)
            dist.broadcast(loss, group=self._pp_group, group_src=self._last_stage)
            if self._dp_group is not None:
                dist.all_reduce(loss, group=self._dp_group)
                loss /= self._replicas
        return loss


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _as_tuple(inputs: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("compshard.pipeline: inputs must be a tensor or a non-empty sequence of tensors")
    return args


def _positive_int(option: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"compshard.pipeline: {option} must be an int >= 1, got {value!r}")
    return value


def _compile_options(compile: bool, compile_options: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The backend options to compile the stages with, validated now; ``None``: run eagerly."""
    if not isinstance(compile, bool):
        raise TypeError(f"compshard.pipeline: compile must be True or False, got {compile!r}")
    if compile_options is None:
        return {} if compile else None
    if not isinstance(compile_options, Mapping):
        raise TypeError(
            f"compshard.pipeline: compile_options must be a dict of backend options or None, "
            f"got {type(compile_options).__name__}"
        )
    if not compile:
        raise ValueError(
            "compshard.pipeline: compile_options are the compshard backend's options; they need "
            "compile=True (got compile=False)"
        )
    CompileOptions.from_dict(compile_options)  # raises naming the bad option
    return dict(compile_options)


def compiles_stage(options: CompileOptions, sharded: bool, reshard: str) -> bool:
    """Whether ``compile=True`` compiles a stage: where its graphs gather parameters (a
    sharded stage, ``reshard="per_microbatch"``) or the compile ``options`` ask for graph
    work (``backend.asks_for_graph_work``). Otherwise the graphs would hold no compshard
    op and the backend would hand Dynamo's capture back to run as captured
    (``backend.schedules_nothing``); the stage module, an FX graph of the same capture,
    runs as built instead, without Dynamo's guards and frame on every call."""
    return (sharded and reshard == "per_microbatch") or asks_for_graph_work(options)


def _pipeline_mesh(stages: int, mesh: DeviceMesh | None, device: torch.device) -> DeviceMesh:
    world_size = dist.get_world_size()
    if mesh is None:
        if world_size % stages:
            raise ValueError(
                f"compshard.pipeline: stages={stages} must divide the world size {world_size} "
                f"(the ranks form a (pp={stages}, dp=world/{stages}) mesh)"
            )
        shape = (stages, world_size // stages)
        return init_device_mesh(device.type, shape, mesh_dim_names=("pp", "dp"))
    names = mesh.mesh_dim_names or ()
    if not isinstance(mesh, DeviceMesh) or names not in (("pp",), ("pp", "dp")):
        raise ValueError(
            f"compshard.pipeline: mesh must be a DeviceMesh with dims ('pp',) or ('pp', 'dp'), got {mesh!r}"
        )
    if mesh["pp"].size() != stages:
        raise ValueError(f"compshard.pipeline: stages={stages} must equal the mesh's 'pp' size {mesh['pp'].size()}")
    return mesh


def _check_same_cut(split: StageSplit) -> None:
    """Every rank must have cut the same way, or the stages would not fit together."""
    cuts: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(cuts, split.cut_points)
    if any(c != cuts[0] for c in cuts):
        raise RuntimeError(f"compshard.pipeline: ranks cut the model differently: {cuts}")


def pipeline(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    stages: int,
    microbatches: int,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    schedule: str = "1f1b",
    mesh: DeviceMesh | None = None,
    compile: bool = True,
    compile_options: Mapping[str, Any] | None = None,
    reshard: Reshard = "per_step",
) -> Pipeline:
    """Cut ``model`` into ``stages`` pipeline stages and return this rank's :class:`Pipeline`.

    Args:
        model: the whole model, with identical parameters on every rank. Its forward takes
            positional tensors and returns a tensor (or a tuple of tensors). This rank's
            stage module holds the model's own parameter tensors (no copies) and the
            pipeline references no other stage's: drop ``model`` to free them.
        loss_fn: ``loss_fn(output, targets)`` for one micro-batch; a mean over the
            micro-batch (gradients are divided by ``microbatches``).
        stages: number of pipeline stages ``K``; at most what the model's forward can be
            cut into (else a ``ValueError`` naming the maximum).
        microbatches: number of micro-batches ``M`` each step's batch is split into
            (along dim 0; ``1f1b`` needs ``M >= K``).
        example_inputs: one step's inputs for this replica (or tensors of the same shapes
            and dtypes): the forward is captured on its first micro-batch, and ``step``
            takes batches of these shapes.
        schedule: ``"1f1b"`` (one forward, one backward: at most ``K`` micro-batches of
            activations live per stage) or ``"gpipe"`` (all forwards, then all backwards:
            ``M`` live). Both idle ``(K-1)/(M+K-1)`` of the time.
        mesh: a ``DeviceMesh`` with dims ``("pp",)`` or ``("pp", "dp")``. ``None``: the
            default process group as a ``(K, world/K)`` mesh; with ``dp > 1`` each stage is
            sharded over its ``dp`` ranks with :func:`compshard.shard`.
        compile: compile each stage module with the compshard backend (``True``) or run
            it eagerly (``False``). The first ``step`` compiles (each stage its own
            graphs; a stage that would gather nothing runs as built, see above);
            gradients are reduced once per step either way.
        compile_options: the backend's options (:class:`compshard.CompileOptions`), for
            ``compile=True`` only; ``None``: the defaults.
        reshard: when a sharded stage (``dp > 1``) gathers its parameters and frees them
            again. ``"per_step"``: once per step, all micro-batches computing on them;
            the stage's full parameters are held for the whole step (one all-gather per
            bucket and step). ``"per_microbatch"``: in every micro-batch's forward and
            backward, only the buckets in use held (up to ``2 M`` all-gathers per bucket
            and step). Ignored for unsharded stages.

    Collective: every rank calls it (it needs an initialized process group).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compshard.pipeline: model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"compshard.pipeline: loss_fn must be callable, got {loss_fn!r}")
    _positive_int("stages", stages)
    _positive_int("microbatches", microbatches)
    if schedule not in SCHEDULES:
        raise ValueError(f"compshard.pipeline: schedule={schedule!r} is not allowed; use one of {list(SCHEDULES)}")
    if schedule == "1f1b" and microbatches < stages:
        raise ValueError(
            f"compshard.pipeline: schedule='1f1b' needs microbatches >= stages, got microbatches={microbatches}, "
            f"stages={stages}; use more micro-batches or schedule='gpipe'"
        )
    options = _compile_options(compile, compile_options)
    if reshard not in RESHARD_MODES:
        raise ValueError(f"compshard.pipeline: reshard={reshard!r} is not allowed; use one of {list(RESHARD_MODES)}")
    args = _as_tuple(example_inputs)
    batch = args[0].shape[0] if args[0].dim() else 0
    if batch % microbatches or any(a.dim() == 0 or a.shape[0] != batch for a in args):
        raise ValueError(
            f"compshard.pipeline: microbatches={microbatches} must divide the batch (dim 0 of every input, "
            f"got shapes {[tuple(a.shape) for a in args]})"
        )
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("compshard.pipeline needs an initialized process group (launch with torchrun)")
    device = next(model.parameters()).device
    mesh = _pipeline_mesh(stages, mesh, device)
    world = dist.group.WORLD
    assert world is not None  # the process group is initialized (checked above)
    costs = cost_model.calibrate(world.group_name, device)
    micro_batch = tuple(a[: batch // microbatches] for a in args)
    split = split_stages(model, micro_batch, stages, costs=costs)
    _check_same_cut(split)
    return Pipeline(
        split,
        loss_fn,
        schedule=schedule,
        microbatches=microbatches,
        mesh=mesh,
        device=device,
        input_shapes=[a.shape for a in args],
        compile_options=options,
        reshard=reshard,
    )
