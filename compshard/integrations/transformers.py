"""transformers' ``Trainer`` for models sharded by ``compshard.shard``: ``Trainer``, a
subclass of ``transformers.Trainer`` (docs/integrations.md#transformers-trainer).

``transformers.Trainer`` prepares its model with Accelerate, which wraps it in
``DistributedDataParallel`` on several processes, clips with Accelerate, and saves the
model and the optimizer from the first process only: for a sharded model that would
all-reduce the local rows of different ranks as one tensor and write only the first
rank's rows. This subclass overrides the methods that do those things, and nothing else:

- ``_wrap_model`` prepares the sharded model as Accelerate prepares a model for evaluation
  (``prepare_model(evaluation_mode=True)``: no DDP, no move), as the Trainer does itself
  for models that ``from_pretrained`` sharded; ``accelerator.prepare`` then leaves it alone.
  A compiled model is the Trainer's ``model_wrapped`` and its module the Trainer's ``model``,
  as when Accelerate compiles it (``torch_compile=True``); the Trainer does not hand an
  already wrapped model to ``accelerator.prepare``.
- ``_clip_grad_norm`` (``max_grad_norm``) is ``compshard.clip_grad_norm_``: the full
  gradient's norm, one all-reduce.
- ``save_model`` gathers the full weights to the first process (collective, every rank
  calls it, as the Trainer does) and writes them with ``save_pretrained``: the folder loads
  with ``from_pretrained``, sharded or not.
- a checkpoint (``save_strategy``) holds, besides those full weights and the Trainer's own
  files, the model and optimizer rows in ``compshard_dcp/`` (``compshard.checkpoint.save``:
  each rank writes its rows, readable at any world size), and resuming
  (``train(resume_from_checkpoint=...)``) reads them back from there.

The model may be compiled first, ``Trainer(model=torch.compile(model, backend="compshard"))``,
or run uncompiled. ``TrainingArguments(torch_compile=True)`` is refused: the Trainer hands
its backend name to Accelerate, whose ``DynamoBackend`` enum accepts only the backends it
lists (``"compshard"`` raises ``ValueError: 'COMPSHARD' is not a valid DynamoBackend``), and
``torch_compile_mode`` names an Inductor mode that has no meaning for compshard's options.
Also refused: DeepSpeed and FSDP (``deepspeed=``, ``fsdp=``, a parallelism config), which shard
the model themselves, ``load_best_model_at_end`` (not supported yet) and ``model_init``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers.trainer import SCHEDULER_NAME

from compshard import checkpoint
from compshard.clip import clip_grad_norm_
from compshard.integrations._sharded import sharded_module

__all__ = ["Trainer", "SHARDED_CHECKPOINT"]

SHARDED_CHECKPOINT = "compshard_dcp"  # the model's and optimizer's rows, inside each checkpoint-N folder


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` for a model sharded by ``compshard.shard`` (compiled with the
    compshard backend or not). Takes the same arguments; see the module docstring for what
    changes and what is refused."""

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None, **kwargs):
        module = sharded_module(model) if isinstance(model, nn.Module) else None
        if module is None:
            raise TypeError(
                "compshard.integrations.transformers.Trainer: model must be sharded by compshard.shard (and may be "
                f"compiled with torch.compile(model, backend='compshard')), got {type(model).__name__}"
                + ("; model_init is not supported" if model is None else "")
            )
        if args is not None:
            _check_arguments(args)
        self._compshard_module = module
        # The Trainer reads the model's forward signature, labels and class (to keep the dataset's
        # columns, to save with save_pretrained): it gets the module, and trains the compiled one
        # as model_wrapped, as when accelerate compiles it (torch_compile=True).
        super().__init__(model=module, args=args, **kwargs)
        if model is not None and model is not module:
            self.model_wrapped = model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "compshard.integrations.transformers.Trainer: DeepSpeed and FSDP (here enabled through accelerate's "
                "configuration or environment) shard the model themselves; launch without them"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.args.world_size:
            raise ValueError(
                f"compshard.integrations.transformers.Trainer: the Trainer sees {self.args.world_size} process(es) "
                f"but the process group has {dist.get_world_size()}, so every rank would train on the same batches. "
                "Launch with torchrun (RANK, WORLD_SIZE and LOCAL_RANK set), and on CPUs pass use_cpu=True"
            )

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        model = super()._wrap_model(model, training=training, dataloader=dataloader)
        if training and model is self.model:
            # accelerator.prepare would wrap the model in DDP; a model it has prepared already it leaves alone.
            self.accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
        return model

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        self.accelerator.unscale_gradients()
        return clip_grad_norm_(self._compshard_module, self.args.max_grad_norm)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the full weights with ``save_pretrained`` (from the first process; with
        ``save_on_each_node``, from each node's first). Collective: every rank calls it."""
        if output_dir is None:
            output_dir = self.args.output_dir
        weights = checkpoint.full_state_dict(self._compshard_module, rank0_only=not self.args.save_on_each_node)
        self._save(output_dir, state_dict=weights)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        checkpoint.save(os.path.join(output_dir, SHARDED_CHECKPOINT), self._compshard_module, _inner(self.optimizer))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        checkpoint.load(_sharded_folder(resume_from_checkpoint), self._compshard_module)

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        if checkpoint_dir is None:
            return
        checkpoint.load(_sharded_folder(checkpoint_dir), self._compshard_module, _inner(self.optimizer))
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def _check_arguments(args: transformers.TrainingArguments) -> None:
    refused = []
    if args.torch_compile:
        refused.append(
            "torch_compile (and torch_compile_backend / torch_compile_mode): the Trainer passes the backend to "
            "accelerate, whose DynamoBackend enum has no 'compshard'; pass "
            "model=torch.compile(model, backend='compshard') with torch_compile=False instead"
        )
    if args.deepspeed:
        refused.append("deepspeed: DeepSpeed shards the model itself")
    if args.fsdp:
        refused.append("fsdp: FSDP shards the model itself")
    if args.parallelism_config is not None:
        refused.append("parallelism_config: accelerate would shard or wrap the model itself")
    if args.load_best_model_at_end:
        refused.append("load_best_model_at_end: not supported yet")
    if refused:
        raise ValueError(
            "compshard.integrations.transformers.Trainer: unsupported TrainingArguments: " + "; ".join(refused)
        )


def _inner(optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    assert optimizer is not None  # the Trainer creates its optimizer before it saves or loads one
    return optimizer


def _sharded_folder(checkpoint_dir: str) -> str:
    folder = os.path.join(checkpoint_dir, SHARDED_CHECKPOINT)
    if not os.path.isdir(folder):
        raise FileNotFoundError(
            f"compshard.integrations.transformers.Trainer: {checkpoint_dir} has no {SHARDED_CHECKPOINT}/ folder (the "
            "model's and optimizer's rows) to resume from; a checkpoint saved with save_only_model=True holds the "
            "full weights only: load them with from_pretrained, shard, and train from there"
        )
    return folder
