"""AdaScale: the learning rate scaled to a large batch by the gradients' own noise.

AdaScale (Johnson et al., 2020; FairScale's ``fairscale.optim.AdaScale``) trains with a
batch ``scale`` times the one a learning rate was tuned for, multiplying the lr at each
step by the *gain ratio* ``r = (var + sqr) / (var / scale + sqr)``: ``var`` estimates the
trace of the gradients' covariance and ``sqr`` the squared norm of the true gradient.
``r`` is between 1 (all gradients agree: a larger batch adds nothing, keep the lr) and
``scale`` (pure noise: scale the lr linearly). The estimates come from the ``cN`` =
data-parallel ranks x accumulated backward passes gradients of each step:

- ``local``: the sum over ranks and passes of each gradient's squared norm, before
  averaging (per optimizer parameter group);
- ``total``: the squared norm of the averaged gradient (the reduced one in ``.grad``).

With ``S`` the scale: ``var = local * (S / cN) / (cN - 1) - total * S / (cN - 1)`` (at least
1e-6) and ``sqr = total - var / S`` (at least 0), each an exponential moving average with
factor ``smoothing``, debiased as an Adam moment is; FairScale's arithmetic exactly.

compshard takes ``local`` where each gradient is before its reduction
(:mod:`compshard.sharding.grad_norms`: in the compiled backward graph, in the uncompiled
reduction, at the ``no_sync`` accumulation), with no hook on any parameter, and sums it
and ``total`` in one all-reduce of ``2 x groups`` floats per step, the one collective
AdaScale adds. The trade-off: that all-reduce and a squared-norm read of every gradient
per pass, for an lr that follows the batch size without retuning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.comm.layout import ShardLayout, group_size
from compshard.comm.ops import square_norm
from compshard.sharding.grad_norms import GradNorms
from compshard.sharding.grad_routing import sharded_models
from compshard.sharding.grad_sync import GradSync

__all__ = ["AdaScale"]

_STATE_KEY = "adascale"  # in the wrapped optimizer's ``state``, as FairScale keeps it


class AdaScale:
    """Wrap ``optimizer`` (built over the parameters of models sharded by
    ``compshard.shard``) so that each ``step`` runs with every group's lr multiplied by
    its gain ratio (see the module docstring), as ``fairscale.optim.AdaScale`` does.

    Args:
        optimizer: the optimizer to scale; its parameters must belong to sharded models
            whose data-parallel ranks are all the ranks of the default process group.
        scale: the batch size over the one the lr was tuned for. ``None``: data-parallel
            ranks x ``num_gradients_to_accumulate`` (FairScale's default).
        smoothing: the moving averages' factor. ``None``: ``max(1 - cN / 1000, 0)``.
        num_gradients_to_accumulate: backward passes per step on each rank (micro-batches
            under ``compshard.no_sync`` plus the synced one).
        is_scaled_loss: with accumulation, whether each pass's loss is divided by
            ``num_gradients_to_accumulate`` (FairScale's default, True).

    Build it before the first backward whose gradients it must see: each backward from
    then on records the local norms (a compiled model's graphs are traced again once
    to take them). ``gain()`` is this step's ratio once its last backward has run. The
    lr is changed only inside ``step``: a scheduler of the wrapped optimizer sees its own
    lr. The estimates are kept in ``optimizer.state["adascale"]`` (float64 tensors), so
    ``state_dict``/``load_state_dict`` and checkpoints of the optimizer carry them.
    Collective: ``step`` and ``gain`` after a step's last backward all-reduce, on every
    rank at the same point.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scale: float | None = None,
        smoothing: float | None = None,
        num_gradients_to_accumulate: int = 1,
        *,
        is_scaled_loss: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"compshard.AdaScale: optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        if not isinstance(is_scaled_loss, bool):
            raise TypeError(f"compshard.AdaScale: is_scaled_loss must be True or False, got {is_scaled_loss!r}")
        if scale is not None:
            _check_scale(scale)
        if smoothing is not None and not (
            isinstance(smoothing, (int, float)) and not isinstance(smoothing, bool) and 0 <= smoothing < 1
        ):
            raise ValueError(f"compshard.AdaScale: smoothing={smoothing!r} is not allowed; use None or 0 <= x < 1")
        _check_accumulate(num_gradients_to_accumulate)
        self._optimizer = optimizer
        self._is_scaled_loss = is_scaled_loss
        self._world_size = _data_parallel_size(optimizer)
        if self._world_size * num_gradients_to_accumulate <= 1:
            raise ValueError(
                "compshard.AdaScale: one data-parallel rank without gradient accumulation has one gradient per "
                "step, from which no variance can be estimated; use num_gradients_to_accumulate > 1 or more ranks"
            )
        self._accumulate = 1
        self._smoothing = 0.0
        self.set_num_gradients_to_accumulate(num_gradients_to_accumulate)
        if smoothing is not None:
            self._smoothing = float(smoothing)
        self._models = _attach(optimizer)
        self._weights = _weights(self._models, self._world_size)
        groups = len(optimizer.param_groups)
        state: Any = optimizer.state  # keyed by parameters, and by "adascale" as FairScale keeps it
        state.setdefault(
            _STATE_KEY,
            {
                "grad_sqr_avg": torch.ones(groups, dtype=torch.float64),
                "grad_var_avg": torch.zeros(groups, dtype=torch.float64),
            },
        )
        self._folded = False  # this step's statistics are in the estimates
        self._scale = 1.0
        self.set_scale(self._world_size * self._accumulate if scale is None else scale)

    # ------------------------------------------------------------------ the wrapper

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self._optimizer.param_groups

    @property
    def state(self) -> Any:
        return self._optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, the gain estimates in it (take it between steps)."""
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._optimizer.load_state_dict(state_dict)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of the wrapped optimizer with each group's lr times its gain, the lr
        restored afterwards. Needs the step's ``num_gradients_to_accumulate`` backwards."""
        self._update(required=True)
        self._folded = False  # the next step's statistics come from its own backwards
        lrs = [group["lr"] for group in self.param_groups]
        try:
            for index, group in enumerate(self.param_groups):
                group["lr"] = lrs[index] * self.gain(index)
            return self._optimizer.step(closure) if closure is not None else self._optimizer.step()
        finally:
            for group, lr in zip(self.param_groups, lrs):
                group["lr"] = lr

    # ------------------------------------------------------------------ the estimates

    @property
    def scale(self) -> float:
        """The batch size over the one the lr was tuned for."""
        return self._scale

    @property
    def smoothing(self) -> float:
        """The moving averages' factor."""
        return self._smoothing

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Set the scale (at least 1); ``update_estimate``: rescale the variance estimate
        to it, as FairScale does (recommended)."""
        _check_scale(scale)
        if update_estimate:
            for name in ("grad_var_avg", "grad_var_avg_biased"):
                if name in self._state:
                    self._state[name] *= self._scale / scale
        self._scale = float(scale)

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """Set the backward passes per step (``update_smoothing``: reset the smoothing to
        its default for the new count). Set the scale to match with :meth:`set_scale`."""
        _check_accumulate(num_gradients_to_accumulate)
        self._accumulate = num_gradients_to_accumulate
        if update_smoothing:
            self._smoothing = max(1 - self._world_size * num_gradients_to_accumulate / 1000, 0.0)

    def gain(self, pg_idx: int | None = None) -> float:
        """The gain ratio of parameter group ``pg_idx`` (None: of all groups' summed
        estimates), with the step's statistics once its last backward has run."""
        self._update(required=False)
        var, sqr = self._state["grad_var_avg"], self._state["grad_sqr_avg"]
        if pg_idx is not None:
            var, sqr = var[pg_idx], sqr[pg_idx]
        var_total, sqr_total = float(var.sum()), float(sqr.sum())
        return (var_total + sqr_total) / (var_total / self._scale + sqr_total)

    @property
    def _state(self) -> dict[str, torch.Tensor]:
        optimizer_state: Any = self._optimizer.state
        state: dict[str, torch.Tensor] = optimizer_state[_STATE_KEY]
        return state

    def _update(self, required: bool) -> None:
        """Fold the step's statistics into the estimates once its backwards have all run
        (``required``: raise unless they have or are folded in already)."""
        if self._folded:
            return
        if any(grad_sync.norms is not norms for grad_sync, norms in self._models):
            raise RuntimeError(
                "compshard.AdaScale: a newer AdaScale over this model's parameters takes its gradient norms now; "
                "step that one"
            )
        passes = {norms.passes for _, norms in self._models}
        done = passes == {self._accumulate}
        if not done:
            if required or any(count > self._accumulate for count in passes):
                raise RuntimeError(
                    f"compshard.AdaScale: {sorted(passes)} backward passes recorded since the last step, but "
                    f"num_gradients_to_accumulate={self._accumulate}; set it to the backwards per step "
                    "(set_num_gradients_to_accumulate), and build AdaScale before the step's first backward"
                )
            return
        local, total = self._statistics()
        if self._accumulate > 1:
            if self._is_scaled_loss:
                local = local * self._accumulate**2
            else:
                total = total / self._accumulate**2
        scale, count = self._scale, self._world_size * self._accumulate
        var = local * (scale / count) / (count - 1) - total * scale / (count - 1)
        sqr = total - var / scale
        self._average("grad_sqr_avg", sqr.clamp(min=0.0))
        self._average("grad_var_avg", var.clamp(min=1e-6))
        self._folded = True

    def _statistics(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``local``, ``total``) per group, float64, through one all-reduce."""
        groups = len(self.param_groups)
        local_sums: torch.Tensor | None = None
        for _, norms in self._models:
            sums = norms.take()
            local_sums = sums if local_sums is None else local_sums + sums.to(local_sums.device)
        assert local_sums is not None  # _attach found a model
        total = torch.zeros(groups, dtype=torch.float32, device=local_sums.device)
        for index, group in enumerate(self.param_groups):
            for param in group["params"]:
                weight = self._weights.get(id(param))
                if weight is not None and param.grad is not None:
                    total[index] += square_norm(_local(param.grad)).to(total.device) * weight
        both = torch.cat([local_sums, total])
        if self._world_size > 1:
            dist.all_reduce(both)
        both = both.to("cpu", torch.float64)
        return both[:groups], both[groups:]

    def _average(self, name: str, value: torch.Tensor) -> None:
        """The debiased moving average ``name`` updated with ``value``."""
        factor = self._smoothing
        state = self._state
        biased = state.get(f"{name}_biased", torch.zeros_like(value))
        unbias = state.get(f"{name}_unbias", torch.zeros_like(value))
        state[f"{name}_biased"] = factor * biased + (1.0 - factor) * value
        state[f"{name}_unbias"] = factor * unbias + (1.0 - factor)
        state[name] = state[f"{name}_biased"] / state[f"{name}_unbias"]


def _weights(models: list[tuple[GradSync, GradNorms]], world_size: int) -> dict[int, float]:
    """Parameter id -> its rows' share of the averaged gradient's norm: 1 over the number
    of data-parallel ranks holding the same rows (fixed by ``shard``; a conversion swaps
    a parameter's data, never the object)."""
    weights: dict[int, float] = {}
    for grad_sync, _ in models:
        for name, param in grad_sync.routed.items():
            spec = grad_sync.specs[name]
            pieces = 1
            if spec.world_size > 1 and not ShardLayout(spec.full_shape, spec.world_size, 0).replicated:
                pieces = spec.world_size
            weights[id(param)] = pieces / world_size
    return weights


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _attach(optimizer: torch.optim.Optimizer) -> list[tuple[GradSync, GradNorms]]:
    """Record local gradient norms in every sharded model whose parameters ``optimizer``
    steps, each parameter counted in its optimizer group (replacing an earlier
    AdaScale's recording); raise for a parameter no sharded model holds."""
    group_of = {id(param): index for index, group in enumerate(optimizer.param_groups) for param in group["params"]}
    attached = []
    found: set[int] = set()
    for grad_sync in sharded_models():
        groups = {name: group_of[id(param)] for name, param in grad_sync.routed.items() if id(param) in group_of}
        if not groups:
            continue
        devices = {index: _local(grad_sync.routed[name]).device for name, index in groups.items()}
        norms = GradNorms(groups, devices)
        grad_sync.record_norms(norms)
        attached.append((grad_sync, norms))
        found.update(id(grad_sync.routed[name]) for name in groups)
    missing = [param for param in _params(optimizer) if id(param) not in found]
    if missing or not attached:
        raise ValueError(
            f"compshard.AdaScale: {len(missing)} of the optimizer's parameters (shapes "
            f"{[tuple(p.shape) for p in missing[:3]]}...) are not parameters of a model sharded by compshard.shard "
            "over a process group; build the optimizer from such a model's parameters"
        )
    return attached


def _params(optimizer: torch.optim.Optimizer) -> Iterable[nn.Parameter]:
    return (param for group in optimizer.param_groups for param in group["params"])


def _data_parallel_size(optimizer: torch.optim.Optimizer) -> int:
    """The data-parallel ranks of the models whose parameters ``optimizer`` steps (checked
    to be the default group's ranks)."""
    params = {id(param) for param in _params(optimizer)}
    sizes = {
        spec.world_size * group_size(spec.replicate_group)
        for grad_sync in sharded_models()
        for name, spec in grad_sync.specs.items()
        if name in grad_sync.routed and id(grad_sync.routed[name]) in params
    }
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if sizes and sizes != {world}:
        raise ValueError(
            f"compshard.AdaScale: the models' data-parallel ranks ({sorted(sizes)}) must be all {world} ranks of the "
            "default process group (a tensor- or expert-parallel mesh dimension is not supported)"
        )
    return world


def _check_scale(scale: Any) -> None:
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale >= 1):
        raise ValueError(f"compshard.AdaScale: scale={scale!r} is not allowed; use a number >= 1")


def _check_accumulate(count: Any) -> None:
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 1):
        raise ValueError(f"compshard.AdaScale: num_gradients_to_accumulate={count!r} is not allowed; use an int >= 1")
