"""Prediction: what a configuration will cost at N ranks, read from the schedule the
backend chooses for a fake copy of the model.

- :mod:`~compshard.predict.forecasting`: ``compshard.forecast`` (``compshard.plan``, its
  deprecated name), its arguments, the configurations it forecasts and where (this
  process, a subprocess, rank 0).
- :mod:`~compshard.predict.forecast_report`: what it returns, a :class:`Forecast` with its
  memory and step-time estimates and the sharding keywords forecast with.
- :mod:`~compshard.predict.fake_world`: the fake copies of the model and the fake process
  group of N ranks they are sharded in.
- :mod:`~compshard.predict.estimates`: the adapter to the backend: compile a fake copy
  with ``compshard.inspect`` and read the schedule's estimates.
- :mod:`~compshard.predict.peak_memory`: memory at a graph's peak, by what holds it.
- :mod:`~compshard.predict.pricing`: step time beyond the passes' estimates (timings,
  tensor parallelism's collectives, the optimizer, the longest waits).
- :mod:`~compshard.predict.depth`: deep models forecast from shallower copies.
- :mod:`~compshard.predict.hardware`: the hardware a prediction is made for (presets, or
  this machine measured).

This layer sits above the backend, the sharding and the inspection (it compiles through
them) and nothing but ``compshard`` imports it; the estimates it reads (the cost model,
the memory model, the timeline) live below, where the passes use them too.
``Report`` and ``inspect`` are :mod:`compshard.inspection`'s, named here too.
"""

from __future__ import annotations

import warnings
from typing import Any

from compshard.inspection import Report, inspect
from compshard.predict import hardware
from compshard.predict.forecast_report import Forecast, MemoryEstimate, ShardKeywords, StepEstimate
from compshard.predict.forecasting import forecast, plan
from compshard.predict.hardware import Hardware

__all__ = [
    "Forecast",
    "Hardware",
    "MemoryEstimate",
    "Report",
    "ShardKeywords",
    "StepEstimate",
    "forecast",
    "hardware",
    "inspect",
    "plan",
]


def __getattr__(name: str) -> Any:
    """``PlanReport``: the deprecated name of :class:`Forecast`."""
    if name == "PlanReport":
        warnings.warn("compshard.PlanReport is deprecated: it is compshard.Forecast", FutureWarning, stacklevel=2)
        return Forecast
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
