"""Gradient accumulation without communication: ``no_sync`` and ``set_requires_gradient_sync``.

With gradient sync off, each parameter's full gradient is not reduce-scattered: it is
accumulated, in the reduce dtype, into a full-size tensor that compshard owns (the
``.grad`` of a zero-stride full-shape leaf, the parameter's *gradient sink*). The next
forward with sync on hands that accumulated gradient to the parameter's ``unshard``,
whose backward adds it to the new gradient before the one reduce-scatter: k micro-batches
under ``no_sync`` plus one synced micro-batch communicate gradients once and produce the
gradient of the whole batch.

Whether sync is on is a static fact of each forward: the sharded attribute reads it (and
whether a sink holds a gradient) in plain Python, so a compiled module gets one graph
per mode (Dynamo guards on the flag): plain reduce, accumulate (its backward issues no
collective) and fold (the synced micro-batch after accumulation).

Memory trade-off: while gradients accumulate, every rank holds one *full* gradient per
parameter (as DDP does), ``shard_size`` times the sharded gradient, from the first
unsynced backward until the synced micro-batch's backward has consumed it. Use it when
communication, not memory, is the bottleneck.

When no synced forward follows the accumulation (a pipeline schedule runs the forward of
its last micro-batch before the backwards of earlier ones, so no forward can fold them),
:func:`reduce_accumulated_gradients` reduces every accumulated gradient once, explicitly,
in buckets (one collective for many parameters). It also reduces the full gradients
accumulated on parameters gathered once for the step (:mod:`compshard.sharding.step_gather`),
where no parameter read runs ``unshard`` at all.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch import nn

from compshard.comm.layout import ShardLayout, group_rank, group_size
from compshard.comm.op_spec import ReduceGradArgs
from compshard.comm.ops import averaging_ranks
from compshard.comm.transport import exchanged_rows, sum_over_ranks, sum_rows_into_shards, transport_for
from compshard.options import CompileOptions
from compshard.sharding.eager_reductions import EagerReductions, accumulate_grad
from compshard.sharding.grad_norms import GradNorms

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "GradSync",
    "consecutive_buckets",
    "grad_sync_state",
    "no_sync",
    "reduce_accumulated_gradients",
    "set_requires_gradient_sync",
]

DEFAULT_BUCKET_BYTES = int(CompileOptions().bucket_mb * 2**20)  # of full gradients per reduction


class GradSync:
    """Gradient-sync state shared by every sharded submodule of one ``shard`` call.

    ``specs``: parameter name -> its ``compshard.sharding.spec.ParamSpec`` (what a gradient
    sink is shaped by), registered by ``shard``."""

    def __init__(self) -> None:
        self.requires_sync = True
        self.eager = EagerReductions()  # uncompiled gathers awaiting their gradients
        self.specs: dict[str, Any] = {}
        # the DTensor parameters whose local tensors compiled graphs take, in registration order
        # (compshard.sharding.grad_routing.move_local_gradients); held here, not by weak reference: a
        # parameter with a weak reference cannot be swapped by nn.Module._apply (module.to())
        self.routed: dict[str, nn.Parameter] = {}  # by canonical name
        self.sinks: dict[str, torch.Tensor] = {}  # parameter name -> zero-stride full-shape leaf
        # parameter name -> full tensor gathered for the step, which parameter reads return and
        # whose .grad accumulates; None outside compshard.sharding.gathered_for_step
        self.step_gathered: dict[str, torch.Tensor] | None = None
        # strategy "shard_optimizer": parameter name -> its full tensor, held between steps, which
        # parameter reads return (compshard.sharding.held_params); None under other strategies
        self.held: dict[str, torch.Tensor] | None = None
        # each rank's local squared gradient norms, taken for compshard.AdaScale (None: not taken)
        self.norms: GradNorms | None = None

    def record_norms(self, norms: GradNorms | None) -> None:
        """Take each backward's local squared gradient norms into ``norms`` from now on
        (:mod:`compshard.sharding.grad_norms`; None: stop)."""
        self.norms = self.eager.norms = norms
        if norms is not None:
            for name, sink in self.sinks.items():
                sink.register_hook(norms.sink_hook(name))

    def claim(self, param: str) -> tuple[str, torch.Tensor | None]:
        """``(grad_sync, grad_sink)`` arguments of the parameter's next ``unshard``, claimed
        by that read: with sync on after accumulation, the first read takes the
        accumulated gradient out of its sink ("fold") and later reads reduce their own
        gradient alone, so a parameter read twice in one forward adds it once. This is
        the one state change a parameter read makes.
        """
        sink = self.sinks.get(param)
        if sink is None:
            return "reduce", None
        if not self.requires_sync:
            return "accumulate", sink
        accumulated = sink.grad
        if accumulated is None or not torch.is_grad_enabled():
            return "reduce", None
        sink.grad = None
        return "fold", accumulated

    def take_accumulated(self, name: str) -> torch.Tensor | None:
        """The full gradient of parameter ``name`` accumulated since the last reduction, in
        the reduce dtype, taken out of where it accumulates: the ``.grad`` of its
        step-gathered tensor (:mod:`compshard.sharding.step_gather`), whose storage is then freed
        (taking the gradient ends the parameter's step), else of its gradient sink.
        Zeros when nothing accumulated; ``None`` for a frozen parameter, or one whose
        gradients do not accumulate (sync never turned off, no step gathering)."""
        holder = self.step_gathered.get(name) if self.step_gathered is not None else self.sinks.get(name)
        if holder is None or not holder.requires_grad:
            return None
        spec = self.specs[name]
        grad = (
            holder.grad
            if holder.grad is not None
            else torch.zeros(spec.full_shape, dtype=holder.dtype, device=holder.device)
        )
        holder.grad = None
        if self.step_gathered is not None:
            del self.step_gathered[name]
            # Freed outright: the autograd graph of any output still alive (a loss the
            # caller holds) references the tensor, through its AccumulateGrad node.
            holder.untyped_storage().resize_(0)
        return grad.to(spec.reduce_dtype) if spec.reduce_dtype is not None else grad

    def reduce_accumulated(
        self, params: Mapping[str, nn.Parameter], *, divide_by: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        """Reduce every accumulated gradient (:meth:`take_accumulated`) once, divide this
        rank's rows by ``divide_by`` and add them to the parameter's ``.grad`` (``params``:
        name -> parameter); what held them is left empty.

        Parameters are taken in registration order (the same collectives in the same order
        on every rank) into buckets of consecutive parameters with the same groups and
        dtypes, each closed before its full gradients would pass ``bucket_bytes`` (a larger
        one is a bucket alone): one reduction per bucket (:func:`_reduce_bucket`),
        replicated (0-d) parameters one each. Memory: beside the full gradients, each
        released once its bucket is packed, one packed bucket (divided as it is packed)
        and what its reduction receives.

        A parameter that accumulated nothing contributes zeros, so that every rank issues
        the same collectives whatever ran: it then gets a zero gradient, not ``None``."""

        def accumulated() -> Iterator[_Accumulated]:  # lazily: each gradient taken as its bucket fills
            for name, spec in self.specs.items():
                grad = self.take_accumulated(name)
                if grad is not None:
                    yield _Accumulated(spec, grad, params[name])

        for bucket in consecutive_buckets(accumulated(), bucket_bytes, alone=lambda item: not item.spec.full_shape):
            _reduce_and_accumulate(bucket, divide_by)


class _Bucketable(Protocol):
    @property
    def key(self) -> Hashable: ...  # what the items of one bucket (one collective) must share

    @property
    def nbytes(self) -> int: ...


_Item = TypeVar("_Item", bound=_Bucketable)


def consecutive_buckets(items: Iterable[_Item], limit: int, *, alone: Callable[[_Item], bool]) -> Iterator[list[_Item]]:
    """``items`` in order as buckets of consecutive items with the same ``key``, each
    closed before its ``nbytes`` would pass ``limit`` (a larger item is a bucket alone).
    An item ``alone`` accepts is a bucket of its own at once, the open bucket staying
    open. Every rank passing the same items gets the same buckets. Lazy: items are
    taken one at a time, and a bucket is yielded as soon as the next item (or the end)
    closes it."""
    bucket: list[_Item] = []
    size = 0
    for item in items:
        if alone(item):
            yield [item]
            continue
        if bucket and (item.key != bucket[0].key or size + item.nbytes > limit):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += item.nbytes
    if bucket:
        yield bucket


class _Accumulated(NamedTuple):
    spec: Any  # compshard.sharding.ParamSpec
    grad: torch.Tensor  # full accumulated gradient, in the reduce dtype
    param: nn.Parameter

    @property
    def key(self) -> tuple:
        """What gradients reduced in one collective must share."""
        return (
            self.spec.world_size,
            self.spec.group_name,
            self.spec.replicate_group,
            self.grad.dtype,
            self.grad.device,
            self.param.dtype,
        )

    @property
    def nbytes(self) -> int:
        return self.grad.numel() * self.grad.element_size()


def _reduce_and_accumulate(bucket: list[_Accumulated], divide_by: int) -> None:
    """Reduce ``bucket`` and add this rank's rows, divided by ``divide_by``, to its
    parameters' ``.grad``. Empties ``bucket``, so that each full gradient is released once
    packed for the collective (it is referenced nowhere else)."""
    params = [(item.spec.fqn, item.param) for item in bucket]
    for (name, param), local_grad in zip(params, _reduce_bucket(bucket, divide_by)):
        accumulate_grad(param, local_grad, name)


def _reduce_bucket(bucket: list[_Accumulated], divide_by: int) -> list[torch.Tensor]:
    """This rank's reduced rows of each gradient of ``bucket`` (same :attr:`_Accumulated.key`):
    the gradients packed rank-major (row ``r`` of a ``[world_size, S]`` tensor holds rank
    ``r``'s rows of every gradient, zero-padded, as the compiled backward packs a bucket)
    and divided by the ranks (and ``divide_by``) as they are packed, that tensor reduced by
    ``compshard::reduce_grad``'s collectives (:func:`compshard.comm.transport.sum_over_ranks`; its
    ``Shard(0)`` row is this rank's), then unpacked. Where the reduction is an exchange
    and a sum (:attr:`compshard.comm.transport.Transport.reduce_scatters_by_exchange`) and there is no replica
    group, the exchanged rows are summed straight into each gradient's shard as they are
    unpacked, as the compiled backward does: no buffer of the sums, no copy of it. The
    arithmetic per element is that op's for each gradient alone (divide, then sum; one
    division by the ranks times ``divide_by``, not a second pass over the result),
    without its divided copy of the packed bucket. A replicated (0-d) parameter goes
    alone, through the op. Empties ``bucket`` (a 0-d parameter's excepted)."""
    first = bucket[0]
    spec, world_size, shard_dtype = first.spec, first.spec.world_size, first.param.dtype
    if not spec.full_shape:
        reduced = ReduceGradArgs(
            first.grad, [], world_size, spec.group_name, spec.fqn, None, shard_dtype, spec.replicate_group
        ).call()
        return [reduced / divide_by if divide_by != 1 else reduced]
    rank = group_rank(spec.group_name)
    layouts = [ShardLayout(item.spec.full_shape, world_size, rank) for item in bucket]
    shard_numels = [layout.padded_shard_numel for layout in layouts]
    divisor = averaging_ranks(world_size, spec.replicate_group) * divide_by
    packed = torch.ops.compshard.reduce_scatter_copy_in(
        [item.grad for item in bucket], shard_numels, world_size, first.grad.dtype, divisor if divisor != 1 else None
    )
    del first
    bucket.clear()  # the full gradients are packed: release them before the reduction allocates
    local_numels = [math.prod(layout.local_shape) for layout in layouts]
    if (
        world_size > 1
        and group_size(spec.replicate_group) == 1
        and transport_for(spec.group_name, packed.device).reduce_scatters_by_exchange
    ):
        received = exchanged_rows(packed, world_size, spec.group_name)
        flats = sum_rows_into_shards(received, shard_numels, local_numels, shard_dtype)
    else:
        reduced = sum_over_ranks(
            packed,
            ShardLayout((world_size, sum(shard_numels)), world_size, rank),
            spec.group_name,
            spec.replicate_group,
        )
        del packed  # (where the reduction returned a new tensor) before unpacking allocates
        flats = torch.ops.compshard.reduce_scatter_copy_out(reduced, shard_numels, local_numels, shard_dtype)
    return [flat.view(layout.local_shape) for flat, layout in zip(flats, layouts)]


def grad_sync_state(module: nn.Module) -> GradSync:
    """The gradient-sync state of ``module``, the module passed to ``compshard.shard``."""
    # (a submodule shares its root's state, but gradient sync is set on the root)
    state = module.__dict__.get("_compshard")
    if state is None or getattr(state, "config", None) is None:
        raise ValueError(
            "compshard: gradient sync is set on the module passed to compshard.shard; "
            f"{type(module).__name__} is not one"
        )
    grad_sync: GradSync = state.grad_sync
    return grad_sync


def set_requires_gradient_sync(module: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn gradient reduction on (the default) or off for ``module`` (the module passed to
    ``compshard.shard``). Off: backward accumulates full gradients locally (see the module
    docstring for the memory this takes); the first synced backward after reduces them
    together with its own gradient. Every rank must make the same calls."""
    if not isinstance(requires_gradient_sync, bool):
        raise TypeError(f"compshard: requires_gradient_sync must be True or False, got {requires_gradient_sync!r}")
    state = grad_sync_state(module)
    state.requires_sync = requires_gradient_sync
    if requires_gradient_sync:
        return
    params = dict(module.named_parameters())
    for name, spec in state.specs.items():
        if name in state.sinks or not params[name].requires_grad:
            continue
        dtype = spec.reduce_dtype or spec.param_dtype or params[name].dtype
        device = spec.compute_device or params[name].device
        sink = torch.zeros((), dtype=dtype, device=device).expand(spec.full_shape).requires_grad_()
        if state.norms is not None:
            sink.register_hook(state.norms.sink_hook(name))
        state.sinks[name] = sink


def reduce_accumulated_gradients(
    module: nn.Module, *, divide_by: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Reduce the gradients ``module`` (the module passed to ``compshard.shard``) accumulated
    with gradient sync off: one reduction per bucket of at most ``bucket_bytes`` of full
    gradients, in registration order, landing in the parameters' ``.grad`` divided by
    ``divide_by`` (see :meth:`GradSync.reduce_accumulated`). Every rank must call it at
    the same point."""
    with torch.no_grad():
        grad_sync_state(module).reduce_accumulated(
            dict(module.named_parameters()), divide_by=divide_by, bucket_bytes=bucket_bytes
        )


@contextlib.contextmanager
def no_sync(module: nn.Module) -> Iterator[nn.Module]:
    """Context in which ``module``'s backward passes accumulate gradients without
    communicating; sync is on again on exit::

        with compshard.no_sync(model):
            for x, y in micro_batches[:-1]:
                step_model(x, y).backward()
        step_model(*micro_batches[-1]).backward()   # one reduce-scatter for all of them
    """
    set_requires_gradient_sync(module, False)
    try:
        yield module
    finally:
        set_requires_gradient_sync(module, True)
