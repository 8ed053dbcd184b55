"""Accelerate for models sharded by ``compshard.shard``: ``Accelerator``, a subclass of
``accelerate.Accelerator`` (docs/integrations.md#accelerate).

``accelerate.Accelerator.prepare`` wraps every model in ``DistributedDataParallel`` when it
runs on several processes (on CPUs always; on GPUs it refuses DTensor parameters). A
sharded model must not be wrapped: compshard already reduce-scatters its gradients, and
DDP would all-reduce the local rows of different ranks as if they were one tensor. This
subclass changes what a sharded model needs and nothing else, through the class's public
methods and hooks:

- ``prepare_model`` prepares a sharded model as accelerate prepares a model for evaluation
  (``evaluation_mode=True``: mixed-precision autocast if configured, no DDP, no move:
  the shards stay where ``shard`` put them), as transformers' Trainer does for models it
  sharded itself. ``prepare(model, optimizer, dataloader)`` goes through it.
- ``clip_grad_norm_`` of a sharded model's parameters is ``compshard.clip_grad_norm_``: the
  full gradient's norm, one all-reduce.
- ``get_state_dict`` of a sharded model gathers full tensors to the first process (others
  get an empty dict), as accelerate does for FSDP's full state dicts; ``save_model`` and
  ``save_state`` write those. Collective.
- ``save_state`` / ``load_state`` keep accelerate's files and their meaning: the model's
  full weights (``model.safetensors``) and the unsharded model's optimizer state
  (``optimizer.bin``), which the first process writes and every process reads back into
  its rows. Inside these two calls, and only there, a sharded model's optimizer's
  ``state_dict()`` gathers (torch's optimizer state-dict hooks) and its
  ``load_state_dict`` cuts each rank's rows; the model's weights load through a
  ``register_load_state_pre_hook`` hook. Both calls are collective, as they are for
  accelerate's FSDP. The first process holds the whole model and optimizer state on CPU
  while saving; for models where that does not fit, save with ``compshard.checkpoint``
  (each rank writes its rows) in the training loop instead.

Not supported with a sharded model (each raises, naming it): accelerate's own
``torch.compile`` (``dynamo_backend`` / ``TorchDynamoPlugin``: it accepts only the backends
of its ``DynamoBackend`` enum; compile with ``torch.compile(model, backend="compshard")``
before ``prepare``), and its FSDP, DeepSpeed, Megatron-LM and XLA modes and parallelism
configs, which shard or wrap the model themselves.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import MODEL_NAME, SAFE_MODEL_NAME, DistributedType, DynamoBackend
from safetensors.torch import load_file
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.checkpoint import full_state_dict, set_full_state_dict
from compshard.clip import clip_grad_norm_
from compshard.integrations._sharded import (
    full_optimizer_state,
    sharded_module,
    sharded_optimizer_state,
    tie_aliases,
)

__all__ = ["Accelerator"]

_WRAPPING_MODES = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA)


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` that leaves a model sharded by ``compshard.shard`` as it is.

    Takes the same arguments. Models that are not sharded are prepared as by
    ``accelerate.Accelerator``. See the module docstring for what changes for sharded ones.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._compshard_modules: list[nn.Module] = []  # the sharded modules prepared, in order
        self._compshard_full_state = False  # inside save_state / load_state
        self.register_load_state_pre_hook(self._load_sharded_weights)

    # ------------------------------------------------------------------------ prepare

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        if any(isinstance(arg, nn.Module) and sharded_module(arg) is not None for arg in args):
            self._check_mode()
        return super().prepare(*args, device_placement=device_placement)

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ) -> Any:
        module = sharded_module(model)
        if module is None:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        self._check_mode()
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ValueError(
                "compshard.integrations.accelerate.Accelerator: accelerate's torch.compile (dynamo_backend="
                f"{self.state.dynamo_plugin.backend.value.lower()!r}) would compile a sharded model with another "
                "backend; its DynamoBackend enum has no 'compshard'. Compile with torch.compile(model, "
                "backend='compshard') before prepare, and leave dynamo_backend unset"
            )
        # No DDP, no move: compshard reduces the gradients, and the shards live where shard() put them.
        prepared = super().prepare_model(model, device_placement=False, evaluation_mode=True)
        if all(module is not known for known in self._compshard_modules):
            self._compshard_modules.append(module)
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        inner = _inner(prepared)
        sharded = any(isinstance(p, DTensor) for group in inner.param_groups for p in group["params"])
        if sharded and not getattr(inner, "_compshard_state_hooks", False):
            inner.register_state_dict_post_hook(self._optimizer_state_out)
            inner.register_load_state_dict_pre_hook(self._optimizer_state_in)
            inner._compshard_state_hooks = True  # type: ignore[attr-defined]
        return prepared

    def _check_mode(self) -> None:
        if self.distributed_type in _WRAPPING_MODES or self.parallelism_config is not None:
            mode = "a parallelism config" if self.parallelism_config is not None else self.distributed_type.value
            raise ValueError(
                f"compshard.integrations.accelerate.Accelerator: a model sharded by compshard.shard cannot be "
                f"prepared under {mode}, which shards or wraps the model itself; launch without it (plain "
                "multi-process data parallel: torchrun or accelerate launch, with cpu=True on CPUs)"
            )
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() != self.num_processes:
            raise ValueError(
                f"compshard.integrations.accelerate.Accelerator: accelerate sees {self.num_processes} process(es) "
                f"but the process group has {dist.get_world_size()}, so every rank would read the same batches. "
                "Launch with torchrun or accelerate launch (RANK, WORLD_SIZE and LOCAL_RANK set), and on CPUs "
                "pass cpu=True"
            )

    # ---------------------------------------------------------------------- clipping

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        parameters = list(parameters)
        given = {id(p) for p in parameters}
        for module in self._compshard_modules:
            if given == {id(p) for p in module.parameters()}:
                self.unscale_gradients()
                return clip_grad_norm_(module, max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    # ------------------------------------------------------------------- checkpoints

    def get_state_dict(self, model: Any, unwrap: bool = True) -> Any:
        module = sharded_module(self.unwrap_model(model))
        if module is None:
            return super().get_state_dict(model, unwrap=unwrap)
        # An OrderedDict, so that accelerate's safetensors writer keeps one name per tied tensor.
        return OrderedDict(full_state_dict(module, rank0_only=True))

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        with self._full_state():
            return super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        with self._full_state():
            super().load_state(input_dir, load_kwargs=load_kwargs, **kwargs)

    @contextlib.contextmanager
    def _full_state(self) -> Iterator[None]:
        self._compshard_full_state = True
        try:
            yield
        finally:
            self._compshard_full_state = False

    def _optimizer_state_out(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return full_optimizer_state(optimizer, state_dict) if self._compshard_full_state else state_dict

    def _optimizer_state_in(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return sharded_optimizer_state(optimizer, state_dict) if self._compshard_full_state else state_dict

    def _load_sharded_weights(self, models: list[nn.Module], input_dir: str) -> None:
        """``load_state``'s pre-hook: each sharded model's full weights into its rows, from the
        file accelerate wrote for it; the model is then taken off ``models`` so accelerate
        does not load it again (as the hook's contract says)."""
        sharded = [i for i, model in enumerate(models) if sharded_module(self.unwrap_model(model)) is not None]
        if not sharded:
            return
        if sharded != list(range(len(models) - len(sharded), len(models))):
            # accelerate names each model's file by its position in `models`: taking a model off
            # the list must not move the others
            raise NotImplementedError(
                "compshard.integrations.accelerate.Accelerator.load_state: prepare the sharded models after the "
                "other models (accelerate names each model's file by its position among the models it loads)"
            )
        for index in sharded:
            module = sharded_module(self.unwrap_model(models[index]))
            assert module is not None
            weights = _read_weights(input_dir, index)
            set_full_state_dict(module, {"model": tie_aliases(module, weights)})
        del models[len(models) - len(sharded) :]


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _read_weights(input_dir: str, index: int) -> dict[str, torch.Tensor]:
    """The full weights ``save_state`` wrote for the ``index``-th model (safetensors, or
    torch's pickle format with ``safe_serialization=False``), on CPU."""
    ending = f"_{index}" if index > 0 else ""
    safe = os.path.join(input_dir, f"{SAFE_MODEL_NAME}{ending}.safetensors")
    if os.path.exists(safe):
        return load_file(safe, device="cpu")
    return torch.load(os.path.join(input_dir, f"{MODEL_NAME}{ending}.bin"), map_location="cpu", weights_only=True)
