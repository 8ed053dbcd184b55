"""Expert parallelism's collectives: tokens to their expert's rank and back, by all-to-all.

``compshard::expert_all_to_all(hidden, top_k_index, top_k_weights, weights, layer)``
    One mixture-of-experts layer's experts, split across the ranks of an expert-parallel
    group (see ``docs/expert_parallel.md``). Each rank routes its own tokens (the router
    ran before, data-parallel); here every ``(token, slot)`` pair goes to the rank that
    holds its expert, sorted by expert: the per-expert counts are exchanged first (an
    all-to-all of ``E`` integers), then the tokens (an all-to-all of rows; a rank may send
    none to a peer and still takes part). The receiving rank runs its experts with the
    model's own code (the experts module's forward over the tokens received, each routed
    to one local expert with weight 1), the outputs come back by a second all-to-all, and
    each token's output is ``sum_j weight_j * expert_j(token)``, as the model computes it.
    Returns that output ``(T, H)``, the per-slot expert outputs ``(T, k, H)`` (which the
    backward weighs the routing gradient with) and the counts received ``(ep, E_local)``.
``compshard::expert_all_to_all_backward``
    The backward: the tokens and their output gradients go to the experts again (one
    all-to-all: the forward keeps no received rows, whose number the data decide), each
    rank recomputes its experts under autograd for the gradients of the tokens and of its
    expert weights, and the token gradients come back by a second all-to-all. The expert
    weights' gradients are scaled by ``1 / ep``: they sum every rank's tokens, where a
    data-parallel gradient is the average over ranks.

[Note: one op per layer, static shapes] How many tokens a rank receives depends on the
routing, so tensors of that size exist only inside these ops; what a compiled graph sees
has the shapes of the layer's input, and Dynamo never specializes on a token count (no
recompile when the routing changes). Every rank calls each op once per layer call,
whatever the routing, and the counts exchange is one of its collectives: the
collectives never depend on the data (a rank that routes nothing to a peer still sends
it a count of zero). The all-to-alls run on the layer's own process group, so they never
interleave with compshard's gathers on the data-parallel group.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from compshard.comm.layout import resolve_group
from compshard.comm.transport import WatchedWork

__all__ = ["EXPERT_OPS", "ExpertLayer", "register_layer", "registered_layer"]


@dataclass(frozen=True)
class ExpertLayer:
    """One experts module split across an expert-parallel group: what its ops need.

    ``experts``: the module's parameter names, each with a leading expert dimension;
    ``plain_class``: the module's own class, whose ``forward`` runs the local experts;
    ``group_name``: the expert-parallel group (``ep_size`` ranks; this rank holds experts
    ``[ep_rank * experts_per_rank, (ep_rank + 1) * experts_per_rank)``);
    ``capacity``: at most this many ``(token, slot)`` pairs a rank sends to one expert
    per call (the rest dropped: they add nothing to the output), ``None``: no limit."""

    fqn: str
    module: weakref.ReferenceType[nn.Module]
    plain_class: type[nn.Module]
    experts: tuple[str, ...]
    num_experts: int
    group_name: str
    ep_size: int
    ep_rank: int
    capacity_factor: float | None

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep_size

    def expected_bytes(self, pairs: int, row_bytes: int, backward: bool) -> int:
        """Bytes this rank sends other ranks in one call of the forward (``backward``:
        of the backward) op for ``pairs`` ``(token, slot)`` pairs of ``row_bytes`` each,
        when the routing spreads them evenly over the experts: the forward sends the rows
        and gets the outputs back (two rows per pair), the backward sends rows and
        gradients and gets gradients back (three), a fraction ``(ep - 1) / ep`` of them to
        other ranks; plus the counts (8 bytes an expert)."""
        rounds = 3 if backward else 2
        remote = pairs * row_bytes * rounds * (self.ep_size - 1) // self.ep_size
        return remote + (0 if backward else 8 * self.num_experts)


_LAYERS: dict[str, ExpertLayer] = {}  # key (the ops' ``layer`` argument) -> layer


def register_layer(key: str, layer: ExpertLayer) -> None:
    """Make ``key`` name ``layer`` in the ops' ``layer`` argument."""
    _LAYERS[key] = layer


def registered_layer(key: str) -> ExpertLayer:
    """The layer ``key`` names; it outlives its module, so that a report can still read
    it (only running the experts needs the module: :func:`_local_experts`)."""
    layer = _LAYERS.get(key)
    if layer is None:
        raise RuntimeError(f"compshard: expert layer {key!r} is not registered")
    return layer


@dataclass(frozen=True)
class _Routing:
    """Where this rank's ``(token, slot)`` pairs go: sorted by expert (``order``: slot
    indices; ``tokens``: their token rows), how many to each expert (``per_expert``) and
    to each rank of the group (``per_rank``); ``kept``: of the sorted pairs, those within
    the capacity (all when there is none)."""

    order: torch.Tensor
    tokens: torch.Tensor
    per_expert: torch.Tensor
    per_rank: list[int]
    kept: torch.Tensor | None


def _route(layer: ExpertLayer, top_k_index: torch.Tensor) -> _Routing:
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    per_expert = torch.bincount(flat, minlength=layer.num_experts)
    kept = None
    if layer.capacity_factor is not None:
        capacity = _capacity(layer, flat.numel())
        sorted_experts = flat[order]
        starts = torch.cumsum(per_expert, 0) - per_expert
        position = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
        kept = position < capacity
        order = order[kept]
        per_expert = per_expert.clamp(max=capacity)
    per_rank = per_expert.view(layer.ep_size, layer.experts_per_rank).sum(1).tolist()
    return _Routing(order, order // k, per_expert, per_rank, kept)


def _capacity(layer: ExpertLayer, pairs: int) -> int:
    """Pairs a rank may send one expert: ``ceil(factor * pairs / experts)``, at least 1."""
    assert layer.capacity_factor is not None
    return max(1, -(-int(layer.capacity_factor * pairs) // layer.num_experts))


def _all_to_all(layer: ExpertLayer, rows: torch.Tensor, send: Sequence[int], receive: Sequence[int]) -> torch.Tensor:
    """``rows`` (``sum(send)`` of them) split to the group's ranks, ``receive`` rows back
    from each; waited, a failed peer named (:class:`~compshard.comm.transport.WatchedWork`)."""
    output = rows.new_empty((sum(receive), *rows.shape[1:]))
    work = dist.all_to_all_single(
        output, rows.contiguous(), list(receive), list(send), group=resolve_group(layer.group_name), async_op=True
    )
    assert work is not None
    WatchedWork([work], layer.group_name).wait()
    return output


def _exchange_counts(layer: ExpertLayer, per_expert: torch.Tensor) -> torch.Tensor:
    """The counts each rank of the group sends this rank's experts: ``(ep, experts_per_rank)``."""
    share = [layer.experts_per_rank] * layer.ep_size
    return _all_to_all(layer, per_expert, share, share).view(layer.ep_size, layer.experts_per_rank)


def _local_experts(
    layer: ExpertLayer, weights: Sequence[torch.Tensor], received: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """The local experts' outputs for ``received`` rows (by source rank, then local
    expert, ``counts`` of each), run by the module's own forward on a stand-in module
    that holds ``weights`` and routes each row to its expert with weight 1."""
    module = layer.module()
    if module is None:
        raise RuntimeError(f"compshard: the experts module '{layer.fqn}' is gone (its model was deleted)")
    stand_in = copy.copy(module)
    stand_in.__class__ = layer.plain_class
    stand_in.__dict__.pop("forward", None)
    # plain tensors, read by nn.Module.__getattr__ as parameters are (no leaf of the model's)
    stand_in._parameters = dict(zip(layer.experts, weights))  # type: ignore[arg-type]
    if hasattr(stand_in, "num_experts"):
        stand_in.__dict__["num_experts"] = layer.experts_per_rank
    experts = torch.arange(layer.experts_per_rank, device=received.device).repeat(layer.ep_size)
    index = torch.repeat_interleave(experts, counts.reshape(-1))[:, None]
    ones = torch.ones(index.shape, dtype=received.dtype, device=received.device)
    return layer.plain_class.forward(stand_in, received, index, ones)


def _weighted_sum(expert_out: torch.Tensor, top_k_weights: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for slot in range(expert_out.shape[1]):
        out += (expert_out[:, slot] * top_k_weights[:, slot, None]).to(out.dtype)
    return out


@torch.library.custom_op("compshard::expert_all_to_all", mutates_args=())
def expert_all_to_all(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: list[torch.Tensor],
    layer: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    expert_layer = registered_layer(layer)
    routing = _route(expert_layer, top_k_index)
    counts = _exchange_counts(expert_layer, routing.per_expert)
    received_per_rank = counts.sum(1).tolist()
    received = _all_to_all(expert_layer, hidden[routing.tokens], routing.per_rank, received_per_rank)
    with torch.no_grad():
        outputs = _local_experts(expert_layer, weights, received, counts).to(hidden.dtype)
    returned = _all_to_all(expert_layer, outputs, received_per_rank, routing.per_rank)
    tokens, k = top_k_index.shape
    expert_out = hidden.new_zeros((tokens * k, hidden.shape[1]))
    expert_out[routing.order] = returned
    expert_out = expert_out.view(tokens, k, -1)
    return _weighted_sum(expert_out, top_k_weights, hidden), expert_out, counts


@expert_all_to_all.register_fake
def _(hidden, top_k_index, top_k_weights, weights, layer):
    expert_layer = registered_layer(layer)
    tokens, k = top_k_index.shape
    counts = top_k_index.new_empty((expert_layer.ep_size, expert_layer.experts_per_rank), dtype=torch.int64)
    return torch.empty_like(hidden), hidden.new_empty((tokens, k, hidden.shape[1])), counts


@contextlib.contextmanager
def _autograd_recording() -> Iterator[None]:
    """Autograd records within, inside a custom op's implementation.

    [Note: autograd inside the backward op] A custom op runs below the autograd dispatch
    key (its keys are excluded for the call) with grad mode off, so the experts'
    recompute there would record nothing. The backward needs the experts' own gradients
    (the module's code, whatever it is), so for that recompute the autograd keys come
    back and grad mode is on; nothing recorded leaves the op (its results are detached
    gradients)."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded), torch.enable_grad():
        yield


_AUTOGRAD_KEYS = (
    torch._C.DispatchKey.AutogradFunctionality,
    torch._C.DispatchKey.AutogradOther,
    torch._C.DispatchKey.AutogradNestedTensor,
)


@torch.library.custom_op("compshard::expert_all_to_all_backward", mutates_args=())
def expert_all_to_all_backward(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    weights: list[torch.Tensor],
    expert_out: torch.Tensor,
    counts: torch.Tensor,
    layer: str,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    expert_layer = registered_layer(layer)
    routing = _route(expert_layer, top_k_index)
    received_per_rank = counts.sum(1).tolist()
    grad_weights_of_routing = (grad_out[:, None, :] * expert_out).sum(-1).to(top_k_weights.dtype)
    grad_expert_out = (grad_out[:, None, :] * top_k_weights[..., None]).to(expert_out.dtype)
    sent_grads = grad_expert_out.reshape(-1, hidden.shape[1])[routing.order]
    sent_tokens = hidden[routing.tokens]
    if sent_grads.dtype == sent_tokens.dtype:  # one all-to-all for both
        both = _all_to_all(expert_layer, torch.cat([sent_tokens, sent_grads], 1), routing.per_rank, received_per_rank)
        received, received_grads = both.split(hidden.shape[1], 1)
    else:
        received = _all_to_all(expert_layer, sent_tokens, routing.per_rank, received_per_rank)
        received_grads = _all_to_all(expert_layer, sent_grads, routing.per_rank, received_per_rank)
    with _autograd_recording():
        rows = received.detach().requires_grad_()
        leaves = [w.detach().requires_grad_() for w in weights]
        outputs = _local_experts(expert_layer, leaves, rows, counts).to(hidden.dtype)
        grads = (
            torch.autograd.grad(outputs, [rows, *leaves], received_grads, allow_unused=True)
            if outputs.requires_grad  # not when no row came: nothing to differentiate
            else (None,) * (1 + len(leaves))
        )
    grad_rows = grads[0] if grads[0] is not None else torch.zeros_like(rows)
    scale = 1.0 / expert_layer.ep_size
    grad_weights = [torch.zeros_like(w) if g is None else g * scale for g, w in zip(grads[1:], weights)]
    returned = _all_to_all(expert_layer, grad_rows.detach(), received_per_rank, routing.per_rank)
    grad_hidden = torch.zeros_like(hidden)
    grad_hidden.index_add_(0, routing.tokens, returned.to(hidden.dtype))
    return grad_hidden, grad_weights_of_routing, grad_weights


@expert_all_to_all_backward.register_fake
def _(grad_out, hidden, top_k_index, top_k_weights, weights, expert_out, counts, layer):
    return torch.empty_like(hidden), torch.empty_like(top_k_weights), [torch.empty_like(w) for w in weights]


def _setup_context(ctx, inputs, output) -> None:
    hidden, top_k_index, top_k_weights, weights, layer = inputs
    _, expert_out, counts = output
    ctx.save_for_backward(hidden, top_k_index, top_k_weights, expert_out, counts, *weights)
    ctx.layer = layer
    ctx.mark_non_differentiable(expert_out, counts)


def _backward(ctx, grad_out, grad_expert_out, grad_counts):
    hidden, top_k_index, top_k_weights, expert_out, counts, *weights = ctx.saved_tensors
    grad_hidden, grad_routing, grad_weights = torch.ops.compshard.expert_all_to_all_backward(
        grad_out, hidden, top_k_index, top_k_weights, weights, expert_out, counts, ctx.layer
    )
    return grad_hidden, None, grad_routing, grad_weights, None


expert_all_to_all.register_autograd(_backward, setup_context=_setup_context)

# the ops as a graph holds them: (op, whether it is the backward's)
EXPERT_OPS = {
    torch.ops.compshard.expert_all_to_all.default: False,
    torch.ops.compshard.expert_all_to_all_backward.default: True,
}
