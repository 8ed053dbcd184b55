"""Prediction: what a configuration will cost, read from the schedule the backend chooses.

- :mod:`~compshard.predict.inspection`: ``compshard.inspect`` compiles a module in this
  process and returns a :class:`Report` of every graph's schedule, with its estimated
  memory and time.
- :mod:`~compshard.predict.prediction`: ``compshard.plan`` predicts one training step at
  N ranks on given hardware (a :class:`PlanReport`), from one process: it inspects a fake
  copy of the model sharded over a fake process group.
- :mod:`~compshard.predict.hardware`: the hardware a prediction is made for (presets, or
  this machine measured).

This layer sits above the backend and the sharding (it compiles through them) and
nothing below it imports it; the estimates it reads (the cost model, the memory model,
the timeline) live below, where the passes use them too.
"""

from __future__ import annotations

from compshard.predict import hardware
from compshard.predict.hardware import Hardware
from compshard.predict.inspection import Report, inspect
from compshard.predict.prediction import PlanReport, plan

__all__ = ["Hardware", "PlanReport", "Report", "hardware", "inspect", "plan"]
