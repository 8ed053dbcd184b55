"""``compshard.inspect``: compile a module with the compshard backend for given inputs, run
one step, and return the :class:`~compshard.inspection.Report` of what was scheduled.

The step runs for real (it is how Dynamo hands the backend its graphs); the user's
gradients are put back afterwards and the optimizer is never touched.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import tempfile
from typing import Any

import torch
from torch import nn

from compshard import backend
from compshard.inspection.report import Report
from compshard.options import CompileOptions
from compshard.sharding import applied_config
from compshard.sharding.grad_sync import grad_sync_state
from compshard.sharding.held_params import step_gathers

__all__ = ["inspect"]


def inspect(module: nn.Module, *args: Any, options: dict | None = None, profile: bool = False, **kwargs: Any) -> Report:
    """Compile ``module`` with the compshard backend for these inputs; return the schedule.

    Runs one forward (and, when the output requires grad, one backward of the sum of its
    floating outputs) so that both graphs are compiled; with ``profile`` one more, under
    ``torch.profiler``, whose events ``Report.save_trace`` includes. Collective: call it
    on every rank. Parameter ``.grad`` values are restored afterwards; the optimizer is
    not touched. ``options`` are the backend options (as for ``torch.compile``);
    ``options`` and ``profile`` are taken by inspect, every other keyword argument goes
    to the module.
    """
    CompileOptions.from_dict(options)  # a bad option is a ValueError here, not a compile failure
    params = list(module.parameters())
    saved_grads = [p.grad for p in params]
    for param in params:  # backward accumulates into .grad in place: keep the user's out of reach
        param.grad = None
    try:
        with backend.record_compiles() as captured:
            # A backend object of its own: Dynamo must compile anew, not reuse a cached graph.
            compiled = torch.compile(module, backend=functools.partial(backend.compshard_backend, options=options))
            # torch.compile of a Module returns an OptimizedModule (a Module); its stub says Callable
            measured = _measured_step(compiled, args, kwargs, profile)  # type: ignore[arg-type]
    finally:
        for param, grad in zip(params, saved_grads):
            param.grad = grad
    if not captured:
        raise RuntimeError(
            "compshard.inspect: nothing was scheduled: the module ran no graph for these inputs that "
            "reads a sharded parameter (compshard.shard) or whose options ask for recompute, a "
            "memory budget or codegen='inductor'; such graphs run as captured"
        )
    config = applied_config(module)
    step = step_gathers(grad_sync_state(module)) if config is not None else ()
    return Report(captured, measured, config, step)


def _measured_step(compiled: nn.Module, args: tuple, kwargs: dict, profile: bool) -> dict | None:
    """Compile and run one forward (and backward); with ``profile``, under the profiler
    (the compile happens first, unprofiled) and return its Chrome trace."""

    def step() -> None:
        target = _backward_target(compiled(*args, **kwargs))
        if target is not None:
            target.backward()

    step()
    if not profile:
        return None
    with torch.profiler.profile() as prof:
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as file:
            return json.load(file)


def _backward_target(output: Any) -> torch.Tensor | None:
    """The sum of the output's floating tensors that require grad (None: there are none)."""
    leaves = [
        t
        for t in torch.utils._pytree.tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()
    ]
    return functools.reduce(operator.add, (t.float().sum() for t in leaves)) if leaves else None
