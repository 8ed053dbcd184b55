"""Pipeline parallelism (``compshard.pipeline``), beside the backend rather than in it.

- :mod:`~compshard.pipelining.stages`: the captured forward split into ``K`` contiguous
  stages balanced by estimated cost, and each stage's module.
- :mod:`~compshard.pipelining.runner`: ``compshard.pipeline`` builds this rank's
  :class:`Pipeline` from that split and runs it under ``torch.distributed.pipelining``'s
  schedules, each stage sharded with ``compshard.shard`` and compiled with the backend.

This layer uses the sharding, the eager gathers and the backend as a user would, and
nothing below it imports it.
"""

from __future__ import annotations

from compshard.pipelining.runner import Pipeline, PipelineReport, pipeline

__all__ = ["Pipeline", "PipelineReport", "pipeline"]
