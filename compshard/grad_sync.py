"""Gradient accumulation without communication: ``no_sync`` and ``set_requires_gradient_sync``.

With gradient sync off, each parameter's full gradient is not reduce-scattered: it is
accumulated, in the reduce dtype, into a full-size tensor that compshard owns (the
``.grad`` of a zero-stride full-shape leaf, the parameter's *gradient sink*). The next
forward with sync on hands that accumulated gradient to the parameter's ``unshard``,
whose backward adds it to the new gradient before the one reduce-scatter: k micro-batches
under ``no_sync`` plus one synced micro-batch communicate gradients once and produce the
gradient of the whole batch.

Whether sync is on is a static fact of each forward: the sharded attribute reads it (and
whether a sink holds a gradient) in plain Python, so a compiled module gets one graph
per mode (Dynamo guards on the flag): plain reduce, accumulate (its backward issues no
collective) and fold (the synced micro-batch after accumulation).

Memory trade-off: while gradients accumulate, every rank holds one *full* gradient per
parameter (as DDP does), ``shard_size`` times the sharded gradient, from the first
unsynced backward until the synced micro-batch's backward has consumed it. Use it when
communication, not memory, is the bottleneck.

When no synced forward follows the accumulation (a pipeline schedule runs the forward of
its last micro-batch before the backwards of earlier ones, so no forward can fold them),
:func:`reduce_accumulated_gradients` reduces every accumulated gradient once, explicitly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from compshard.eager_gather import EagerReductions, accumulate_grad

__all__ = ["GradSync", "no_sync", "reduce_accumulated_gradients", "set_requires_gradient_sync"]


class GradSync:
    """Gradient-sync state shared by every sharded submodule of one ``shard`` call.

    ``specs``: parameter name -> its ``compshard.sharding.ParamSpec`` (what a gradient
    sink is shaped by), registered by ``shard``."""

    def __init__(self) -> None:
        self.requires_sync = True
        self.eager = EagerReductions()  # uncompiled gathers awaiting their gradients
        self.specs: dict[str, Any] = {}
        self.sinks: dict[str, torch.Tensor] = {}  # parameter name -> zero-stride full-shape leaf

    def claim(self, param: str) -> tuple[str, torch.Tensor | None]:
        """``(grad_sync, grad_sink)`` arguments of the parameter's next ``unshard``, claimed
        by that read: with sync on after accumulation, the first read takes the
        accumulated gradient out of its sink ("fold") and later reads reduce their own
        gradient alone, so a parameter read twice in one forward adds it once. This is
        the one state change a parameter read makes.
        """
        sink = self.sinks.get(param)
        if sink is None:
            return "reduce", None
        if not self.requires_sync:
            return "accumulate", sink
        accumulated = sink.grad
        if accumulated is None or not torch.is_grad_enabled():
            return "reduce", None
        sink.grad = None
        return "fold", accumulated

    def reduce_accumulated(self, params: Mapping[str, nn.Parameter], divide_by: int = 1) -> None:
        """Reduce every gradient sink's accumulated gradient with one ``compshard::reduce_grad``
        each, in parameter registration order (the same collectives in the same order on
        every rank), divide this rank's rows by ``divide_by`` and add them to the
        parameter's ``.grad`` (``params``: name -> parameter); the sinks are left empty.

        A sink that accumulated nothing contributes zeros, so that every rank issues the
        same collectives whatever ran: its parameter then gets a zero gradient, not ``None``."""
        for name, spec in self.specs.items():
            sink = self.sinks.get(name)
            if sink is None:  # frozen parameter, or gradient sync never turned off
                continue
            accumulated = sink.grad
            sink.grad = None
            if accumulated is None:
                accumulated = torch.zeros(spec.full_shape, dtype=sink.dtype, device=sink.device)
            param = params[name]
            local_grad = torch.ops.compshard.reduce_grad(
                accumulated, list(spec.full_shape), spec.world_size, spec.group_name, name, spec.reduce_dtype,
                param.dtype, spec.replicate_group)
            accumulate_grad(param, local_grad / divide_by if divide_by != 1 else local_grad)


def _state(module: nn.Module) -> GradSync:
    state = getattr(module, "_compshard_grad_sync", None)
    if state is None or not hasattr(module, "_compshard_config"):  # a submodule shares its root's state
        raise ValueError("compshard: gradient sync is set on the module passed to compshard.shard; "
                         f"{type(module).__name__} is not one")
    return state


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on (the default) or off for ``module`` (the module passed to
    ``compshard.shard``). Off: backward accumulates full gradients locally (see the module
    docstring for the memory this takes); the first synced backward after reduces them
    together with its own gradient. Every rank must make the same calls."""
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"compshard: requires_gradient_sync must be True or False, got {requires_gradient_sync!r}")
    state = _state(module)
    state.requires_sync = requires_gradient_sync
    if requires_gradient_sync:
        return
    params = dict(module.named_parameters())
    for name, spec in state.specs.items():
        if name in state.sinks or not params[name].requires_grad:
            continue
        dtype = spec.reduce_dtype or spec.param_dtype or params[name].dtype
        device = spec.compute_device or params[name].device
        state.sinks[name] = torch.zeros((), dtype=dtype, device=device).expand(spec.full_shape).requires_grad_()


def reduce_accumulated_gradients(module: nn.Module, *, divide_by: int = 1) -> None:
    """Reduce the gradients ``module`` (the module passed to ``compshard.shard``) accumulated
    with gradient sync off: one reduction per parameter, in registration order, landing in
    the parameters' ``.grad`` divided by ``divide_by`` (see :meth:`GradSync.reduce_accumulated`).
    Every rank must call it at the same point."""
    with torch.no_grad():
        _state(module).reduce_accumulated(dict(module.named_parameters()), divide_by)


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[nn.Module]:
    """Context in which ``module``'s backward passes accumulate gradients without
    communicating; sync is on again on exit::

        with compshard.no_sync(model):
            for x, y in micro_batches[:-1]:
                step_model(x, y).backward()
        step_model(*micro_batches[-1]).backward()   # one reduce-scatter for all of them
    """
    set_requires_gradient_sync(module, False)
    try:
        yield module
    finally:
        set_requires_gradient_sync(module, True)
