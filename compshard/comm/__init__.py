"""Communication between ranks: the collectives and the waits on peers.

- :mod:`~compshard.comm.ops`: the ``compshard::`` custom ops (``unshard``,
  ``reduce_grad`` and the bucket copies), the shard layout, the process-group helpers
  and the collectives they run (on gloo as sends and receives of rows); importing it
  registers the ops.
- :mod:`~compshard.comm.rank_exchange`: values every rank must agree on at compile
  time, exchanged through the c10d store.
- :mod:`~compshard.comm.liveness`: whether the other ranks are alive, and what stopped
  them; every wait on peers asks here.

This layer imports nothing of compshard but :mod:`compshard.compile_plan` (its error
type) and :mod:`compshard.kernels`: the passes, the eager gathers and the backend all
build on it.
"""

from __future__ import annotations

from compshard.comm import liveness, ops, rank_exchange

__all__ = ["liveness", "ops", "rank_exchange"]
