"""compshard: fully sharded data-parallel training as a torch.compile backend.

    compshard.shard(model)
    step_model = torch.compile(model, backend="compshard")

docs/architecture.md maps the package's layers, the data flow from ``shard()`` to the
executed graph and the module where each decision is made.
"""

from __future__ import annotations

__version__ = "0.1.0"  # the one place the version is written (pyproject.toml reads it)

from typing import Any

import torch

from compshard import checkpoint
from compshard.backend import compshard_backend
from compshard.checkpoint import full_state_dict
from compshard.clip import clip_grad_norm_
from compshard.comm import ops  # noqa: F401  (registers the compshard:: custom ops)
from compshard.compile_plan import ScheduleError
from compshard.inspection import Report, inspect
from compshard.optim import AdaScale
from compshard.options import CompileOptions
from compshard.pipelining import Pipeline, PipelineReport, pipeline
from compshard.predict import Forecast, forecast, plan
from compshard.sharding import ShardingConfig, no_sync, set_requires_gradient_sync, shard, sharding_config

# Installed, the backend is known through its entry point and Dynamo registers it when
# it is first asked for (even when that is this import); from a bare checkout, here.
if "compshard" not in torch._dynamo.list_backends(exclude_tags=()):
    torch._dynamo.register_backend(compshard_backend, name="compshard")

__all__ = [
    "__version__",
    "shard",
    "full_state_dict",
    "inspect",
    "Report",
    "CompileOptions",
    "ScheduleError",
    "compshard_backend",
    "pipeline",
    "Pipeline",
    "PipelineReport",
    "checkpoint",
    "clip_grad_norm_",
    "no_sync",
    "set_requires_gradient_sync",
    "sharding_config",
    "ShardingConfig",
    "forecast",
    "Forecast",
    "plan",  # deprecated: forecast
    "AdaScale",
]


def __getattr__(name: str) -> Any:
    """``PlanReport``: the deprecated name of :class:`Forecast` (a warning says so)."""
    if name == "PlanReport":
        from compshard import predict

        return predict.PlanReport
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
