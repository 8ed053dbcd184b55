"""Lightning's ``Trainer`` with compshard: ``CompshardStrategy``, a Lightning ``Strategy``
(docs/integrations.md#lightning).

``Trainer(strategy=CompshardStrategy(...))`` shards the ``LightningModule`` itself with
``compshard.shard`` in the strategy's ``setup``, as Lightning's ``ModelParallelStrategy``
lets ``configure_model`` apply ``fully_shard``: after ``configure_model`` (so layers built
there are sharded too) and before ``configure_optimizers`` (whose optimizer then holds the
sharded parameters). What it does, hook by hook:

- **setup**: moves the module to the rank's device, shards it (``sharding``: the keywords
  of ``compshard.shard``), and with ``compile=True`` compiles the module's step methods
  (``training_step``, ``validation_step``, ``test_step``, ``predict_step``) with
  ``torch.compile(..., backend="compshard", options=compile_options)``, as Lightning compiles
  them for a model given to ``fit`` compiled: those are what Lightning calls, and the
  loss computed in them belongs to the compiled graph. A module sharded before (a second
  ``fit``, or ``test`` after ``fit``) is not sharded again. No ``DistributedDataParallel``:
  compshard reduce-scatters the gradients itself.
- **each step** runs through the module's ``__call__`` (Lightning's forward redirection,
  which DDP uses too), so that the whole step is inside the sharded root's forward: an
  uncompiled step, and the eager parts of a compiled one around a graph break, gather the
  parameters they read wherever they read them.
- **gradient clipping** (``gradient_clip_val``): by norm, ``compshard.clip_grad_norm_`` of
  the optimizer's parameters (the full gradient's norm, one all-reduce, the same on every
  rank); by value, ``torch.nn.utils.clip_grad_value_`` (elementwise: each rank its rows).
- **checkpoints**: a checkpoint is a directory: ``compshard_dcp/``, the model's and the
  optimizer's rows as ``compshard.checkpoint.save`` writes them (each rank its own rows,
  readable at any world size and by FSDP2 code), and ``meta.pt``, the rest of Lightning's
  checkpoint (loops, callbacks, schedulers, hyperparameters), written by the first rank.
  It is written into a sibling directory first and renamed into place once complete, so
  the path holds the old checkpoint or the new one, whole. ``fit(ckpt_path=...)`` (and
  ``validate``/``test``/``predict``) read it back after ``setup``.

Only Lightning's default precision (``"32-true"``) is accepted: compshard's mixed precision
is ``sharding={"param_dtype": torch.bfloat16, ...}`` (the shards stay fp32 master weights);
Lightning's autocast and ``"*-true"`` precisions are refused. Also refused: more than one
optimizer in a checkpoint, and ``trainer.fit(torch.compile(model))`` (Lightning's own check
accepts compiled models for its DDP and FSDP strategies only; use ``compile=True``).
"""

from __future__ import annotations

import inspect
import os
import shutil
import uuid
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.optim import Optimizer

from compshard import checkpoint
from compshard.clip import clip_grad_norm_
from compshard.options import CompileOptions
from compshard.sharding import is_sharded, no_sync, shard

__all__ = ["CompshardStrategy", "CompshardPrecision", "SHARDED_CHECKPOINT", "METADATA_FILE"]

SHARDED_CHECKPOINT = "compshard_dcp"  # the model's and optimizer's rows, inside each checkpoint directory
METADATA_FILE = "meta.pt"  # the rest of Lightning's checkpoint, as Lightning's ModelParallelStrategy names it
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_SHARD_KEYWORDS = tuple(name for name in inspect.signature(shard).parameters if name != "module")
_NAME = "compshard.integrations.lightning.CompshardStrategy"


class CompshardPrecision(Precision):
    """Lightning's default precision (``"32-true"``) with gradient clipping by norm done by
    ``compshard.clip_grad_norm_`` over the optimizer's (sharded) parameters."""

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(_ParameterSet(self.main_params(optimizer)), clip_val)


class _ParameterSet(nn.Module):
    """A module that holds given parameters and nothing else: what ``clip_grad_norm_``
    takes, for the optimizer's parameters (which may be fewer than the model's)."""

    def __init__(self, params: Any) -> None:
        super().__init__()
        for index, param in enumerate(params):
            self.register_parameter(str(index), param)


class CompshardStrategy(ParallelStrategy):
    """Data-parallel training with the ``LightningModule`` sharded by ``compshard.shard``
    and its step methods compiled with the compshard backend (see the module docstring).

    Args:
        sharding: keywords for ``compshard.shard`` (``strategy``, ``param_dtype``,
            ``reduce_dtype``, ``gather_units``, ...; docs/api.md#compshardshard).
        compile: compile the module's step methods with the compshard backend; ``False``:
            they run uncompiled (the sharded module gathers eagerly).
        compile_options: compile options (docs/api.md#compile-options); needs ``compile``.
        process_group_backend: the process group's backend when the strategy creates it
            (``None``: gloo on CPUs, NCCL on GPUs); a process group that exists already
            is used as it is.
        timeout: the process group's timeout when the strategy creates it.

    ``accelerator``, ``parallel_devices`` and ``cluster_environment`` are Lightning's, as for
    its other parallel strategies. There is no ``checkpoint_io``: checkpoints are DCP
    directories that every rank writes.
    """

    strategy_name = "compshard"

    def __init__(
        self,
        sharding: Mapping[str, Any] | None = None,
        compile: bool = True,
        compile_options: Mapping[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices, cluster_environment=cluster_environment
        )
        self._sharding = _check_sharding(sharding)
        if not isinstance(compile, bool):
            raise TypeError(f"{_NAME}: compile must be True or False, got {compile!r}")
        if compile_options is not None and not compile:
            raise ValueError(f"{_NAME}: compile_options needs compile=True")
        CompileOptions.from_dict(dict(compile_options or {}))  # a bad option raises here, naming it
        self._compile = compile
        self._compile_options = dict(compile_options or {})
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._compiled_steps: dict[str, Any] = {}  # the module's step methods, compiled by setup
        self._compiled_module: nn.Module | None = None  # the module they belong to
        self.num_nodes = 1

    # ------------------------------------------------------------------ processes and devices

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning gives each rank its own batches (a ``DistributedSampler``)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(  # does nothing where a process group exists already
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"{_NAME}: Lightning counts {self.world_size} process(es) (devices x num_nodes) but the process "
                f"group has {dist.get_world_size()}; give the Trainer the devices and nodes the job was launched with"
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined, unused-ignore]  # (lightning_utilities' decorator)

    # ------------------------------------------------------------------ the model

    @property
    def precision_plugin(self) -> Precision:
        plugin = self._precision_plugin
        return plugin if plugin is not None else CompshardPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and type(plugin) is Precision:  # Lightning's default, "32-true"
            plugin = CompshardPrecision()
        if plugin is not None and not isinstance(plugin, CompshardPrecision):
            raise ValueError(
                f"{_NAME}: precision {getattr(plugin, 'precision', type(plugin).__name__)!r} is not supported: "
                "leave Lightning's precision at '32-true' and pass compshard's mixed precision as "
                "sharding={'param_dtype': torch.bfloat16, 'reduce_dtype': torch.float32}"
            )
        self._precision_plugin = plugin

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``configure_model`` runs here: on the rank's device, or with ``empty_init`` on the
        meta device; ``setup`` then shards the module from its shapes and gives each rank its
        rows, initialized by each module's ``reset_parameters`` (seeded alike on every rank,
        the values equal the unsharded model's)."""
        with torch.device("meta") if empty_init else self.root_device, self.precision_plugin.tensor_init_context():
            yield

    def model_to_device(self) -> None:
        assert self.model is not None
        if not is_sharded(self.model):  # shards stay where shard put them
            self.model.to(self.root_device)

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        assert module is not None and self.model is module  # connect() set both; nothing wraps the module
        if not is_sharded(module):
            meta = any(t.is_meta for t in [*module.parameters(), *module.buffers()])
            if not meta:
                self.model_to_device()
            shard(module, **self._sharding)
            if meta:
                _materialize_distributed_module(module, self.root_device)
        self._compile_steps(module)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            # optimizers of an earlier stage hold the parameters as they were then
            self._reset_optimizers_and_schedulers()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _compile_steps(self, module: pl.LightningModule) -> None:
        """Compile the module's step methods, once (kept here: the module's attributes stay
        its own, so Lightning's checks of their signatures see the methods as written)."""
        if self._compile and self._compiled_module is not module:
            self._compiled_steps = {
                name: torch.compile(getattr(module, name), backend="compshard", options=self._compile_options)
                for name in STEP_METHODS
            }
            self._compiled_module = module

    def _step(self, name: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        """Run the module's step method ``name`` (compiled, with ``compile``) through the
        module's ``__call__``, inside the sharded root's forward, as Lightning's forward
        redirection runs steps through DDP's ``forward``: the module's ``forward`` is
        replaced for that one call and restored before the step runs."""
        module = self.lightning_module
        assert module is not None
        step = self._compiled_steps.get(name) or getattr(module, name)
        own_forward = module.__dict__.get("forward")

        def restore() -> None:
            if own_forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own_forward  # type: ignore[method-assign, unused-ignore]

        def redirected(*step_args: Any, **step_kwargs: Any) -> Any:
            restore()
            return step(*step_args, **step_kwargs)

        module.forward = redirected  # type: ignore[method-assign, unused-ignore]
        try:
            with context:
                return module(*args, **kwargs)
        finally:
            restore()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", self.precision_plugin.train_step_context(), *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", self.precision_plugin.val_step_context(), *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", self.precision_plugin.test_step_context(), *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", self.precision_plugin.predict_step_context(), *args, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation (``accumulate_grad_batches``) runs the micro-batches
        before the last one in here: ``compshard.no_sync``, so that a step reduces its gradients
        once (each rank holds a full-size gradient buffer per parameter meanwhile)."""
        module = self.lightning_module
        assert module is not None
        with no_sync(module):
            yield

    # ------------------------------------------------------------------ collectives

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    def teardown(self) -> None:
        # Unlike the base Strategy, the module is not moved to the CPU: its shards live
        # where their mesh's collectives run.
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the module must be sharded (and its optimizer built) before it is loaded into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint reads the optimizer's rows itself

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This rank's rows (DTensors) under the module's ``state_dict`` keys; nothing is gathered."""
        assert self.lightning_module is not None
        with checkpoint.parameters_at_rest(self.lightning_module) as module:
            return get_model_state_dict(module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's rows of the optimizer state, under parameter names; nothing is gathered."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        with checkpoint.parameters_at_rest(self.lightning_module) as module:
            return get_optimizer_state_dict(module, optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # load_checkpoint read the rows already

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # load_checkpoint read the rows already

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        """Write the checkpoint directory ``filepath`` (see the module docstring). Collective:
        Lightning calls it on every rank."""
        if storage_options is not None:
            raise TypeError(f"{_NAME}.save_checkpoint: storage_options is not supported (checkpoints are DCP)")
        module = self.lightning_module
        assert module is not None
        checkpoint = dict(checkpoint)
        checkpoint.pop("state_dict", None)
        with_optimizer = "optimizer_states" in checkpoint  # absent from save_weights_only checkpoints
        checkpoint.pop("optimizer_states", None)
        optimizer = self._only_optimizer("save") if with_optimizer else None
        target = Path(self.broadcast(os.path.abspath(os.fspath(filepath))))
        staging = target.with_name(f"{target.name}.saving-{self.broadcast(uuid.uuid4().hex)}")
        _save_checkpoint_files(staging, module, optimizer, checkpoint, self.is_global_zero)
        self.barrier()
        outcome: list[str | None] = [None]
        if self.is_global_zero:
            try:
                _commit(staging, target)
            except OSError as error:
                outcome = [f"{_NAME}: could not rename the written checkpoint {staging} to {target}: {error}"]
        outcome = self.broadcast(outcome)
        if outcome[0] is not None:
            raise OSError(outcome[0])

    def remove_checkpoint(self, filepath: _PATH) -> None:
        if self.is_global_zero:
            shutil.rmtree(filepath, ignore_errors=True)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Read the checkpoint directory ``checkpoint_path`` into the sharded module (and, when
        fitting, its optimizer); return the rest of Lightning's checkpoint. Collective."""
        path = Path(self.broadcast(os.fspath(checkpoint_path)))
        module = self.lightning_module
        assert module is not None
        rows, metadata = path / SHARDED_CHECKPOINT, path / METADATA_FILE
        if not (rows.is_dir() and metadata.is_file()):
            raise FileNotFoundError(
                f"{_NAME}: {path} is not a checkpoint this strategy wrote (a directory holding {SHARDED_CHECKPOINT}/ "
                f"and {METADATA_FILE})"
            )
        optimizer = self._only_optimizer("load") if self.optimizers and _holds_optimizer(rows) else None
        checkpoint.load(rows, module, optimizer)
        return torch.load(metadata, weights_only=weights_only)

    def _only_optimizer(self, action: str) -> Optimizer | None:
        if len(self.optimizers) > 1:
            raise NotImplementedError(
                f"{_NAME}: checkpoints of more than one optimizer are not supported yet ({action}: "
                f"{len(self.optimizers)} optimizers)"
            )
        return self.optimizers[0] if self.optimizers else None


def _check_sharding(sharding: Mapping[str, Any] | None) -> dict[str, Any]:
    if sharding is None:
        return {}
    if not isinstance(sharding, Mapping):
        raise TypeError(f"{_NAME}: sharding must be a mapping of compshard.shard's keywords, got {sharding!r}")
    unknown = sorted(set(sharding) - set(_SHARD_KEYWORDS))
    if unknown:
        raise ValueError(f"{_NAME}: sharding has unknown keys {unknown}; compshard.shard takes {list(_SHARD_KEYWORDS)}")
    return dict(sharding)


def _save_checkpoint_files(
    folder: Path, module: nn.Module, optimizer: Optimizer | None, rest: dict[str, Any], first_rank: bool
) -> None:
    checkpoint.save(folder / SHARDED_CHECKPOINT, module, optimizer)  # each rank its rows; creates the folder
    if first_rank:
        torch.save(rest, folder / METADATA_FILE)


def _commit(staging: Path, target: Path) -> None:
    """Put the complete checkpoint ``staging`` at ``target``, an existing one first renamed
    aside and then removed (as ``compshard.checkpoint.save`` does)."""
    replaced = staging.with_name(staging.name.replace(".saving-", ".replaced-"))
    if os.path.lexists(target):
        os.rename(target, replaced)
    os.rename(staging, target)
    shutil.rmtree(replaced, ignore_errors=True)


def _holds_optimizer(rows: Path) -> bool:
    """Whether the DCP directory ``rows`` holds optimizer state (not a weights-only save)."""
    keys = FileSystemReader(os.fspath(rows)).read_metadata().state_dict_metadata
    return any(key.startswith(f"{checkpoint.OPTIMIZER_KEY}.") for key in keys)
