"""The parameter-lifecycle vocabulary: the ``torch.library`` custom ops the passes match.

``compshard::unshard(shard) -> full``
    All-gathers one parameter's local ``Shard(0)`` rows within its shard group into the
    full tensor (cast to the compute dtype first, when one is set). Its autograd formula
    depends on ``grad_sync`` (a static fact, so a compiled graph has one formula):
    ``"reduce"``: ``reduce_grad``; ``"accumulate"`` (gradient sync off, see
    :mod:`compshard.sharding.grad_sync`): the full gradient goes to ``grad_sink``, a full-shape
    compshard-owned leaf whose ``.grad`` autograd accumulates, and no collective runs;
    ``"fold"``: ``grad_sink`` is that accumulated gradient, added to this gradient
    before the one ``reduce_grad``.
    With ``norm_sink`` (a 0-d float32 leaf), the gradient's squared L2 norm in this
    backward, before anything is added to it, is also returned as ``norm_sink``'s
    gradient (so autograd sums it over the parameters that share the sink and the
    backwards until it is read): this rank's local statistics for
    :class:`compshard.AdaScale`, computed where the gradient is, in the graph.
    With ``held`` (strategy ``"shard_optimizer"``: the full tensor kept on every rank
    between steps), nothing is gathered: the result is ``held``'s value (the lowering
    reads ``held`` itself, no copy), the gradient formula the same.
``compshard::reduce_grad(full_grad) -> local_grad``
    Reduce-scatters a full gradient to this rank's rows within the shard group
    (all-reduces a replicated one), then all-reduces the result across the replica group
    when there is one (hybrid sharding, or no sharding), divided by the number of ranks
    first, then summed: the average over all data-parallel ranks, as DDP does.

Eagerly the ops communicate for real (so an uncompiled or graph-broken module trains
correctly, one blocking collective per parameter and module call); in a compiled graph they are markers that
the lowering passes replace by asynchronous functional collectives. Besides tensors,
``unshard`` and ``reduce_grad`` take one ``spec`` string (:mod:`compshard.comm.op_spec`).
Parameters are identified by name (``param``), so every rank sees the same op arguments;
``reshard_after_forward`` tells the partitioning passes whether the gathered tensor may
be saved for backward (it does not change what the op computes).

The ops the lowerings insert live with what they serve: the bucket copies and ``free``
in :mod:`compshard.comm.bucket_ops`, the in-place gloo starts (``gather_rows_``,
``exchange_rows_``) in :mod:`compshard.comm.transport`. Importing this module registers
all of them.
"""

from __future__ import annotations

import functools

import torch

from compshard.comm import bucket_ops  # noqa: F401  (registers the bucket copies and free)
from compshard.comm.layout import ShardLayout, group_rank, group_size, padded
from compshard.comm.op_spec import ReduceGradArgs, UnshardArgs
from compshard.comm.transport import all_gather_rows, sum_over_ranks

__all__ = ["averaging_ranks", "square_norm"]


def _shard_layout(full_shape: list[int], world_size: int, group_name: str) -> ShardLayout:
    return ShardLayout(tuple(full_shape), world_size, group_rank(group_name))


# ---------------------------------------------------------------------------- unshard


@torch.library.custom_op("compshard::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    spec: str,
    grad_sink: torch.Tensor | None,
    norm_sink: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    if held is not None:  # the full tensor is held already (shard_optimizer): nothing to gather
        return held.clone()
    args = UnshardArgs.of(shard, spec, grad_sink)
    layout = _shard_layout(args.full_shape, args.world_size, args.group_name)
    flat = shard.reshape(-1).to(args.param_dtype or shard.dtype)
    if layout.replicated or args.world_size == 1:
        return flat.clone().view(args.full_shape)
    buffer = flat.new_empty(args.world_size * layout.padded_shard_numel)
    buffer.view(args.world_size, -1)[layout.rank].copy_(padded(flat, layout.padded_shard_numel))
    gathered = all_gather_rows(buffer, args.world_size, args.group_name)
    return gathered[: layout.numel].view(args.full_shape).clone()


@unshard.register_fake
def _(shard, spec, grad_sink, norm_sink=None, held=None):
    args = UnshardArgs.of(shard, spec, grad_sink)
    return shard.new_empty(args.full_shape, dtype=args.param_dtype or shard.dtype)


@functools.cache
def _reduce_spec(unshard_spec: str, shard_dtype: torch.dtype) -> str:
    """``reduce_grad``'s spec for the gradient of ``unshard(shard, unshard_spec, ...)``."""
    return UnshardArgs.of(None, unshard_spec, None).reduce_args(shard_dtype).spec()


def _unshard_setup_context(ctx, inputs, output):
    shard, spec, grad_sink, norm_sink, _ = inputs
    args = UnshardArgs.of(shard, spec, grad_sink)
    ctx.grad_sync = args.grad_sync
    ctx.notes_norm = norm_sink is not None
    ctx.reduce_spec = _reduce_spec(spec, shard.dtype)
    if args.grad_sync == "accumulate":
        ctx.sink_dtype = grad_sink.dtype
    elif args.grad_sync == "fold":
        ctx.save_for_backward(grad_sink)


def _unshard_backward(ctx, grad):
    norm = square_norm(grad) if ctx.notes_norm else None
    if ctx.grad_sync == "accumulate":  # autograd adds it to grad_sink.grad; nothing is communicated
        return None, None, grad.to(ctx.sink_dtype), norm, None
    if ctx.grad_sync == "fold":
        (accumulated,) = ctx.saved_tensors
        grad = grad.to(accumulated.dtype) + accumulated
    return torch.ops.compshard.reduce_grad(grad, ctx.reduce_spec), None, None, norm, None


def square_norm(grad: torch.Tensor) -> torch.Tensor:
    """The squared L2 norm of ``grad``, a 0-d float32 tensor (summed in float32)."""
    return torch.linalg.vector_norm(grad, dtype=torch.float32).square()


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# ------------------------------------------------------------------------ reduce_grad


@torch.library.custom_op("compshard::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, spec: str) -> torch.Tensor:
    args = ReduceGradArgs.of(grad, spec)
    layout = _shard_layout(args.full_shape, args.world_size, args.group_name)
    ranks = averaging_ranks(args.world_size, args.replicate_group)
    flat = grad.reshape(-1).to(args.reduce_dtype or grad.dtype)
    if ranks == 1:
        return flat.to(args.shard_dtype).view(layout.local_shape).clone()
    flat = sum_over_ranks(flat / ranks, layout, args.group_name, args.replicate_group)
    return flat.to(args.shard_dtype).view(layout.local_shape)


@reduce_grad.register_fake
def _(grad, spec):
    args = ReduceGradArgs.of(grad, spec)
    layout = _shard_layout(args.full_shape, args.world_size, args.group_name)
    return grad.new_empty(layout.local_shape, dtype=args.shard_dtype)


def averaging_ranks(world_size: int, replicate_group: str) -> int:
    """How many ranks a gradient is averaged over (``reduce_grad`` divides by this before
    summing): the shard group's and the replica group's."""
    return world_size * group_size(replicate_group)
