"""Each rank's local gradient statistics, taken where compshard reduces the gradients.

:class:`compshard.AdaScale` needs, per optimizer parameter group and step, the sum over
this rank's backward passes of each parameter's squared gradient norm *before* the
gradients are averaged across ranks. FairScale takes it with a hook on every parameter;
compshard's gradients never reach a parameter's hooks unreduced, but every gradient
passes through one place before its reduction, and the norm is taken there:

- compiled, reduced (or folded) in this backward: ``compshard::unshard``'s backward
  formula, given the group's *norm sink* (a 0-d float32 leaf), returns the gradient's
  squared norm as the sink's gradient, in the graph, so autograd sums it into the
  sink's ``.grad`` (:func:`compshard.comm.ops.square_norm`);
- uncompiled, reduced: :class:`~compshard.sharding.eager_reductions.EagerReductions`
  adds it when it reduces a parameter's gradient (the sum of its gathers' gradients in
  this backward, before a ``no_sync`` accumulation is folded in);
- accumulated without sync (``no_sync``), compiled or not: a hook on the parameter's
  gradient sink (a leaf compshard owns, never the user's parameter), which autograd
  calls once per backward with the parameter's whole gradient of that pass.

So each parameter contributes one squared norm per backward, of its gradient summed
over all its uses in that backward, as FairScale's hook sees it. Compiled, that holds
per graph: a parameter read in two graphs of one backward (a graph break between a tied
embedding and its head) contributes the norms of its two partial gradients.

Whether the sinks are passed is a static fact of each compiled graph: the read path
reads ``GradSync.norms``, so Dynamo guards on it, and graphs traced before the
statistics were attached are traced again with the sinks at the next call.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch

from compshard.comm.ops import square_norm

__all__ = ["GradNorms"]


class GradNorms:
    """The norm sinks of one sharded model, one per optimizer parameter group, and the
    backward passes seen since the statistics were last taken.

    ``groups``: canonical parameter name -> its group's index (parameters not in the
    mapping are not counted); ``devices``: group index -> the device its sink lives on."""

    def __init__(self, groups: Mapping[str, int], devices: Mapping[int, torch.device]) -> None:
        self.group_of = dict(groups)
        self.sinks = {
            index: torch.zeros((), dtype=torch.float32, device=device).requires_grad_()
            for index, device in devices.items()
        }
        for sink in self.sinks.values():
            sink.register_hook(self._count_pass)
        self.by_param = {name: self.sinks[index] for name, index in self.group_of.items()}
        self.passes = 0
        self._counted = False

    def sink_for(self, name: str) -> torch.Tensor | None:
        """The norm sink that parameter ``name``'s gradient norm goes to (None: not counted)."""
        return self.by_param.get(name)

    def note(self, name: str, grad: torch.Tensor) -> None:
        """Add ``grad``'s squared norm (parameter ``name``'s gradient of this backward)
        to its group's sink."""
        sink = self.by_param.get(name)
        if sink is None:
            return
        norm = square_norm(grad.detach()).to(sink.device)
        sink.grad = norm if sink.grad is None else sink.grad + norm
        self._count_pass(norm)

    def sink_hook(self, name: str) -> functools.partial:
        """The hook for parameter ``name``'s gradient sink (``no_sync`` accumulation)."""
        return functools.partial(self._note_accumulated, name)

    def _note_accumulated(self, name: str, grad: torch.Tensor) -> None:
        with torch.no_grad():
            self.note(name, grad)

    def _count_pass(self, grad: torch.Tensor) -> None:
        """Count the running backward once, however many norms it delivers."""
        if not self._counted:
            self._counted = True
            self.passes += 1
            torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def _end_pass(self) -> None:
        self._counted = False

    def take(self) -> torch.Tensor:
        """Each group's summed squared norms (float32, by group index), the sinks and the
        count of passes emptied for the next step."""
        sums = [
            sink.grad.detach().reshape(()) if sink.grad is not None else torch.zeros((), device=sink.device)
            for sink in self.sinks.values()
        ]
        for sink in self.sinks.values():
            sink.grad = None
        self.passes = 0
        return torch.stack([value.to(sums[0].device) for value in sums])
