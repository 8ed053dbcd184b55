"""Communication between ranks: the collectives and the waits on peers.

- :mod:`~compshard.comm.ops`: the ``compshard::unshard`` and ``compshard::reduce_grad``
  custom ops with their autograd; importing it registers every ``compshard::`` op.
- :mod:`~compshard.comm.op_spec`: those ops' ``spec`` argument, read and written by name.
- :mod:`~compshard.comm.layout`: the shard layout (which rows a rank holds) and the
  process-group helpers.
- :mod:`~compshard.comm.transport`: how a group's collectives run (``transport_for``,
  the one place that decides; on gloo as sends and receives of rows) and the eager
  collectives that run that way.
- :mod:`~compshard.comm.bucket_ops`: the bucket copies and ``free`` the lowerings
  insert, and ``direct_call`` for graph runners.
- :mod:`~compshard.comm.rank_exchange`: values every rank must agree on at compile
  time, exchanged through the c10d store.
- :mod:`~compshard.comm.liveness`: whether the other ranks are alive, and what stopped
  them; every wait on peers asks here.

This layer imports nothing of compshard but :mod:`compshard.compile_plan` (its error
type) and :mod:`compshard.kernels`: the passes, the eager gathers and the backend all
build on it.
"""

from __future__ import annotations

from compshard.comm import bucket_ops, layout, liveness, op_spec, ops, rank_exchange, transport

__all__ = ["bucket_ops", "layout", "liveness", "op_spec", "ops", "rank_exchange", "transport"]
