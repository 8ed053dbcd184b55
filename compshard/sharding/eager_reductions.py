"""Uncompiled gradient reductions whose collectives do not depend on the data.

Uncompiled, what gets gathered may depend on the data (:mod:`compshard.sharding.reads`
makes the gathers themselves the same on every rank: a gather unit gathers on entry).
The order in which autograd finishes the gradients of gathered parameters follows the
shape of the autograd graph, which the routing changes too. So uncompiled gathers form a
stack in gather order, and only its top is reduce-scattered: a gather's gradient is
reduced when every gather after it has been (:class:`EagerReductions`, the *walk*); what
is left when the backward ends is reduced then, in the same order. A gather that its
call never used (a skipped expert: its autograd node is gone while others of the same
call still take part in the backward) is reduced with a zero gradient, its true
contribution, so the other ranks' reductions find a partner. When autograd finishes
gradients in reverse forward order (the usual case) each is reduced at once; otherwise
the price is memory: a full gradient waits for those ahead of it. Compiled graphs reduce
inside their backward, as scheduled (an unused gathered output's gradient is zeros there
too).

Gathers made while a backward runs go on top of the stack like any other: a reentrant
checkpoint's recompute or a reversible block's reconstruction gathers the parameters
again and back-propagates through them in a nested backward, whose gradients are reduced
as they come, before the forward's gathers below; a non-reentrant checkpoint's recompute
is never back-propagated, so its gathers are dropped when their graph goes. Where those
gathers fall among the forward's follows autograd's order of the backward's nodes, the
same on every rank for the same graph. A gradient that reaches a gather the walk has
passed (a second backward through a retained graph, one run inside the forward) puts it
back on top, to be reduced again.

A parameter's gathers made while one of them waits share one reduction (a tied
embedding and head, a block called twice, a recompute while the forward's gather waits):
their gradients are summed in the gathered dtype, in the order autograd produces them,
and reduced once, when the walk has passed the last of them. That is what a compiled
graph does with the uses of its one ``unshard`` of the parameter, so both paths train a
model whose weights have several uses alike (bitwise, for GPT-2's tied weights in bf16).
At the end of each backward every gradient it delivered is checked to have reached its
parameter's ``.grad`` (as each reduction lands, not by reading ``.grad`` at the end, which
a hook may have emptied); one that did not is an error naming the parameter, never a
silent ``None``. ``backward(create_graph=True)`` through a gather is refused, naming the
parameter: its reduction is not differentiable.

Hooks on a parameter: autograd never sees a sharded parameter's gradient (a gather's
backward takes it from a leaf of the gather's own, so that autograd does not run the
parameter's hooks with no gradient), so compshard runs what autograd would run there.
Post-accumulate-grad hooks run as each parameter's reduction lands in ``.grad``
(:func:`accumulate_grad`; uncompiled, when the walk passes the parameter's last gather
on the stack; compiled, at the end of the backward, where
``compshard.sharding.grad_routing.move_local_gradients`` delivers the graphs' gradients), once per
parameter and backward, ``param.grad`` the sharded gradient: optimizer in backward works
as with FSDP2. A parameter that one step reads both in a compiled graph and in uncompiled
code gets its hooks once, from the compiled delivery, which comes last. A
``register_hook`` hook (on the gradient before it is accumulated) cannot run: it is an
error naming the parameter at its uncompiled gather, before any collective of the step,
or at the compiled delivery.

Consequence: a parameter that a unit gathers but that no rank uses in a step gets a
zero gradient, not ``None``: an optimizer with weight decay or momentum still moves it,
unlike eager training, where an unused parameter keeps ``grad=None``. A parameter
gathered on every rank that reaches the loss on some ranks only, while its autograd node
stays alive (used in an output the loss ignores), makes the ranks' reductions differ,
as with DDP without ``find_unused_parameters``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from compshard.comm.op_spec import ReduceGradArgs, UnshardArgs
from compshard.sharding.grad_norms import GradNorms

__all__ = [
    "EagerReductions",
    "accumulate_grad",
    "add_grad",
    "check_no_tensor_hooks",
    "gather",
    "run_post_accumulate_grad_hooks",
]


@dataclass(eq=False)
class _Reduction:
    """One ``compshard::reduce_grad`` of a parameter's gradient, shared by the parameter's
    gathers made while it is open (a tied weight read by two modules, a block called
    twice, a recompute's gather while the forward's waits): their gradients are summed in
    the gathered dtype in the order autograd produces them, as a compiled graph sums the
    uses of its one ``unshard``, and reduced once, when the walk has passed every one."""

    param: nn.Parameter
    reduce_args: ReduceGradArgs  # compshard::reduce_grad's arguments, the gradient None
    gathered_dtype: torch.dtype  # a skipped gather's zero gradient is made in it, on ``device``
    device: torch.device
    sink: torch.Tensor | None = None  # "fold": the gradient accumulated under no_sync, added before reducing
    total: torch.Tensor | None = None  # the sum of the gradients received so far
    waiting: int = 0  # its gathers the walk has not passed yet
    contributed: bool = False  # a gather was passed with a gradient, or skipped (its zeros)
    done: bool = False  # reduced, and the reduced rows reached the parameter's .grad

    @property
    def fqn(self) -> str:
        return self.reduce_args.param


@dataclass(eq=False)
class _Pending:
    """One uncompiled gather, on the stack of :class:`EagerReductions` until the walk passes it."""

    reduction: _Reduction
    call: list[_Pending]  # the gathers of the same unit call (this one alone outside a call)
    ready: bool = False  # autograd has produced its whole gradient (or, passed as skipped, its zeros)
    stacked: bool = True
    node: Callable[[], Any] = lambda: None  # weak reference to the gather's autograd node

    @property
    def skipped(self) -> bool:
        """Its gathered tensor is gone unused, while its call takes part in the backward."""
        return (
            not self.ready
            and self.node() is None
            and any(other.ready or other.node() is not None for other in self.call)
        )


@dataclass
class EagerReductions:
    """The uncompiled gathers of one sharded model awaiting their gradients: a stack in
    gather order, whose top is reduced as soon as its gradient is in (the *walk*)."""

    stack: list[_Pending] = field(default_factory=list)
    open: dict[str, _Reduction] = field(default_factory=dict)  # parameter name -> its open reduction
    open_call: list[_Pending] | None = None  # the gathers of the unit call being entered
    received_now: list[_Pending] = field(default_factory=list)  # gradients of this backward, for the check
    in_backward: bool = False  # a backward has delivered a gradient; ``finish`` is queued at its end
    norms: GradNorms | None = None  # where each reduced gradient's local squared norm goes (compshard.AdaScale)

    def push(
        self,
        param: nn.Parameter,
        reduce_args: ReduceGradArgs,
        gathered_dtype: torch.dtype,
        device: torch.device,
        call: list[_Pending],
        sink: torch.Tensor | None = None,
    ) -> _Pending:
        """A new gather on top of the stack, sharing the parameter's open reduction."""
        item = _Pending(_Reduction(param, reduce_args, gathered_dtype, device, sink), call)
        call.append(item)
        self._stack(item)
        return item

    def _stack(self, item: _Pending) -> None:
        """Put ``item`` on top, its gradient joining its parameter's open reduction if there is one."""
        own = item.reduction
        reduction = self.open.setdefault(own.fqn, own)
        if reduction is not own:
            if own.sink is not None:
                reduction.sink = own.sink if reduction.sink is None else reduction.sink + own.sink
            item.reduction = reduction
        reduction.waiting += 1
        item.stacked = True
        self.stack.append(item)

    def received(self, item: _Pending, grad: torch.Tensor) -> None:
        """Autograd's gradient of ``item``'s gathered tensor: added to its reduction; then the walk."""
        reduction = item.reduction
        if grad.requires_grad:
            raise RuntimeError(
                f"compshard: backward(create_graph=True) reached the gather of parameter "
                f"'{reduction.fqn}': its reduced gradient cannot be differentiated again; "
                "differentiate with respect to inputs or activations only (torch.autograd.grad), "
                "or use create_graph=False"
            )
        if not item.stacked:  # passed already (a retained graph's second backward): on the stack again
            item.reduction = _Reduction(
                reduction.param, reduction.reduce_args, reduction.gathered_dtype, reduction.device
            )
            self._stack(item)
            reduction = item.reduction
        reduction.total = grad if reduction.total is None else reduction.total + grad
        item.ready = True
        self.received_now.append(item)
        if not self.in_backward:  # the first gradient of this backward: what is left is reduced at its end
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        while self.stack and (self.stack[-1].ready or self.stack[-1].node() is None):
            self._pass(self.stack.pop())

    def finish(self) -> None:
        """End of backward: pass every gather left on the stack, top to bottom, reducing as
        the walk does (the skipped gathers' zeros included), then check that every
        gradient this backward produced was reduced. Gathers whose gradient has not come
        stay while their autograd node lives (the forward of a later micro-batch, whose
        backward runs later under a pipeline schedule), with a reduction of their own: the
        gradients already in are reduced now."""
        self.in_backward = False
        kept: list[_Pending] = []
        fresh: dict[str, _Reduction] = {}
        for item in reversed(self.stack):
            if item.ready or item.node() is None:
                self._pass(item)
                continue
            old = item.reduction
            item.reduction = fresh.setdefault(
                old.fqn, _Reduction(old.param, old.reduce_args, old.gathered_dtype, old.device)
            )
            item.reduction.waiting += 1
            self._leave(old)
            kept.append(item)
        self.stack = kept[::-1]
        self.open = fresh
        received, self.received_now = self.received_now, []
        lost = {item.reduction.fqn: None for item in received if not item.reduction.done}
        if lost:
            raise RuntimeError(
                f"compshard: the gradients of parameters {', '.join(map(repr, lost))} reached their "
                "uncompiled gathers in this backward but were not reduced into .grad (a bug in "
                "compshard: please report it with the model)"
            )

    def _pass(self, item: _Pending) -> None:
        """The walk passes ``item``: its gradient is in, or it is skipped (zeros) or gone."""
        item.stacked = False
        if item.ready or item.skipped:
            item.ready = True  # passed (a skipped gather's zeros included): its call takes part
            item.reduction.contributed = True
        self._leave(item.reduction)

    def _leave(self, reduction: _Reduction) -> None:
        reduction.waiting -= 1
        if reduction.waiting:
            return
        if self.open.get(reduction.fqn) is reduction:
            del self.open[reduction.fqn]
        if reduction.contributed:
            self._reduce(reduction)

    def _reduce(self, reduction: _Reduction) -> None:
        """Reduce ``reduction``'s gradient into its parameter's ``.grad``, then run the
        parameter's post-accumulate-grad hooks: the reduction is the parameter's whole
        gradient of this backward (its gathers made while it is open share it), unless
        compiled graphs deliver more of it at the backward's end, which then runs them."""
        param = reduction.param
        check_no_tensor_hooks(param, reduction.fqn)
        grad = reduction.total
        if grad is None:  # skipped: its contribution to the sum over ranks is zero
            shape = reduction.reduce_args.full_shape
            grad = torch.zeros(shape, dtype=reduction.gathered_dtype, device=reduction.device)
        if self.norms is not None:  # this backward's gradient, before the accumulation is folded in
            self.norms.note(reduction.fqn, grad)
        if reduction.sink is not None:  # as the compiled "fold" backward adds it
            grad = grad.to(reduction.sink.dtype) + reduction.sink
        reduction.total = reduction.sink = None
        add_grad(param, reduction.reduce_args._replace(grad=grad).call())
        # Delivered: tracked here, not read from .grad at the end of the backward, where a
        # hook stepping an optimizer (optimizer in backward) may have set it to None.
        reduction.done = param.grad is not None
        if reduction.done and not delivered_by_compiled_graphs(param):  # (not done: finish names it)
            run_post_accumulate_grad_hooks(param)


def add_grad(param: nn.Parameter, local_grad: torch.Tensor) -> None:
    """Add ``local_grad`` (this rank's rows of a reduced gradient) to ``param.grad``."""
    local_grad = local_grad.to(param.device)
    if isinstance(param, DTensor):  # wrapped with the parameter's spec directly: from_local's autograd Function is slow
        local_grad = DTensor(local_grad, param._spec, requires_grad=False)
    if param.grad is None:
        param.grad = local_grad
    else:
        param.grad += local_grad


def accumulate_grad(param: nn.Parameter, local_grad: torch.Tensor, name: str) -> None:
    """Deliver this rank's rows of ``param``'s reduced gradient, whole for this backward
    (or reduction): add them to ``param.grad``, then run the parameter's
    post-accumulate-grad hooks, as autograd's accumulation would. Compiled graphs'
    gradients (``compshard.sharding.grad_routing.move_local_gradients``, at the end of the backward)
    and explicitly reduced accumulations (``compshard.sharding.grad_sync``) arrive here; ``name``:
    the parameter's canonical name."""
    check_no_tensor_hooks(param, name)
    add_grad(param, local_grad)
    run_post_accumulate_grad_hooks(param)


def delivered_by_compiled_graphs(param: nn.Parameter) -> bool:
    """Whether a compiled graph's backward leaves (or has left) a gradient of ``param`` in
    the running backward, on the local tensor that compiled graphs take: then
    ``compshard.sharding.grad_routing.move_local_gradients`` delivers it at the end of the backward and
    runs the hooks, once for both paths' pieces (a parameter read in a compiled graph and
    in uncompiled code of one step)."""
    if not isinstance(param, DTensor) or not param._local_tensor.requires_grad:
        return False
    local = param._local_tensor
    if local.grad is not None:  # left by a compiled backward that ran earlier in this one
        return True
    try:  # whether the local tensor's AccumulateGrad node is in the running backward's graph
        return bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(local).node))
    except RuntimeError:  # not inside a backward
        return False


def run_post_accumulate_grad_hooks(param: nn.Parameter) -> None:
    """Run the hooks registered with ``param.register_post_accumulate_grad_hook``, in
    registration order, in no-grad mode, as autograd does after accumulating ``.grad``
    (and as FSDP2 does after its reduce-scatter). Autograd never runs them itself for a
    sharded parameter: its gradient reaches ``.grad`` by assignment."""
    hooks = param._post_accumulate_grad_hooks
    if not hooks:
        return
    with torch.no_grad():
        for hook in tuple(hooks.values()):
            hook(param)


def check_no_tensor_hooks(param: nn.Parameter, name: str) -> None:
    """Refuse a hook registered with ``param.register_hook`` (``name``: the parameter's
    canonical name): autograd never hands a sharded parameter its gradient, so
    such a hook would silently never run (see the module docstring)."""
    if not param._backward_hooks:
        return
    raise RuntimeError(
        f"compshard: parameter '{name}' has a hook registered with register_hook, which compshard "
        "cannot run: a sharded parameter's gradient is reduced across ranks and assigned to .grad, "
        "never passed through autograd's hooks on the parameter. Use "
        "param.register_post_accumulate_grad_hook(hook): it runs once the reduced gradient is in "
        "param.grad (the sharded gradient, this rank's rows); remove the register_hook hook"
    )


class _DeferredGather(torch.autograd.Function):
    """``unshard`` whose backward hands the full gradient to :class:`EagerReductions`
    (its input: a leaf detached from the parameter, which gets no gradient from autograd)."""

    @staticmethod
    def forward(
        ctx: Any,
        shard: torch.Tensor,
        reductions: EagerReductions,
        item: _Pending,
        args: UnshardArgs,
        held: torch.Tensor | None,
    ) -> torch.Tensor:
        ctx.reductions, ctx.item = reductions, item
        item.node = weakref.ref(ctx)
        return held.view_as(held) if held is not None else args._replace(shard=shard).call()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None, None]:
        ctx.reductions.received(ctx.item, grad)
        return None, None, None, None, None


class _HeldAccumulation(torch.autograd.Function):
    """A held full tensor (``"shard_optimizer"``) read under ``no_sync``: its gradient goes
    to the parameter's gradient sink, as ``unshard``'s ``"accumulate"`` formula sends it."""

    @staticmethod
    def forward(ctx: Any, sink: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
        ctx.sink_dtype = sink.dtype
        return held.view_as(held)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.sink_dtype), None


def gather(
    param: nn.Parameter,
    shard: torch.Tensor,
    unshard_args: tuple[str, torch.Tensor | None],
    reductions: EagerReductions,
    communicates: bool,
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    """Uncompiled ``compshard::unshard`` of ``shard`` (``param``'s local rows).

    ``unshard_args``: the op's arguments after the shard (its spec and gradient sink).
    ``held``: the parameter's full tensor held between steps (``"shard_optimizer"``),
    returned instead of a gathered one (a view: nothing is copied).
    When the gradient is reduced by a collective (``communicates``, or its local norm is
    taken: ``reductions.norms``), in sync mode ``reduce`` or ``fold``, and autograd
    records, the reduction is deferred to the end of backward; otherwise the op runs as
    is.
    """
    communicates = communicates or reductions.norms is not None
    args = UnshardArgs.of(shard, *unshard_args)
    if args.grad_sync == "accumulate":
        # The gradient goes to the sink, none to the shard: detached, no backward reaches
        # the parameter (torch 2.11's to_local would hand it zeros for that None).
        args = args._replace(shard=shard.detach())
    if not (communicates and args.grad_sync != "accumulate" and torch.is_grad_enabled() and param.requires_grad):
        if held is None:
            return args.call()
        if args.grad_sync == "accumulate" and torch.is_grad_enabled() and param.requires_grad:
            return _HeldAccumulation.apply(args.grad_sink, held)
        return held.detach()
    check_no_tensor_hooks(param, args.param)  # before any collective of this step
    gathered_dtype = args.param_dtype if args.param_dtype is not None else shard.dtype
    call = reductions.open_call if reductions.open_call is not None else []
    sink = None
    if args.grad_sync == "fold":  # the gradient accumulated under no_sync joins this one's reduction
        sink = args.grad_sink
        args = args._replace(grad_sync="reduce", grad_sink=None)
    item = reductions.push(
        param,
        args.reduce_args(shard.dtype),
        gathered_dtype,
        shard.device,
        call,
        sink,
    )
    # A leaf of its own, not the parameter: autograd would run the parameter's hooks as its
    # AccumulateGrad node ran (with no gradient, before the reduction); the reduction delivers
    # the gradient and runs its post-accumulate-grad hooks (EagerReductions._reduce) instead.
    return _DeferredGather.apply(shard.detach().requires_grad_(), reductions, item, args, held)
