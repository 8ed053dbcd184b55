"""Uncompiled parameter gathering whose collectives do not depend on the data.

A sharded module runs uncompiled when it is not compiled at all and wherever a graph
break sends part of it back to Python. There every read of ``module.<name>`` is a real
all-gather, and what gets read may depend on the data: transformers' loop over the experts
a batch routed to reads the 3-D expert weights once per expert hit, and a ``ModuleList``
of expert modules calls only the experts hit, a different set on each rank. Two rules
keep every rank issuing the same collectives in the same order whatever the data decide:

- **A unit gathers on entry.** A *gather unit* gathers the parameters it covers on entry
  to each call, and reads inside the call return those tensors (:func:`install_call_scope`),
  however often the data read them, or not at all. Each repeated block (``layers.3``,
  see :mod:`compshard.module_tree`) is a unit covering every parameter beneath it, as
  FSDP2 gathers per wrapped block, so an expert module one rank skips is gathered on
  every rank all the same; outside blocks, each module is a unit of its own parameters.
  The gathered tensors are dropped when the call returns, as FSDP2 reshards after a
  module's forward.
- **Gradients reduced in reverse gather order.** The order in which autograd finishes
  the gradients of gathered parameters follows the shape of the autograd graph, which
  the routing changes. So an uncompiled gather's gradient is reduce-scattered only when
  every gather after it has had its gradient reduced; what is still waiting when the
  backward ends is reduced then, in the same order (:class:`EagerReductions`). A gather
  that its call never used (a skipped expert: its autograd node is gone while others of
  the same call still take part in the backward) is reduced with a zero gradient, its
  true contribution, so the other ranks' reductions find a partner. When autograd
  finishes gradients in reverse forward order (the usual case) each is reduced at once;
  otherwise the price is memory: a full gradient waits for those ahead of it. Compiled
  graphs reduce inside their backward, as scheduled (an unused gathered output's
  gradient is zeros there too).

Consequence: a parameter that a unit gathers but that no rank uses in a step gets a
zero gradient, not ``None``: an optimizer with weight decay or momentum still moves it,
unlike eager training, where an unused parameter keeps ``grad=None``. A parameter
gathered on every rank that reaches the loss on some ranks only, while its autograd node
stays alive (used in an output the loss ignores), makes the ranks' reductions differ,
as with DDP without ``find_unused_parameters``.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.ops import UnshardArgs

__all__ = ["EagerReductions", "accumulate_grad", "gather", "install_call_scope", "needs_call_scope"]


@dataclass
class _Pending:
    """One uncompiled gather whose gradient is reduced in reverse gather order."""

    param: nn.Parameter
    reduce_args: tuple  # compshard::reduce_grad's arguments after the gradient
    gathered_dtype: torch.dtype  # a skipped gather's zero gradient is made in it, on ``device``
    device: torch.device
    call: list[_Pending]  # the gathers of the same unit call (this one alone outside a call)
    grad: torch.Tensor | None = None
    ready: bool = False  # autograd has produced its whole gradient
    node: Callable[[], Any] = lambda: None  # weak reference to the gather's autograd node

    @property
    def skipped(self) -> bool:
        """Its gathered tensor is gone unused, while its call takes part in the backward."""
        return not self.ready and self.node() is None and any(
            other.ready or other.node() is not None for other in self.call)


@dataclass
class EagerReductions:
    """The uncompiled gathers of one sharded model awaiting their gradients, in gather
    order; ``next`` is the index of the one to reduce next (set when a backward starts)."""

    pending: list[_Pending] = field(default_factory=list)
    next: int | None = None
    open_call: list[_Pending] | None = None  # the gathers of the unit call being entered

    def received(self, item: _Pending, grad: torch.Tensor) -> None:
        item.grad = grad if item.grad is None else item.grad + grad
        item.ready = True
        if self.next is None:  # the first gradient of this backward: reduce the rest at its end
            self.next = len(self.pending) - 1
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        while self.next >= 0 and (self.pending[self.next].ready or self.pending[self.next].skipped):
            self._reduce(self.pending[self.next])
            self.next -= 1

    def finish(self) -> None:
        """End of backward: reduce the gradients still waiting, and the skipped gathers'
        zeros, in the same order. Gathers whose gradient has not come stay pending while
        their autograd node lives (the forward of a later micro-batch, whose backward runs
        later under a pipeline schedule); those of a call whose graph is gone (a forward
        never differentiated) are dropped."""
        for index in range(self.next, -1, -1):
            if self.pending[index].ready or self.pending[index].skipped:
                self._reduce(self.pending[index])
        self.pending = [item for item in self.pending if not item.ready and item.node() is not None]
        self.next = None

    @staticmethod
    def _reduce(item: _Pending) -> None:
        grad = item.grad
        if grad is None:  # skipped: its contribution to the sum over ranks is zero
            grad = torch.zeros(item.reduce_args[0], dtype=item.gathered_dtype, device=item.device)
        local_grad = torch.ops.compshard.reduce_grad(grad, *item.reduce_args)
        item.grad = None
        item.ready = True  # reduced (a skipped gather's zeros included)
        accumulate_grad(item.param, local_grad)


def accumulate_grad(param: nn.Parameter, local_grad: torch.Tensor) -> None:
    """Add ``local_grad`` (this rank's rows of a reduced gradient) to ``param.grad``."""
    local_grad = local_grad.to(param.device)
    if isinstance(param, DTensor):  # the parameter's spec: from_local's autograd Function costs ~50 us a tensor
        local_grad = DTensor(local_grad, param._spec, requires_grad=False)
    if param.grad is None:
        param.grad = local_grad
    else:
        param.grad += local_grad


class _DeferredGather(torch.autograd.Function):
    """``unshard`` whose backward hands the full gradient to :class:`EagerReductions`."""

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, reductions: EagerReductions, item: _Pending,
                args: UnshardArgs) -> torch.Tensor:
        ctx.reductions, ctx.item = reductions, item
        item.node = weakref.ref(ctx)
        return torch.ops.compshard.unshard(*args._replace(shard=shard))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.reductions.received(ctx.item, grad)
        return None, None, None, None


def gather(param: nn.Parameter, shard: torch.Tensor, unshard_args: tuple, reductions: EagerReductions,
           communicates: bool) -> torch.Tensor:
    """Uncompiled ``compshard::unshard`` of ``shard`` (``param``'s local rows).

    ``unshard_args``: the op's arguments after the shard. When the gradient is reduced
    by a collective (``communicates`` and sync mode ``reduce`` or ``fold``) and autograd
    records, the reduction is deferred to the end of backward; otherwise the op runs as is.
    """
    args = UnshardArgs(shard, *unshard_args)
    if args.grad_sync == "accumulate":
        # The gradient goes to the sink, none to the shard: detached, no backward reaches
        # the parameter (torch 2.11's to_local would hand it zeros for that None).
        args = args._replace(shard=shard.detach())
    if not (communicates and args.grad_sync != "accumulate" and torch.is_grad_enabled() and param.requires_grad):
        return torch.ops.compshard.unshard(*args)
    gathered_dtype = args.param_dtype if args.param_dtype is not None else shard.dtype
    call = reductions.open_call if reductions.open_call is not None else []
    item = _Pending(param, (args.full_shape, args.world_size, args.group_name, args.param, args.reduce_dtype,
                            shard.dtype, args.replicate_group), gathered_dtype, shard.device, call)
    call.append(item)
    if args.grad_sync == "fold":  # the gradient accumulated under no_sync joins this one's reduction
        item.grad = args.grad_sink
        args = args._replace(grad_sync="reduce", grad_sink=None)
    reductions.pending.append(item)
    return _DeferredGather.apply(shard, reductions, item, args)


def _enter_call(unshard: Callable[[nn.Module, str], torch.Tensor], unit: nn.Module, args: Any) -> None:
    members = unit._compshard_members
    reductions = None if torch.compiler.is_compiling() else members[0][0]._compshard_grad_sync.eager
    if reductions is not None:
        reductions.open_call = []
    try:
        gathered = {module._compshard_specs[name].fqn: unshard(module, name) for module, name in members}
    finally:
        if reductions is not None:
            reductions.open_call = None
    unit._compshard_calls.append(gathered)


def _exit_call(unit: nn.Module, args: Any, output: Any) -> None:
    if unit._compshard_calls:
        unit._compshard_calls.pop()


# torch.nn modules whose forward reads each parameter exactly once, whatever the data:
# a gather at that read is the gather at call entry, so they need no call scope (and
# compile faster without its hooks: fewer traced calls and guards per module).
_READS_EACH_PARAMETER_ONCE = frozenset(cls.forward for cls in (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.PReLU,
    nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d,
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d,
))


def needs_call_scope(module: nn.Module) -> bool:
    """Whether ``module``'s reads of its parameters could differ from one gather each at
    call entry: any module but the torch.nn ones above with their own ``forward``."""
    return type(module).forward not in _READS_EACH_PARAMETER_ONCE


def install_call_scope(unit: nn.Module, members: list[tuple[nn.Module, str]],
                       unshard: Callable[[nn.Module, str], torch.Tensor]) -> None:
    """``unit`` gathers ``members`` (``(module, name)`` pairs, one per distinct parameter, in
    registration order) on entry to each call, with ``unshard(module, name)``; reads of
    them inside the call (:func:`read`) return those tensors, whatever the data decide to
    read. Compiled, the gathers are traced at the call's entry in whichever graph holds the
    call, so a graph break inside the unit's code leaves them where they are."""
    unit._compshard_calls = []
    unit._compshard_members = members
    for module, _ in members:
        module._compshard_unit = (unit,)  # a tuple: a module attribute would register a submodule
    unit.register_forward_pre_hook(functools.partial(_enter_call, unshard))
    unit.register_forward_hook(_exit_call, always_call=True)


def read(module: nn.Module, name: str, unshard: Callable[[nn.Module, str], torch.Tensor]) -> torch.Tensor:
    """``module.<name>``: the tensor its unit gathered on entry to the current call, or
    gathered now (a read outside a call of the unit, e.g. by a module of another unit, or a
    read of the root's own parameters: ``shard`` gives the root module no call scope, since
    its hooks would run outside its compiled forward as graphs of their own)."""
    unit = getattr(module, "_compshard_unit", None)
    if unit is not None and unit[0]._compshard_calls:
        return unit[0]._compshard_calls[-1][module._compshard_specs[name].fqn]
    return unshard(module, name)
