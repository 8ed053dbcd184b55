"""Optimizer tools for sharded models: :class:`AdaScale` (the lr scaled to the batch)."""

from compshard.optim.adascale import AdaScale

__all__ = ["AdaScale"]
